"""The Accelerate FSDP example's emitted launch against its trial, over many fresh pairs (issue 31).

The pick ``tp1-pp1-dp2-mbs4-z2`` is tuned once (``pipette tune --script-kind accelerate-fsdp``, the
knobs pinned to it, its embedded Ray), then ``--pairs`` times: a fresh trial of it (``--max-trials
1``, 30 timed steps) and at once its ``launch-accelerate.sh`` run as printed, with the helpers of
``tests/integration/test_accelerate_fsdp_script.py``. Run it alone (about 25 s a pair)::

    .venv/bin/python tests/benchmarks/accelerate_pairs.py --pairs 19

Prints each pair (the trial's and the launch's mean and median step time, at the trial's step
positions) and the geometric mean of launch / trial with its 95% interval (Student t): one pair
on a 2-core VM moves with the machine's run-to-run speed, the mean over pairs says whether the
launch runs at its trial's speed (docs/scripts.md, "19 pairs").
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scipy.stats import t as student_t  # noqa: E402

import tests.integration.test_accelerate_fsdp_script as case  # noqa: E402

PIN = ("--max-trials", "1", "--no-memory", "--zero", "2", "--micro-batches", "4", "--recompute", "none")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=19)
    args = parser.parse_args()
    case._env = lambda: {**os.environ, "PYTHONUNBUFFERED": "1"}  # each tune starts its own Ray
    tmp = Path(tempfile.mkdtemp(prefix="accelerate-pairs-"))
    try:
        case._tune(tmp, "best", *PIN)
        logs = []
        for n in range(args.pairs):
            result, _ = case._tune(tmp, f"trial-{n}", *PIN)
            m = result["best"]["measurement"]
            trial, first = m["step_times"], int(m["extra"]["warmup_steps"])
            _, times, others = case._launch(tmp / "best" / "launch-accelerate.sh")
            launch = times[first:first + len(trial)]
            ratio = statistics.fmean(launch) / m["step_time"]
            logs.append(math.log(ratio))
            print(f"pair {n}: trial mean {m['step_time']:.4f} median {statistics.median(trial):.4f} s; launch mean "
                  f"{statistics.fmean(launch):.4f} median {statistics.median(launch):.4f} s; launch / trial: mean "
                  f"{ratio:.3f}, medians {statistics.median(launch) / statistics.median(trial):.3f}; "
                  f"others {others:.2f} cores", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if len(logs) >= 2:
        mean, sd = statistics.fmean(logs), statistics.stdev(logs)
        half = student_t.ppf(0.975, len(logs) - 1) * sd / math.sqrt(len(logs))
        print(f"{len(logs)} pairs: launch / trial geometric mean {math.exp(mean):.3f}, 95% interval "
              f"{math.exp(mean - half):.3f}-{math.exp(mean + half):.3f}; one pair's sd (log) {sd:.3f}; "
              f"within 10%: {sum(abs(math.exp(x) - 1) <= 0.10 for x in logs)}, "
              f"within 15%: {sum(abs(math.exp(x) - 1) <= 0.15 for x in logs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
