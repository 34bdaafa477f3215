"""Would a chance-to-fit prior per tp degree call fewer of Ultra-Scale's failures sure to fit?

Run from the repository root::

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/fits_prior_per_tp.py

The estimator's log error on the runs that ran, ``log(logged / estimate)``, widens with tp (sd 0.12 at
tp 1 to 0.27 at tp 32), so one (mu, sd) for the whole set is wider than the small-tp runs need. Each
variant fits its prior's mu and sd on the runs that ran of two model sizes and scores the third (leave
one model size out): the runs that ran it would drop (chance to fit under ``fits.KEEP_THRESHOLD``) and
the failures nothing but memory explains that it calls likely to fit (>= 50%), as ``fits_boundary.py``
estimates them (the ``nanotron`` stack's memory options). A tp group with fewer than 20 runs in a fold
takes the fold's shared prior. Nothing here is shipped: ``pipette.fits.NANOTRON_GPU`` is one prior.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
from scipy.stats import norm

from pipette.fits import KEEP_THRESHOLD
from pipette.memory import estimate_memory
from pipette.stacks import get_stack
from tests.benchmarks.calibration import Row, calibration_dir, load_ultrascale
from tests.benchmarks.memory_accuracy import memory_plausible_failures

#: (model, tp, log(capacity / estimate), log(logged / estimate) or None for a failure)
Run = tuple[str, int, float, float | None]
GROUPINGS: dict[str, Callable[[int], int]] = {
    "one prior (shipped)": lambda tp: 0,
    "tp 1-2 / 4-8 / 16-32": lambda tp: 0 if tp <= 2 else (1 if tp <= 8 else 2),
    "per tp": lambda tp: tp,
}


def runs() -> list[Run]:
    options = get_stack("nanotron").memory_options
    rows = load_ultrascale(calibration_dir())

    def run(r: Row, needed: float | None) -> Run:
        cap = r.cluster.device_spec.memory_bytes
        peak = estimate_memory(r.model, r.training, r.config, cap, options=options).peak_bytes
        return (r.model.name, r.config.tp, math.log(cap / peak), None if needed is None else math.log(needed / peak))

    ran = [run(r, float(r.peak_memory)) for r in rows if r.ok and r.peak_memory]
    return ran + [run(r, None) for r in memory_plausible_failures(rows)]


def prior(errors: list[float]) -> tuple[float, float]:
    e = np.array(errors)
    return float(e.mean()), float(max(e.std(ddof=1), 0.02))


def score(points: list[Run], group: Callable[[int], int]) -> tuple[int, int, int, int]:
    """(ran dropped, ran, failures called >= 50%, failures), each size scored by the other two's fit."""
    dropped = called = n_ran = n_failed = 0
    for held in sorted({p[0] for p in points}):
        train = [p for p in points if p[0] != held and p[3] is not None]
        shared = prior([p[3] for p in train if p[3] is not None])
        by: dict[int, list[float]] = {}
        for p in train:
            if p[3] is not None:
                by.setdefault(group(p[1]), []).append(p[3])
        priors = {k: prior(v) if len(v) >= 20 else shared for k, v in by.items()}
        for name, tp, headroom, error in points:
            if name != held:
                continue
            mu, sd = priors.get(group(tp), shared)
            chance = float(norm.cdf((headroom - mu) / sd))
            if error is None:
                n_failed += 1
                called += chance >= 0.5
            else:
                n_ran += 1
                dropped += chance < KEEP_THRESHOLD
    return dropped, n_ran, called, n_failed


def main() -> int:
    points = runs()
    print("| prior | ran, dropped | failures called >= 50% sure |")
    print("|---|---|---|")
    for label, group in GROUPINGS.items():
        dropped, n_ran, called, n_failed = score(points, group)
        print(f"| {label} | {dropped} of {n_ran} | {called} of {n_failed} |")
    by: dict[int, list[float]] = {}
    for _, tp, _, error in points:
        if error is not None:
            by.setdefault(tp, []).append(error)
    print("\ntp: runs that ran, log error mean / sd / max")
    for tp in sorted(by):
        mu, sd = prior(by[tp])
        print(f"  tp {tp}: {len(by[tp])}, {mu:+.3f} / {sd:.3f} / {max(by[tp]):+.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
