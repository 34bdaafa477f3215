"""How steady is this machine? The noise floor under every real trial's timing.

``--processes`` processes (1 by default), one thread each, each timing a fixed piece of work
(a 256 x 256 fp32 matmul, 10 at a time) over and over for ``--seconds``; each ``--window``
(2 s by default, about one CPU trial's timed steps) gives the median time of its batches.
Nothing of Pipette runs: with one process, a window slower than another is the machine (its
other tenants, its clocks), not the trial runner; with as many processes as cores, or more
(a 4-rank CPU trial on 2 cores), what sharing the cores adds. Run it alone (anything else
running on the machine shows up as noise)::

    .venv/bin/python tests/benchmarks/machine_noise.py --seconds 60
    .venv/bin/python tests/benchmarks/machine_noise.py --seconds 60 --processes 4

Prints, per process, every window's median (ms), their spread (max / min, and the standard
deviation of their logs, comparable with the tuner's trial-to-trial noise ``trial_noise_sd``),
and the spread of the batches inside the windows (what a trial's own steps would show).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def measure(seconds: float, window: float, size: int = 256, per_batch: int = 10) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(size, size)
    windows: list[float] = []
    inside: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stop, batches = time.monotonic() + window, []
        while time.monotonic() < stop:
            t = time.perf_counter()
            for _ in range(per_batch):
                a @ a
            batches.append(time.perf_counter() - t)
        median = statistics.median(batches)
        windows.append(median)
        logs = [math.log(b / median) for b in batches]
        inside.append(statistics.pstdev(logs) if len(logs) > 1 else 0.0)
    logs = [math.log(w) for w in windows]
    return {
        "window_s": window, "windows_ms": [1000 * w for w in windows],
        "max_over_min": max(windows) / min(windows),
        "sd_log_between_windows": statistics.stdev(logs) if len(logs) > 1 else 0.0,
        "sd_log_inside_windows_median": statistics.median(inside),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to measure (default 60)")
    ap.add_argument("--window", type=float, default=2.0, help="seconds per window (default 2)")
    ap.add_argument("--processes", type=int, default=1, help="processes at once, one thread each (default 1)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.window <= 0 or args.seconds < 2 * args.window:
        ap.error("--seconds must hold at least two windows, and --window must be positive")
    if args.processes < 1:
        ap.error("--processes must be 1 or more")
    print(f"{args.processes} process(es) of one thread on {os.cpu_count()} cores ({cpu_model()}), "
          f"{args.seconds:g} s in windows of {args.window:g} s:")
    if args.processes == 1:
        outs = [measure(args.seconds, args.window)]
    else:
        with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
            outs = pool.starmap(measure, [(args.seconds, args.window)] * args.processes)
    for i, out in enumerate(outs):
        print(f"process {i}: window medians (ms): " + " ".join(f"{w:.2f}" for w in out["windows_ms"]))
        print(f"  {len(out['windows_ms'])} windows: max/min {out['max_over_min']:.3f}, "
              f"sd of log between windows {out['sd_log_between_windows']:.3f}, "
              f"inside a window (median) {out['sd_log_inside_windows_median']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"processes": args.processes, "cpu": cpu_model(), "runs": outs},
                                              indent=1))
    return 0


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``): these machines are not all alike."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
