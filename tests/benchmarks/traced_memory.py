"""The fsdp stack's memory estimate (``pipette.memory``, ``FSDP_OPTIONS``) against a trace of the
PyTorch-native runner's own step (``workers.rank.fsdp_trace``: fake tensors, a fake process group at
the real world size) on Llama 3 8B and 70B layouts no CPU trial reaches.

Live bytes only on both sides: the trace's peak (what ``max_memory_allocated`` counts) against the
estimate's ``live_bytes`` (its peak without the overhead part: the heaviest of FSDP2's phases,
``pipette.memory_fsdp2``, whose name is printed). Term by term: the model states
(trace: parameters, gradients and optimizer; estimate: weights, gradients, optimizer and buffers,
which hold FSDP2's gathered layers and the reduce-scatter's copies) and the transient bytes (trace:
activations and the backward's temporaries; estimate: activations and logits). The trace is of one
rank per pipeline stage; the heaviest is compared with the estimate's heaviest stage.

    .venv/bin/python tests/benchmarks/traced_memory.py [--only NAME ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipette.config import ParallelConfig
from pipette.memory import estimate_memory, stage_breakdowns
from pipette.memory_fsdp2 import PHASES
from pipette.model import MODEL_PRESETS
from pipette.stacks import FSDP, get_stack
from pipette.training import TrainingSpec
from workers.rank.fsdp_trace import trace_heaviest
from workers.spec import TrialSpec

GiB = 1024**3
SEQ = 8192
#: name -> (model, ParallelConfig fields): bf16, AdamW, full fine-tuning, sequence 8192, global
#: batch one micro-batch per replica x the pipeline's micro-batches
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "8b-dp8": ("llama3-8b", {"dp": 8, "mbs": 1, "zero_stage": 3, "recompute": "selective"}),
    "8b-dp8-ac-full": ("llama3-8b", {"dp": 8, "mbs": 2, "zero_stage": 3, "recompute": "full"}),
    "8b-tp2-dp4": ("llama3-8b", {"tp": 2, "dp": 4, "mbs": 1, "zero_stage": 3, "recompute": "selective"}),
    "8b-pp2-dp4": ("llama3-8b", {"pp": 2, "dp": 4, "mbs": 1, "zero_stage": 3, "recompute": "selective", "accum": 4}),
    "8b-dp64": ("llama3-8b", {"dp": 64, "mbs": 1, "zero_stage": 3, "recompute": "selective"}),
    "8b-hsdp-8x16": ("llama3-8b", {"dp": 128, "dp_shard": 8, "mbs": 1, "zero_stage": 3, "recompute": "selective"}),
    "70b-tp8-dp8": ("llama3-70b", {"tp": 8, "dp": 8, "mbs": 1, "zero_stage": 3, "recompute": "full"}),
    "70b-tp8-pp4-dp8": ("llama3-70b", {"tp": 8, "pp": 4, "dp": 8, "mbs": 1, "zero_stage": 3, "recompute": "full",
                                       "accum": 8}),
    # Llama 3 70B's layer, embedding and head with 10 of its 80 decoder layers: a trace of the whole
    # model takes over 5 minutes on the 2-core VM; the estimate is of the same 10-layer model
    "70b-10l-tp8-dp8": ("llama3-70b", {"layers": 10, "tp": 8, "dp": 8, "mbs": 1, "zero_stage": 3,
                                       "recompute": "full"}),
    "70b-10l-tp8-dp8-sac": ("llama3-70b", {"layers": 10, "tp": 8, "dp": 8, "mbs": 1, "zero_stage": 3,
                                           "recompute": "selective"}),
}


def trial_of(model_name: str, fields: dict[str, Any]) -> TrialSpec:
    f = dict(fields)
    accum = f.pop("accum", 1)
    model = MODEL_PRESETS[model_name]
    if "layers" in f:
        model = replace(model, layers=f.pop("layers"))
    tp, pp, dp, mbs = f.pop("tp", 1), f.pop("pp", 1), f.pop("dp"), f.pop("mbs")
    global_batch = dp * mbs * accum
    training = TrainingSpec(global_batch=global_batch, seq_len=SEQ, dtype="bf16", method="full")
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=mbs, global_batch=global_batch, **f)
    return TrialSpec(model, training, config, device_kind="cpu", stack="fsdp")


def heaviest_phase(trial: TrialSpec, stage: int) -> str:
    """The phase of the step (``pipette.memory_fsdp2.PHASES``) whose bytes the estimate of ``stage`` is."""
    options = get_stack(FSDP).memory_options
    live = {ph: stage_breakdowns(trial.model, trial.training, trial.config, options=options, phase=ph)[stage]
            for ph in PHASES}
    return max(live, key=lambda ph: sum(live[ph].values()) - live[ph]["overhead"])


def compare(name: str, trial: TrialSpec) -> dict[str, Any]:
    """One layout's row: the heaviest traced rank against the estimate, term by term."""
    start = time.perf_counter()
    traces = trace_heaviest(trial)
    top = traces[0]
    est = estimate_memory(trial.model, trial.training, trial.config, 141 * GiB, stack=FSDP)
    b = est.breakdown
    traced_states = top.at_peak["parameters"] + top.at_peak["gradients"] + top.at_peak["optimizer"]
    traced_transient = top.at_peak["activations"] + top.at_peak["temporaries"]
    est_states = b["weights"] + b["gradients"] + b["optimizer"] + b["buffers"]
    est_transient = b["activations"] + b["logits"]
    return {
        "layout": name, "world": trial.config.world, "traced_stage": top.stage, "estimate_stage": est.stage,
        "phase": top.phase, "traced_bytes": top.peak_bytes, "estimate_live_bytes": est.live_bytes,
        "error": est.live_bytes / top.peak_bytes - 1, "estimate_phase": heaviest_phase(trial, est.stage),
        "traced_states": traced_states, "estimate_states": est_states,
        "traced_transient": traced_transient, "estimate_transient": est_transient,
        "traced": top.at_peak, "traced_max": top.category_max, "estimate": b,
        "seconds": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="layouts to run (default: all)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    names = args.only or list(LAYOUTS)
    rows = []
    print(f"{'layout':<20} {'ranks':>5} {'traced GiB':>10} {'est GiB':>8} {'error':>7} "
          f"{'states t/e':>13} {'transient t/e':>14} {'peak in':>9} {'est phase':>9} {'s':>4}")
    for name in names:
        model_name, fields = LAYOUTS[name]
        row = compare(name, trial_of(model_name, fields))
        rows.append(row)
        print(f"{name:<20} {row['world']:>5} {row['traced_bytes'] / GiB:>10.2f} "
              f"{row['estimate_live_bytes'] / GiB:>8.2f} {row['error']:>+7.1%} "
              f"{row['traced_states'] / GiB:>6.2f}/{row['estimate_states'] / GiB:<6.2f} "
              f"{row['traced_transient'] / GiB:>6.2f}/{row['estimate_transient'] / GiB:<7.2f} "
              f"{row['phase']:>9} {row['estimate_phase']:>9} {row['seconds']:>4.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
