"""Planning speed: llama2-70b LoRA on 128 nodes x 8 H100 (1024 devices).

Enumerate, estimate memory and step time of every candidate, and optimise the placement
of the top 20: the issue's target is <= 5 s on a 2-core machine. Prints the figure.

    .venv/bin/python tests/benchmarks/planning_speed.py [--check]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipette.clusterfile import homogeneous_cluster
from pipette.model import ModelSpec
from pipette.plan import make_plan
from pipette.training import TrainingSpec

TARGET_S = 5.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    args = parser.parse_args()
    model = ModelSpec.preset("llama2-70b")
    training = TrainingSpec(global_batch=1024, seq_len=4096, method="lora")
    cluster = homogeneous_cluster("H100-80GB", 128, 8, 450e9, 50e9, name="h100-128x8")
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        plan = make_plan(model, training, cluster, optimize_top=20)
        times.append(time.perf_counter() - start)
    best = plan.best
    print(f"llama2-70b LoRA, 128 x 8 H100 ({cluster.world} devices), global batch 1024 x 4096")
    print(f"  candidates enumerated: {plan.enumerated}, fit: {len(plan.ranked)}, "
          f"dropped: {sum(plan.dropped.values())}")
    print(f"  best: {best.config.label}  {best.perf.step_time:.3f} s/step  MFU {best.perf.mfu:.1%}")
    print(f"  planning time: median {statistics.median(times):.2f} s, "
          f"min {min(times):.2f} s over {len(times)} runs (target <= {TARGET_S:.0f} s)")
    return 1 if args.check and statistics.median(times) > TARGET_S else 0


if __name__ == "__main__":
    sys.exit(main())
