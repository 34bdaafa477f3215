"""One CPU thread's fp32 matmul rate over GEMM sizes, and the efficiency curve fitted to it.

What ``pipette.efficiency`` uses for a CPU worker the probe has not measured (a cluster file's
``preset: cpu``): ``eff(x) = max_fraction * r / (1 + r)``, ``r = (x / half_flops) ** steepness``,
``x`` the FLOPs of one GEMM, ``eff`` the fraction of the best rate measured. Each size is timed
5 times (the fastest kept), enough repeats for ~0.2 GFLOP a timing::

    .venv/bin/python tests/benchmarks/cpu_gemm.py [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.optimize import least_squares  # noqa: E402

from pipette.efficiency import EfficiencyCurve  # noqa: E402
from tests.benchmarks.machine_noise import cpu_model  # noqa: E402

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


def rate(n: int, flops_per_timing: float = 2e8, timings: int = 5) -> float:
    """FLOP/s of an n x n x n fp32 matmul, the fastest of ``timings``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    flops = 2.0 * n**3
    reps = int(min(200_000, max(3, flops_per_timing / flops)))
    best = math.inf
    for _ in range(timings):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, (time.perf_counter() - t0) / reps)
    return flops / best


def fit(flops: Sequence[float], fraction: Sequence[float]) -> EfficiencyCurve:
    """The curve, least squares on the log of the fraction (``log10(half_flops)`` fitted)."""
    x, y = np.asarray(flops), np.asarray(fraction)

    def residual(p: np.ndarray) -> np.ndarray:
        return np.asarray(np.log(EfficiencyCurve(p[0], 10 ** p[1], p[2])(x)) - np.log(y))

    res = least_squares(residual, [1.0, 5.0, 1.2])
    return EfficiencyCurve(float(res.x[0]), float(10 ** res.x[1]), float(res.x[2]))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one CPU worker's share)")
    ap.add_argument("--json", help="write the points and the fit here")
    args = ap.parse_args(argv)
    if args.threads < 1:
        print("cpu_gemm: --threads is below 1: give 1 or more", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cpu = cpu_model()
    print(f"{cpu}, {args.threads} thread(s), torch {torch.__version__}")
    points = [(2.0 * n**3, rate(n)) for n in SIZES]
    best = max(r for _, r in points)
    curve = fit([f for f, _ in points], [r / best for _, r in points])
    for n, (f, r) in zip(SIZES, points, strict=True):
        print(f"{n:5d}^3  {f:9.3g} FLOPs  {r / 1e9:7.2f} GFLOP/s  {r / best:6.3f} of the best  "
              f"fit {float(curve(f)):6.3f}")
    print(f"fit: max_fraction {curve.max_fraction:.3f}, half_flops {curve.half_flops:.3g}, "
          f"steepness {curve.steepness:.2f} (best {best / 1e9:.1f} GFLOP/s)")
    if args.json:
        fitted = {"max_fraction": curve.max_fraction, "half_flops": curve.half_flops, "steepness": curve.steepness}
        Path(args.json).write_text(json.dumps({"cpu": cpu, "threads": args.threads, "points": points,
                                               "fit": fitted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
