"""The fsdp stack's CPU pricing checked on a recorded exhaustive run over both families (issue 31):
``real_tuning.py --stack pipette,fsdp``'s every candidate measured, none of its fsdp rows fitted
(``fsdp_cpu_calibration.py`` fits on its own trials). No trials: the predictions of the tree on
``PYTHONPATH`` (so a second worktree prices the same rows with its own constants)::

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/fsdp_cpu_heldout.py \\
        tests/benchmarks/results/cpu-2026-11-27/real_tuning_both.json \\
        --fitted tests/benchmarks/results/cpu-2026-11-27/fsdp_cpu_calibration.json

Prints, over the fsdp rows (all, and those not among the fitted labels): measured / predicted
(median, range), Spearman's rho of predicted against measured, and where the measured fsdp best
stands in the predicted order, of the fsdp rows and of every row (each candidate priced with its
own stack's constants for the cluster's devices, ``Stack.constants_for``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[2]
if not any(Path(p or ".").resolve() == REPO for p in sys.path):
    sys.path.append(str(REPO))  # after PYTHONPATH: another tree's pipette prices the rows

from pipette.clusterfile import load_cluster  # noqa: E402
from pipette.config import ParallelConfig  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.perf import PerfConstants, PerfModel  # noqa: E402
from pipette.stacks import get_stack  # noqa: E402
from pipette.training import TrainingSpec  # noqa: E402

CLUSTER = REPO / "examples" / "clusters" / "cpu-4.yaml"


def place(predicted: np.ndarray, i: int) -> tuple[int, int]:
    """Rank of row ``i`` in ascending predicted order (1 = predicted fastest) and how many rows tie it."""
    return int(np.sum(predicted < predicted[i])) + 1, int(np.sum(predicted == predicted[i])) - 1


def check(run: Path, fitted: Sequence[str], fsdp_constants: PerfConstants | None = None) -> dict[str, Any]:
    """The figures above; ``fsdp_constants`` price the fsdp rows instead of the stack's own (a fit's)."""
    data = json.loads(run.read_text())
    model, training = ModelSpec.preset(data["model"]), TrainingSpec.from_dict(data["training"])
    cluster = load_cluster(str(CLUSTER))
    kind = cluster.device_spec.kind

    def constants(stack: str | None) -> PerfConstants:
        own = get_stack(stack).constants_for(kind)
        return fsdp_constants if fsdp_constants is not None and stack == "fsdp" else own

    rows = data["exhaustive"]["ranking"]
    configs = [ParallelConfig.from_dict(r["config"]) for r in rows]
    predicted = np.array([PerfModel(model, training, c, cluster, constants=constants(c.stack)).step_time()
                          for c in configs])
    measured = np.array([r["step_time"] for r in rows])
    fsdp = np.array([c.stack == "fsdp" for c in configs])
    held = fsdp & np.array([r["label"].removesuffix("-fsdp") not in set(fitted) for r in rows])
    out: dict[str, Any] = {"module": sys.modules["pipette"].__file__}
    for name, mask in (("fsdp", fsdp), ("held_out", held)):
        ratio = measured[mask] / predicted[mask]
        out[name] = {"rows": int(mask.sum()), "ratio_median": float(np.median(ratio)),
                     "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
                     "spearman": float(spearmanr(measured[mask], predicted[mask])[0])}
    idx = np.flatnonzero(fsdp)
    best = int(idx[np.argmin(measured[idx])])
    out["fsdp_best"] = rows[best]["label"]
    out["fsdp_best_predicted"] = float(predicted[best])
    out["fsdp_best_rank_in_fsdp"] = place(predicted[idx], int(np.argmin(measured[idx])))
    out["fsdp_best_rank_in_all"] = place(predicted, best)
    out["all_rows"] = len(rows)
    out["fsdp_predicted_top"] = [rows[i]["label"] for i in idx[np.argsort(predicted[idx], kind="stable")][:5]]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("run", help="real_tuning.py --stack pipette,fsdp's JSON")
    ap.add_argument("--fitted", action="append", default=[],
                    help="a calibration JSON whose labels are left out of the held-out rows (repeatable)")
    args = ap.parse_args(argv)
    labels = [r["label"] for f in args.fitted for r in json.loads(Path(f).read_text())["rows"]]
    report(check(Path(args.run), labels))
    return 0


def report(out: dict[str, Any]) -> None:
    print(f"pipette from {out['module']}")
    for name in ("fsdp", "held_out"):
        s = out[name]
        print(f"  {name:<8} {s['rows']:>3} rows: measured / predicted median {s['ratio_median']:.2f} "
              f"({s['ratio_min']:.2f}-{s['ratio_max']:.2f}), Spearman {s['spearman']:+.2f}")
    r_f, r_a = out["fsdp_best_rank_in_fsdp"], out["fsdp_best_rank_in_all"]
    print(f"  measured fsdp best {out['fsdp_best']} predicted {out['fsdp_best_predicted']:.3f} s: "
          f"rank {r_f[0]} of {out['fsdp']['rows']} fsdp (ties {r_f[1]}), rank {r_a[0]} of {out['all_rows']} "
          f"over both families (ties {r_a[1]})")
    print(f"  fsdp predicted top 5: {', '.join(out['fsdp_predicted_top'])}")


if __name__ == "__main__":
    sys.exit(main())
