"""The fsdp stack's CPU terms, measured: fsdp-runner trials on CPU ranks, and the fit of
``pipette.stacks.FSDP_CPU_CONSTANTS`` on them (issue 31).

``FSDP_CONSTANTS`` are fitted on H100 runs (llm-foundry); on CPU workers their analytic step
time was 23x under the first fsdp trial (docs/fsdp.md). The pipette stack's CPU pricing (the
CPU GEMM curve, ``pipette.efficiency``, with the HF constants) is no ground for fsdp either: the
fsdp runner on gloo spends its time elsewhere (per-unit hooks, gloo collectives). So::

    # record: every candidate of CALIBRATION once (real trials, local Ray, the cpu-4 cluster file)
    flock /tmp/pipette-heavy-tests.lock .venv/bin/python tests/benchmarks/fsdp_cpu_calibration.py \
        --record tests/benchmarks/results/cpu-2026-11-27/fsdp_cpu_calibration_pp.json
    # fit the CPU terms on the recorded set (no trials); --check prices a real_tuning.py run's fsdp
    # rows with the fit (fsdp_cpu_heldout.py), --every-trial fits the trials ``fitted`` leaves out too
    .venv/bin/python tests/benchmarks/fsdp_cpu_calibration.py \
        --fit tests/benchmarks/results/cpu-2026-11-27/fsdp_cpu_calibration_pp.json \
        --check tests/benchmarks/results/cpu-2026-11-27/real_tuning_both.json

The recipe is ``real_tuning.py``'s (tiny-llama, LoRA, global batch 16 x 128, fp32). The fit is
least squares on log(predicted / measured) (soft-L1, as ``stack_fit.py``) of FIT_NAMES. The
candidates not fitted are checked on ``real_tuning.py --stack pipette,fsdp``'s exhaustive pass
(``fsdp_cpu_heldout.py``), whose restricted fsdp space CALIBRATION's later rows stay out of.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scipy.optimize import least_squares  # noqa: E402

from pipette.cluster import ClusterProfile  # noqa: E402
from pipette.clusterfile import load_cluster  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.perf import PerfConstants, PerfModel  # noqa: E402
from pipette.plan import Planned, make_plan  # noqa: E402
from pipette.stacks import FSDP  # noqa: E402
from pipette.training import LoraSpec, TrainingSpec  # noqa: E402

CLUSTER = REPO / "examples" / "clusters" / "cpu-4.yaml"
#: fsdp candidates the CPU terms are fitted on: every layout kind, each sharding mode, small and
#: large micro-batches, both recomputation modes (labels of a plan of the fsdp stack alone)
CALIBRATION = (
    "tp1-pp1-dp4-mbs1-z3-rc:none-1f1b",
    "tp1-pp1-dp4-mbs4-z0-rc:none-1f1b",
    "tp1-pp2-dp2-mbs2-z2-rc:none-1f1b",
    "tp2-pp1-dp2-mbs4-z3-rc:full-1f1b",
    "tp1-pp4-dp1-mbs1-z0-rc:none-1f1b",
    "tp4-pp1-dp1-mbs2-z0-rc:none-1f1b",
    # pipelines and recomputation (issue 31's second pass): none of real_tuning.py's restricted
    # fsdp space (tp 1, no recomputation), which stays the held-out check
    "tp1-pp4-dp1-mbs4-z0-rc:full-1f1b",
    "tp1-pp4-dp1-mbs2-z3-rc:full-1f1b",
    "tp1-pp2-dp2-mbs4-z3-rc:full-1f1b",
    "tp2-pp2-dp1-mbs4-z2-rc:none-1f1b",
    "tp1-pp1-dp4-mbs2-z2-rc:full-1f1b",
)
#: the terms fitted: fixed time per layer and pass (hooks, small ops: Python-bound on a CPU),
#: the elementwise memory passes, the fixed cost of a blocking collective (gloo: the tensor-parallel
#: all-reduces), that of one of FSDP2's per-unit gathers and reductions, that of a pipeline p2p
#: transfer, and the share of the 1F1B bubble that costs wall time on ranks sharing cores
FIT_NAMES = ("layer_overhead_s", "elementwise_passes", "collective_overhead_s", "unit_collective_s",
             "p2p_overhead_s", "bubble_share")
SCALE = np.array([1e-3, 10.0, 1e-3, 1e-3, 1e-3, 0.1])
LOWER = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
UPPER = np.array([1.0, 2000.0, 1.0, 1.0, 1.0, 1.0])
#: what the fit starts from: the GPU fit, a p2p hop priced apart from a blocking collective
FIT_BASE = replace(FSDP.constants, p2p_overhead_s=0.0)


def fitted(label: str) -> bool:
    """Whether a recorded trial enters the fit: recomputation under a pipeline does not. Those
    trials (2026-11-27) ran 1.7-2.4x what any setting of the other terms gives them while the
    same layouts without recomputation and recomputation without a pipeline fit: an effect of
    checkpointing under ``torch.distributed.pipelining`` no term prices (docs/fsdp.md, open).
    Fitted on, they pull the bubble's share to 1 for every pipeline. Printed, not fitted."""
    return "-pp1-" in label or "-rc:none-" in label


def recipe() -> TrainingSpec:
    return TrainingSpec(global_batch=16, seq_len=128, dtype="fp32", method="lora", lora=LoraSpec(rank=8, alpha=16.0),
                        micro_batches=(1, 2, 4), zero_stages=(0, 2, 3), recompute=("none", "full"),
                        schedules=("1f1b",))


def planned_by_label(model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile) -> dict[str, Planned]:
    plan = make_plan(model, training, cluster, stack="fsdp")
    return {p.config.label: p for p in plan.ranked}


def record(out: Path, steps: int, timeout_s: float) -> None:
    from workers.host.ray_cluster import ensure_ray
    from workers.host.runner import RayTrialRunner

    model, training, cluster = ModelSpec.preset("tiny-llama"), recipe(), load_cluster(str(CLUSTER))
    by_label = planned_by_label(model, training, cluster)
    ensure_ray()
    runner = RayTrialRunner(model, training, cluster, device_kind="cpu", timeout_s=timeout_s, max_steps=steps,
                            stack="fsdp")
    rows = []
    for label in CALIBRATION:
        start = time.monotonic()
        m = runner(by_label[label].config, lambda p: False)
        print(f"  {label:<36} {m.status:<7} {m.step_time or 0.0:.3f} s  predicted {by_label[label].perf.step_time:.3f}"
              f"  ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
        rows.append({"label": label, "status": m.status, "step_time": m.step_time,
                     "predicted_gpu_constants": by_label[label].perf.step_time, "trial": m.to_dict()})
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "cluster": str(CLUSTER.relative_to(REPO)), "steps": steps, "rows": rows}, indent=1))
    print(f"wrote {out}")


def make(x: np.ndarray, base: PerfConstants) -> PerfConstants:
    return replace(base, **{name: float(v) for name, v in zip(FIT_NAMES, x, strict=True)})


def predict(items: Sequence[Planned], model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile,
            k: PerfConstants) -> np.ndarray:
    return np.array([PerfModel(model, training, p.config, cluster, constants=k).step_time() for p in items])


def fit(path: Path, every: bool = False, check: Path | None = None) -> dict[str, Any]:
    """Fit FIT_NAMES on the recorded trials that ``fitted`` keeps (``every``: all of them); with
    ``check``, price a real_tuning.py run's fsdp rows with the fit (``fsdp_cpu_heldout``)."""
    data = json.loads(path.read_text())
    model, training, cluster = ModelSpec.preset("tiny-llama"), recipe(), load_cluster(str(REPO / data["cluster"]))
    by_label = planned_by_label(model, training, cluster)
    recorded = [r for r in data["rows"] if r["status"] == "ok" and r["step_time"]]
    rows = [r for r in recorded if every or fitted(r["label"])]
    items = [by_label[r["label"]] for r in rows]
    meas = np.array([r["step_time"] for r in rows])
    base = FIT_BASE

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.asarray(np.log(predict(items, model, training, cluster, make(z * SCALE, base)) / meas))

    x0 = np.array([getattr(base, n) for n in FIT_NAMES])
    res = least_squares(residuals, x0 / SCALE, bounds=(LOWER / SCALE, UPPER / SCALE), diff_step=1e-3,
                        loss="soft_l1", f_scale=0.1, max_nfev=300)
    x = res.x * SCALE
    shown = [by_label[r["label"]] for r in recorded]
    before, after = predict(shown, model, training, cluster, FSDP.constants), predict(shown, model, training,
                                                                                      cluster, make(x, base))
    print(f"fsdp CPU terms fitted on {len(rows)} of {len(recorded)} trials ({path}):")
    for name, v in zip(FIT_NAMES, x, strict=True):
        print(f"  {name} = {v:.4g}")
    print(f"  {'candidate':<36} {'measured':>9} {'GPU terms':>9} {'CPU terms':>9}")
    for r, b, a in zip(recorded, before, after, strict=True):
        note = "" if every or fitted(r["label"]) else "  (not fitted)"
        print(f"  {r['label']:<36} {r['step_time']:>9.3f} {b:>9.3f} {a:>9.3f}{note}")
    mask = np.array([every or fitted(r["label"]) for r in recorded])
    ratio_b, ratio_a = meas / before[mask], meas / after[mask]
    print(f"  measured / predicted (fitted): GPU terms median {statistics.median(ratio_b):.1f}x, "
          f"CPU terms median {statistics.median(ratio_a):.2f}x (min {ratio_a.min():.2f}, max {ratio_a.max():.2f})")
    if not mask.all():
        rest = np.array([r["step_time"] for r in recorded])[~mask] / after[~mask]
        print(f"  not fitted: measured / predicted {', '.join(f'{v:.2f}' for v in rest)}")
    if check is not None:
        from tests.benchmarks import fsdp_cpu_heldout

        fsdp_cpu_heldout.report(fsdp_cpu_heldout.check(check, [r["label"] for r in recorded], make(x, base)))
    return dict(zip(FIT_NAMES, (float(v) for v in x), strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--record", help="run the calibration trials, write them here (JSON)")
    ap.add_argument("--fit", help="fit the CPU terms on a recorded set (JSON)")
    ap.add_argument("--every-trial", action="store_true",
                    help="fit on every recorded trial (recomputation under a pipeline included)")
    ap.add_argument("--check", help="a real_tuning.py --stack pipette,fsdp JSON: its fsdp rows priced with the fit")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per trial at most (default 8)")
    ap.add_argument("--trial-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if not args.record and not args.fit:
        ap.error("give --record FILE or --fit FILE")
    try:
        if args.record:
            record(Path(args.record), args.steps, args.trial_timeout)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    if args.fit:
        fit(Path(args.fit), args.every_trial, Path(args.check) if args.check else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
