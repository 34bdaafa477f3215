"""The FSDP2 memory estimate (``pipette.memory``, ``FSDP_OPTIONS``) against what the PyTorch-native
runner measures: each candidate's ``peak_tensor_bytes`` (the largest over its ranks) next to the
estimate's tensors (``pipette.trials.tensor_peak_bytes``: the peak less the process overhead) and a
trace of the same step on fake tensors (``workers.rank.fsdp_trace.trace_heaviest``).

tiny-llama with the ``pipette tune`` default recipe (global batch 16 x 128, fp32), LoRA and full
fine-tuning, on 4 CPU ranks started by the FSDP test helpers (``tests.fsdp.cases.run_batch``: no Ray,
no DeepSpeed), 3 steps each: the peak is read on the second warm-up step, as a trial reads it by
default (``TrialSpec.warmup_steps`` 2; the first step also builds the optimizer state and FSDP2's
buffers). Run from the repository root, under the heavy-test lock::

    flock /tmp/pipette-heavy-tests.lock .venv/bin/python tests/benchmarks/fsdp_memory.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipette.config import ParallelConfig
from pipette.memory import estimate_memory
from pipette.model import MODEL_PRESETS
from pipette.stacks import FSDP
from pipette.training import LoraSpec, TrainingSpec
from pipette.trials import tensor_peak_bytes
from tests.fsdp.cases import run_batch
from workers.rank.fsdp_trace import trace_heaviest
from workers.spec import TrialSpec

MiB = 1024**2
GLOBAL_BATCH, SEQ = 16, 128
#: the candidates measured: the fsdp stack's modes on 4 devices (ParallelConfig fields)
MODES: dict[str, dict[str, Any]] = {
    "z3-dp4": {"dp": 4, "mbs": 4, "zero_stage": 3},
    "z2-dp4": {"dp": 4, "mbs": 4, "zero_stage": 2},
    "z0-dp4": {"dp": 4, "mbs": 4, "zero_stage": 0},
    "hsdp-2x2": {"dp": 4, "mbs": 4, "zero_stage": 3, "dp_shard": 2},
    "z3-dp4-mbs1": {"dp": 4, "mbs": 1, "zero_stage": 3},
    "tp2-dp2": {"tp": 2, "dp": 2, "mbs": 4, "zero_stage": 3},
    "pp2-dp2": {"pp": 2, "dp": 2, "mbs": 2, "zero_stage": 3},
    "z3-dp4-full-ac": {"dp": 4, "mbs": 4, "zero_stage": 3, "recompute": "full"},
}


def training(method: str) -> TrainingSpec:
    lora = LoraSpec(rank=8, alpha=16) if method == "lora" else None
    return TrainingSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32", method=method,  # type: ignore[arg-type]
                        lora=lora)


def trials() -> dict[str, TrialSpec]:
    model = MODEL_PRESETS["tiny-llama"]
    out = {}
    for method in ("lora", "full"):
        for name, mode in MODES.items():
            fields = dict(mode)
            config = ParallelConfig(tp=fields.pop("tp", 1), pp=fields.pop("pp", 1), dp=fields.pop("dp"),
                                    mbs=fields.pop("mbs"), global_batch=GLOBAL_BATCH, **fields)
            out[f"{name}/{method}"] = TrialSpec(model, training(method), config, warmup_steps=2, min_steps=1,
                                                max_steps=1, device_kind="cpu", stack="fsdp")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    cases = trials()
    batch = run_batch(cases, world=4, device_kind="cpu", timeout_s=900)
    rows = []
    print(f"{'case':<22} {'backend':<34} {'measured MiB':>12} {'traced MiB':>10} {'traced err':>10} "
          f"{'estimate MiB':>12} {'error':>7}")
    for name, trial in cases.items():
        done = batch["cases"][name]["done"]
        if len(done) != 4:
            print(f"{name:<22} failed: codes {batch['codes']}\n{batch['tails'][0][-2000:]}")
            return 1
        measured = max(int(e["peak_tensor_bytes"]) for e in done.values())
        est = estimate_memory(trial.model, trial.training, trial.config, 4 * 1024**3, device_kind="cpu", stack=FSDP)
        predicted = tensor_peak_bytes(est)
        error = predicted / measured - 1.0
        traced = trace_heaviest(trial)[0].peak_bytes
        backend = next(iter(done.values()))["backend"]
        rows.append({"case": name, "backend": backend, "measured_bytes": measured, "traced_bytes": traced,
                     "predicted_bytes": predicted, "error": error, "traced_error": traced / measured - 1.0,
                     "breakdown": est.breakdown})
        print(f"{name:<22} {backend:<34} {measured / MiB:>12.2f} {traced / MiB:>10.2f} {traced / measured - 1:>+10.1%} "
              f"{predicted / MiB:>12.2f} {error:>+7.1%}")
    for key, what in (("error", "estimate"), ("traced_error", "trace")):
        errors = [abs(r[key]) for r in rows]
        print(f"{what} against measured: mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%} "
              f"over {len(rows)} candidates")
    print(f"batch {batch['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
