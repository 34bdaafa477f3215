"""MLPerf's Llama-2-70B LoRA job on one DGX (issue 28's target): the layout MLPerf ran, what
Pipette predicts for it, and where the plan ranks it.

Run: ``PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/mlperf_lora.py [--stack megatron+fp8]``.

The layouts are NVIDIA's MLPerf Training v4.0 submission (mlcommons/training_results_v4.0,
NVIDIA/benchmarks/llama2_70b_lora/implementations/nemo): ``config_DGXH100_1x8x4xtp4pp1cp1.sh``
(8x H100: TP 4, PP 1, micro-batch 1, MINIBS 4, so dp 2 and 4 micro-batches of the global batch 8)
and ``config_DGXH200_1x8x2xtp2pp1cp1.sh`` (8x H200: TP 2, dp 4, 2 micro-batches); no activation
recomputation, sequence parallel, FP8 with FP8 weights, seq 8192, LoRA rank 16 on the attention.
The published throughput the target is set against: 2.155 samples/s (a 3.71 s step).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipette.clusterfile import homogeneous_cluster  # noqa: E402
from pipette.config import ParallelConfig  # noqa: E402
from pipette.memory import estimate_memory  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.perf import estimate_perf  # noqa: E402
from pipette.plan import make_plan  # noqa: E402
from pipette.stacks import get_stack  # noqa: E402
from pipette.training import LoraSpec, TrainingSpec  # noqa: E402

PUBLISHED_SAMPLES_PER_S = 2.155
GB, GiB = 1e9, 2**30
#: device, MLPerf's tp on it
LAYOUTS = (("H100-80GB", 4), ("H200-141GB", 2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", default="megatron+fp8")
    args = ap.parse_args()
    stack = get_stack(args.stack)
    # Llama-2-70B at MLPerf's 8192 tokens (the preset's max_position_embeddings is 4096)
    model = replace(ModelSpec.preset("llama2-70b"), max_seq=8192)
    training = TrainingSpec(global_batch=8, seq_len=8192, method="lora", lora=LoraSpec(16, 32.0))
    for device, tp in LAYOUTS:
        cluster = homogeneous_cluster(device, 1, 8, 450 * GB, 50 * GB, name=f"dgx-{device}")
        layout = ParallelConfig(tp=tp, pp=1, dp=8 // tp, mbs=1, global_batch=8, zero_stage=1, recompute="none")
        mem = estimate_memory(model, training, layout, cluster.min_usable_memory, stack=stack)
        perf = estimate_perf(model, training, layout, cluster, stack=stack)
        rate = training.global_batch / perf.step_time
        plan = make_plan(model, training, cluster, stack=stack)
        labels = [c.config.label for c in plan.ranked]
        rank = next((i + 1 for i, c in enumerate(plan.ranked)
                     if (c.config.tp, c.config.pp, c.config.dp, c.config.mbs, c.config.recompute)
                     == (tp, 1, 8 // tp, 1, "none")), None)
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in mem.breakdown.items() if v)
        # megatron+fp8's tp_overlap was kept because this figure matched (pipette.constant_sources): a
        # calibration row, not a verdict; the cross-validated ones are tests/benchmarks/crossval.py's
        against = f" ({rate / PUBLISHED_SAMPLES_PER_S - 1:+.1%} against {PUBLISHED_SAMPLES_PER_S}, the figure " \
            "megatron+fp8 was calibrated on: not a verdict)" if device == "H100-80GB" else ""
        print(f"{device} x8, MLPerf layout {layout.label} with {stack.key}: memory {mem.peak_bytes / GiB:.1f} GiB "
              f"({parts}); step {perf.step_time:.2f} s = {rate:.3f} samples/s{against}; "
              f"plan rank {rank if rank else 'dropped'} of {len(labels)}; top 5: {', '.join(labels[:5])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
