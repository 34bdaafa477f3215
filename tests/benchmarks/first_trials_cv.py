"""Choose ``pipette.search.FIRST_SURE_TO_FIT`` (the chance to fit a first trial needs) by
leave-one-model-size-out on the Ultra-Scale replay (issue 46, "First trials that run").

Run the replay once per threshold, then this on its outputs::

    for x in 0 0.5 0.7 0.8 0.9 0.95; do
      .venv/bin/python tests/benchmarks/replay.py --source ultrascale --methods tuner --seeds 3 \\
          --budget 5 --first-sure $x --quiet --out /tmp/first_$x.json
    done
    .venv/bin/python tests/benchmarks/first_trials_cv.py /tmp/first_*.json

For each model size (1B, 3B, 8B: every node count of it is one group), the threshold is chosen
on the other two sizes' runs alone: the lowest mean regret after three trials (a run with no
trial that ran yet counts with its group's worst row, so a threshold whose first trials fail
pays for it), ties to the higher share of runs with a trial that ran in the first three, then to
the higher threshold. The held-out size is scored with the threshold so chosen; the pooled
held-out figures are what the choice is worth on data it was not chosen on. The first three
trials do not depend on the trial budget (the tuner's proposals do not read it), so a budget of
5 is enough.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: the figure a user who stops after this many trials gets
FIRST = 3


def load(paths: Sequence[str]) -> dict[float, list[dict[str, Any]]]:
    """Threshold -> the tuner's runs of the replay output that used it."""
    out: dict[float, list[dict[str, Any]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        out[float(data["first_sure"])] = [r for r in data["runs"] if r["method"] == "tuner"]
    return out


def size(run: dict[str, Any]) -> str:
    return str(run["group"]).split("/")[0]


def ran_early(run: dict[str, Any]) -> bool:
    return any(status == "ok" for _, status in run["trials"][:FIRST])


def scores(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    regrets = [r["regret"][str(FIRST)] for r in runs]
    return {"runs": len(runs), "ran_early_pct": 100.0 * float(np.mean([ran_early(r) for r in runs])),
            "regret3_mean": float(np.mean(regrets)), "regret3_median": float(np.median(regrets))}


def choose(by_x: dict[float, list[dict[str, Any]]], sizes: set[str]) -> float:
    """The threshold with the best figures on the runs of ``sizes`` (module docstring)."""
    def key(x: float) -> tuple[float, float, float]:
        s = scores([r for r in by_x[x] if size(r) in sizes])
        return round(s["regret3_mean"], 9), -s["ran_early_pct"], -x
    return min(by_x, key=key)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("outputs", nargs="+", help="replay.py --out files, one per --first-sure")
    args = ap.parse_args(argv)
    by_x = load(args.outputs)
    all_sizes = sorted({size(r) for runs in by_x.values() for r in runs})
    print(f"{'X':>6} " + " ".join(f"{s + ' ran%':>9} {s + ' reg@3':>9}" for s in all_sizes))
    for x in sorted(by_x):
        cells = [scores([r for r in by_x[x] if size(r) == s]) for s in all_sizes]
        print(f"{x:>6g} " + " ".join(f"{c['ran_early_pct']:>8.1f}% {c['regret3_mean']:>9.2%}" for c in cells))
    held: list[dict[str, Any]] = []
    for s in all_sizes:
        x = choose(by_x, set(all_sizes) - {s})
        out = [r for r in by_x[x] if size(r) == s]
        held += out
        c = scores(out)
        print(f"held out {s}: chosen on the others X = {x:g}; on {s}: one of the first {FIRST} ran in "
              f"{c['ran_early_pct']:.1f}% of {c['runs']} runs, regret after {FIRST} mean {c['regret3_mean']:.2%}, "
              f"median {c['regret3_median']:.2%}")
    c = scores(held)
    print(f"pooled held-out: one of the first {FIRST} ran in {c['ran_early_pct']:.1f}% of {c['runs']} runs, "
          f"regret after {FIRST} mean {c['regret3_mean']:.2%}, median {c['regret3_median']:.2%}")
    print(f"chosen on every size: X = {choose(by_x, set(all_sizes)):g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
