"""The pipette stack's memory estimate against its DeepSpeed runner's measured peak on CPU ranks,
term by term, dense and Mixture-of-Experts, ZeRO 0-2, ep 1-2 (issue 46's CPU gate, issue 47's AutoEP
trials): each layout is run once on ``run_local`` (plain processes, gloo) and its measured live peak
(``workers.rank.memory.PeakTensorBytes``, max over the ranks) set beside ``estimate_memory``'s.

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/zero_cpu_memory.py [--models tiny-llama,tiny-moe]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if not any(Path(p or ".").resolve() == REPO for p in sys.path):
    sys.path.append(str(REPO))

from pipette.config import ParallelConfig  # noqa: E402
from pipette.memory import estimate_memory  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.training import TrainingSpec  # noqa: E402
from workers.host.local import run_local  # noqa: E402
from workers.spec import TrialSpec  # noqa: E402

MIB = 2**20


def layouts(model: ModelSpec, dp: int) -> list[tuple[int, int, int]]:
    """(zero, ep, mbs) of each layout run."""
    eps = [1, dp] if model.moe is not None else [1]
    return [(zero, ep, mbs) for zero in (0, 1, 2) for ep in eps for mbs in (1, 4)
            if not (ep > 1 and zero > 2)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", default="tiny-llama,tiny-moe")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    errors = []
    for name in args.models.split(","):
        model = ModelSpec.preset(name)
        for zero, ep, mbs in layouts(model, args.dp):
            training = TrainingSpec(global_batch=args.batch, seq_len=args.seq, dtype="fp32")
            config = ParallelConfig(tp=1, pp=1, dp=args.dp, ep=ep, mbs=mbs, global_batch=args.batch,
                                    zero_stage=zero)
            m = run_local(TrialSpec(model, training, config, warmup_steps=2, min_steps=2, max_steps=2),
                          timeout_s=300)
            est = estimate_memory(model, training, config, 64 * 2**30, device_kind="cpu", stack="pipette")
            if m.status != "ok":
                print(f"{name} z{zero} ep{ep} mbs{mbs}: {m.status} {m.error}")
                continue
            measured = max(m.peak_memory)
            # the CPU estimate adds the process's own bytes (CPU_PROCESS_OVERHEAD_BYTES), which the
            # measured live peak, tensors only, does not hold
            live = est.peak_bytes - est.breakdown.get("overhead", 0)
            err = live / measured - 1
            errors.append(abs(err))
            terms = " ".join(f"{k} {v / MIB:.1f}" for k, v in est.breakdown.items() if v and k != "overhead")
            print(f"{name} z{zero} ep{ep} mbs{mbs}: measured {measured / MIB:.1f} MiB, estimate "
                  f"{live / MIB:.1f} ({err:+.1%}) [{terms}]", flush=True)
    if errors:
        print(f"MAPE {100 * sum(errors) / len(errors):.1f}% over {len(errors)} layouts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
