"""The pipette stack's CPU pricing (issue 31: both families ranked on one scale), fitted on half
of the pipette rows of a recorded exhaustive run over both families and checked on the other half.
No trials: ``real_tuning.py --stack pipette,fsdp``'s JSON holds every candidate's measured median.

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/pipette_cpu_fit.py \\
        tests/benchmarks/results/cpu-2026-11-27/real_tuning_both.json

The split is fixed by the label (crc32 even: held out), not by the fit. Fitted (soft-L1 least
squares on log(predicted / measured), as ``fsdp_cpu_calibration.py``): the per-layer fixed
time, the elementwise passes, a blocking collective's fixed cost and a pipeline hop's; the
rest is the GPU stack's (``HF_DEEPSPEED_CONSTANTS``). Prints, for the stack's GPU constants,
the constants on the tree's ``PIPETTE_CPU_CONSTANTS`` and this fit: measured / predicted, MAPE
and Spearman on the fitted and held-out pipette rows, Spearman over all rows (fsdp rows priced
by their own stack), and where the measured best and the fsdp best stand in the predicted order.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[2]
if not any(Path(p or ".").resolve() == REPO for p in sys.path):
    sys.path.append(str(REPO))

from pipette.clusterfile import load_cluster  # noqa: E402
from pipette.config import ParallelConfig  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.perf import HF_DEEPSPEED_CONSTANTS, PerfConstants, PerfModel  # noqa: E402
from pipette.stacks import PIPETTE_CPU_CONSTANTS, get_stack  # noqa: E402
from pipette.training import TrainingSpec  # noqa: E402

CLUSTER = REPO / "examples" / "clusters" / "cpu-4.yaml"
FITTED = ("layer_overhead_s", "elementwise_passes", "collective_overhead_s", "p2p_overhead_s")


def held_out(label: str) -> bool:
    """The fixed split: a label whose crc32 is even is held out of the fit."""
    return zlib.crc32(label.encode()) % 2 == 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("run", help="real_tuning.py --stack pipette,fsdp's JSON")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.run).read_text())
    model, training = ModelSpec.preset(data["model"]), TrainingSpec.from_dict(data["training"])
    cluster = load_cluster(str(CLUSTER))
    fsdp_constants = get_stack("fsdp").constants_for(cluster.device_spec.kind)
    rows = data["exhaustive"]["ranking"]
    configs = [ParallelConfig.from_dict(r["config"]) for r in rows]
    measured = np.array([r["step_time"] for r in rows])
    pipette = np.array([c.stack != "fsdp" for c in configs])
    held = np.array([held_out(r["label"]) for r in rows])
    fit_rows, held_rows = np.flatnonzero(pipette & ~held), np.flatnonzero(pipette & held)

    def predict(constants: PerfConstants) -> np.ndarray:
        return np.array([PerfModel(model, training, c, cluster,
                                   constants=fsdp_constants if c.stack == "fsdp" else constants).step_time()
                         for c in configs])

    def with_(x: Sequence[float]) -> PerfConstants:
        return replace(HF_DEEPSPEED_CONSTANTS, **{n: float(v) for n, v in zip(FITTED, x, strict=True)})

    def residuals(x: np.ndarray) -> np.ndarray:
        p = np.array([PerfModel(model, training, configs[i], cluster, constants=with_(x)).step_time()
                      for i in fit_rows])
        return np.asarray(np.log(p / measured[fit_rows]))

    fit = least_squares(residuals, x0=[1e-3, 100.0, 1e-3, 1e-3], bounds=([0, 0, 0, 0], [1, 5000, 1, 1]),
                        loss="soft_l1", f_scale=0.2)
    print(f"{len(fit_rows)} pipette rows fitted, {len(held_rows)} held out, {int((~pipette).sum())} fsdp rows "
          f"({args.run})")
    print("fit: " + ", ".join(f"{n} {v:.3g}" for n, v in zip(FITTED, fit.x, strict=True)))
    best, fsdp_best = int(np.argmin(measured)), int(np.flatnonzero(~pipette)[np.argmin(measured[~pipette])])
    for name, constants in (("GPU constants", HF_DEEPSPEED_CONSTANTS), ("PIPETTE_CPU_CONSTANTS", PIPETTE_CPU_CONSTANTS),
                            ("this fit", with_(fit.x))):
        p = predict(constants)
        print(name)
        for part, idx in (("fitted", fit_rows), ("held out", held_rows)):
            ratio = measured[idx] / p[idx]
            print(f"  {part:<9} measured / predicted median {np.median(ratio):.2f} "
                  f"({ratio.min():.2f}-{ratio.max():.2f}), "
                  f"MAPE {100 * np.mean(np.abs(p[idx] / measured[idx] - 1)):.1f}%, "
                  f"Spearman {spearmanr(measured[idx], p[idx])[0]:+.2f}")
        print(f"  all {len(rows)} rows: Spearman {spearmanr(measured, p)[0]:+.2f}; measured best {rows[best]['label']} "
              f"predicted rank {int(np.sum(p < p[best])) + 1}; measured fsdp best {rows[fsdp_best]['label']} "
              f"rank {int(np.sum(p < p[fsdp_best])) + 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
