"""Where a real Ray trial's wall time goes on this machine: its set-up (from the runner's call
to the first step of the rank) against its steps, and the CPU the machine spent on it.

    ./dev bench trial_overhead [--trials 6] [--candidate LABEL] [--json OUT.json]

Real trials through ``workers.host.runner.RayTrialRunner`` (local Ray, the zygote, DeepSpeed) of one
tiny-llama LoRA candidate (``pipette tune``'s default recipe on the 4 CPU devices of
``examples/clusters/cpu-4.yaml``: no probe, so every run plans the same candidates), one after
another. Per trial: the wall time, the set-up (call to first step event), the steps (first to
last step event), the step time the runner measured, and the CPU-seconds the whole machine
spent (``/proc/stat``), so set-up work done in parallel shows as well. The first trial
starts Ray's workers and the node's zygote: it is reported apart and left out of the medians.

A before/after comparison runs this file in two trees one after another, alternately, each
from its own tree as the working directory (``cd TREE && PYTHONPATH=TREE python
tests/benchmarks/trial_overhead.py``): Ray's workers import ``workers/`` from the driver's
working directory, so ``PYTHONPATH`` alone leaves the actors on the other tree's code. Load
moves, so read the ratio of medians taken in the same hour, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT = "tp1-pp1-dp4-mbs4-z1-rc:none-1f1b"


def cpu_seconds() -> float:
    """Busy CPU-seconds of the whole machine since boot (every field but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def run(trials: int, candidate: str) -> dict[str, Any]:
    from pipette.clusterfile import load_cluster
    from pipette.model import ModelSpec
    from pipette.plan import make_plan
    from tests.benchmarks.real_tuning import recipe
    from workers.host.ray_cluster import ensure_ray
    from workers.host.runner import RayTrialRunner

    model = ModelSpec.preset("tiny-llama")
    # the real-tuning benchmark's recipe, its full space (the default candidate is in any)
    training = recipe(argparse.Namespace(wide=True, micro_batches=None, zero=None, recompute=None, schedules=None))
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    plan = make_plan(model, training, cluster, seed=0)
    by_label = {p.config.label: p for p in plan.ranked}
    if candidate not in by_label:
        raise SystemExit(f"--candidate {candidate!r} is not a candidate of the plan; some are: "
                         + ", ".join(list(by_label)[:5]))
    ensure_ray()
    runner = RayTrialRunner(model, training, cluster, device_kind=cluster.device_spec.kind, timeout_s=300,
                            max_steps=8, seed=0)
    rows = []
    for i in range(trials):
        marks: list[float] = []
        cpu0, t0 = cpu_seconds(), time.monotonic()

        def on_step(p: object, marks: list[float] = marks) -> bool:
            marks.append(time.monotonic())
            return False

        m = runner(by_label[candidate].config, on_step)
        wall, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
        row: dict[str, Any] = {"trial": i, "status": m.status, "wall_s": wall, "cpu_s": cpu, "step_time": m.step_time,
               "setup_s": (marks[0] - t0) if marks else None, "steps_s": (marks[-1] - marks[0]) if marks else None}
        rows.append(row)
        print(f"  trial {i}: {m.status:<7} wall {wall:5.1f} s, set-up {row['setup_s'] or 0:5.1f} s, steps "
              f"{row['steps_s'] or 0:4.1f} s, machine CPU {cpu:5.1f} s, step {m.step_time or 0:.3f} s", flush=True)
    warm = [r for r in rows[1:] if r["status"] == "ok"]
    keys = ("wall_s", "setup_s", "steps_s", "cpu_s")
    summary = {k: statistics.median(r[k] for r in warm) for k in keys} if warm else {}
    return {"candidate": candidate, "trials": rows, "median_after_first": summary}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=6, help="trials, the first one included (default 6)")
    ap.add_argument("--candidate", default=DEFAULT, help=f"the candidate's label (default {DEFAULT})")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.trials < 2:
        ap.error("--trials must be at least 2: the first trial starts Ray's workers and is left out")
    print(f"{args.trials} trials of {args.candidate} (tiny-llama LoRA, 4 CPU devices), tree {ROOT}:")
    out = run(args.trials, args.candidate)
    s = out["median_after_first"]
    if s:
        print(f"median of trials 2-{args.trials}: wall {s['wall_s']:.1f} s = set-up {s['setup_s']:.1f} s + steps "
              f"{s['steps_s']:.1f} s (+ the end); machine CPU {s['cpu_s']:.1f} s per trial")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
