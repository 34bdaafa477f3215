"""The fsdp stack's CPU terms fitted on the fsdp rows of a recorded exhaustive run over both
families, and checked on another run's (issue 31: both families priced on one scale).

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/fsdp_cpu_run_fit.py \\
        tests/benchmarks/results/cpu-2026-11-27/real_tuning_both.json \\
        --check tests/benchmarks/results/cpu-2026-11-28/real_tuning_both.json

Why: ``FSDP_CPU_CONSTANTS`` were first fitted on 8 dedicated fsdp trials
(``fsdp_cpu_calibration.py``, 2026-11-27 22:11 UTC), while ``PIPETTE_CPU_CONSTANTS`` were fitted
on the exhaustive run of 2026-11-27 (``pipette_cpu_fit.py``). On the exhaustive runs the fsdp
rows then measured 0.53x (2026-11-27) and 0.38x (2026-11-28) their prediction while the pipette
rows measured 0.96-0.99x: the two families sat on two scales, the fsdp best predicted 39th-42nd
of 99. Here both stacks' CPU terms come from the same recorded run.

The run's fsdp space is tp 1 without recomputation (``real_tuning.RESTRICTED_FSDP``), so a
blocking collective's cost (the tensor-parallel all-reduces) is not seen in it and is kept from
the calibration fit; fitted (soft-L1 least squares on log(predicted / measured), as
``fsdp_cpu_calibration.py``): the per-layer fixed time, the elementwise passes, a per-unit
gather/reduction's fixed cost, a pipeline hop's and the bubble's share. Prints, for the tree's
``FSDP_CPU_CONSTANTS`` and this fit: measured / predicted, MAPE and Spearman on the fitted run's
fsdp rows and on ``--check``'s, and where each run's measured fsdp best and best overall stand in
the predicted order over both families (pipette rows priced by their own stack).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[2]
if not any(Path(p or ".").resolve() == REPO for p in sys.path):
    sys.path.append(str(REPO))

from pipette.clusterfile import load_cluster  # noqa: E402
from pipette.config import ParallelConfig  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.perf import PerfConstants, PerfModel  # noqa: E402
from pipette.stacks import FSDP_CPU_CONSTANTS, get_stack  # noqa: E402
from pipette.training import TrainingSpec  # noqa: E402

CLUSTER = REPO / "examples" / "clusters" / "cpu-4.yaml"
FITTED = ("layer_overhead_s", "elementwise_passes", "unit_collective_s", "p2p_overhead_s", "bubble_share")
SCALE = np.array([1e-3, 10.0, 1e-3, 1e-3, 0.1])
UPPER = np.array([1.0, 5000.0, 1.0, 1.0, 1.0])


class Run:
    """One recorded run's rows, predicted with the fsdp rows' constants given."""

    def __init__(self, path: Path) -> None:
        data = json.loads(path.read_text())
        self.path = path
        self.model, self.training = ModelSpec.preset(data["model"]), TrainingSpec.from_dict(data["training"])
        self.cluster = load_cluster(str(CLUSTER))
        rows = [r for r in data["exhaustive"]["ranking"] if r.get("step_time")]
        self.labels = [r["label"] for r in rows]
        self.configs = [ParallelConfig.from_dict(r["config"]) for r in rows]
        self.measured = np.array([r["step_time"] for r in rows])
        self.fsdp = np.array([c.stack == "fsdp" for c in self.configs])
        pipette = get_stack("pipette").constants_for(self.cluster.device_spec.kind)
        self._pipette = np.array([0.0 if f else self._one(c, pipette) for c, f in zip(self.configs, self.fsdp,
                                                                                        strict=True)])

    def _one(self, config: ParallelConfig, constants: PerfConstants) -> float:
        return PerfModel(self.model, self.training, config, self.cluster, constants=constants).step_time()

    def fsdp_predicted(self, constants: PerfConstants) -> np.ndarray:
        return np.array([self._one(c, constants) for c, f in zip(self.configs, self.fsdp, strict=True) if f])

    def predicted(self, constants: PerfConstants) -> np.ndarray:
        out = self._pipette.copy()
        out[self.fsdp] = self.fsdp_predicted(constants)
        return out

    def report(self, name: str, constants: PerfConstants) -> dict[str, Any]:
        p = self.predicted(constants)
        m, pf = self.measured[self.fsdp], p[self.fsdp]
        ratio = m / pf
        fsdp_idx = np.flatnonzero(self.fsdp)
        best, fsdp_best = int(np.argmin(self.measured)), int(fsdp_idx[np.argmin(m)])
        out = {"ratio_median": float(np.median(ratio)), "ratio_min": float(ratio.min()),
               "ratio_max": float(ratio.max()), "mape": float(100 * np.mean(np.abs(pf / m - 1))),
               "spearman_fsdp": float(spearmanr(m, pf)[0]), "spearman_all": float(spearmanr(self.measured, p)[0]),
               "fsdp_best_rank": int(np.sum(p < p[fsdp_best])) + 1, "best_rank": int(np.sum(p < p[best])) + 1}
        print(f"  {name:<22} {self.path.parent.name}: {int(self.fsdp.sum())} fsdp rows measured / predicted median "
              f"{out['ratio_median']:.2f} ({out['ratio_min']:.2f}-{out['ratio_max']:.2f}), MAPE {out['mape']:.1f}%, "
              f"Spearman {out['spearman_fsdp']:+.2f}; all {len(p)} rows Spearman {out['spearman_all']:+.2f}; "
              f"fsdp best {self.labels[fsdp_best]} predicted rank {out['fsdp_best_rank']}, "
              f"best {self.labels[best]} rank {out['best_rank']} of {len(p)}")
        return out


def with_(x: Sequence[float]) -> PerfConstants:
    return replace(FSDP_CPU_CONSTANTS, **{n: float(v) for n, v in zip(FITTED, x, strict=True)})


def fit(run: Run) -> PerfConstants:
    meas = run.measured[run.fsdp]

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.asarray(np.log(run.fsdp_predicted(with_(z * SCALE)) / meas))

    x0 = np.array([getattr(FSDP_CPU_CONSTANTS, n) for n in FITTED])
    res = least_squares(residuals, np.maximum(x0, 1e-6) / SCALE, bounds=(np.zeros(len(FITTED)), UPPER / SCALE),
                        diff_step=1e-3, loss="soft_l1", f_scale=0.1, max_nfev=300)
    return with_(res.x * SCALE)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("run", help="real_tuning.py --stack pipette,fsdp's JSON: its fsdp rows are fitted")
    ap.add_argument("--check", action="append", default=[], help="another such run, priced with the fit")
    ap.add_argument("--calibration", help="fsdp_cpu_calibration.py's recorded trials (tp 2-4, recomputation): "
                                          "priced with both, per trial")
    args = ap.parse_args(argv)
    fitted_run = Run(Path(args.run))
    checks = [Run(Path(p)) for p in args.check]
    constants = fit(fitted_run)
    print("fit: " + ", ".join(f"{n} {getattr(constants, n):.4g}" for n in FITTED)
          + f" (collective_overhead_s kept: {constants.collective_overhead_s:.4g})")
    for name, k in (("FSDP_CPU_CONSTANTS", FSDP_CPU_CONSTANTS), ("this fit", constants)):
        for run in (fitted_run, *checks):
            run.report(name + (" (fitted)" if run is fitted_run else ""), k)
    if args.calibration:
        calibration(Path(args.calibration), constants)
    return 0


def calibration(path: Path, constants: PerfConstants) -> None:
    """The dedicated calibration trials, outside the runs' space (tp 2-4, recomputation): measured
    / predicted with the tree's constants and with the fit (another hour's load: a level shift
    moves every row alike; what matters is that no kind of row moves apart)."""
    from tests.benchmarks.fsdp_cpu_calibration import planned_by_label, predict, recipe

    data = json.loads(path.read_text())
    model, training, cluster = ModelSpec.preset("tiny-llama"), recipe(), load_cluster(str(CLUSTER))
    by_label = planned_by_label(model, training, cluster)
    rows = [r for r in data["rows"] if r["status"] == "ok" and r["step_time"]]
    items = [by_label[r["label"]] for r in rows]
    before, after = predict(items, model, training, cluster, FSDP_CPU_CONSTANTS), predict(items, model, training,
                                                                                          cluster, constants)
    print(f"calibration trials ({path.name}, {data.get('date')}): measured / predicted, tree -> fit")
    for r, b, a in zip(rows, before, after, strict=True):
        print(f"  {r['label']:<36} {r['step_time'] / b:5.2f} -> {r['step_time'] / a:5.2f}")


if __name__ == "__main__":
    sys.exit(main())
