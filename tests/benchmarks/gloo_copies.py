"""What gloo's collectives allocate on the calling rank: the CPU allocator's peak (the runner's own
measure, ``workers.rank.memory.PeakTensorBytes``) of one reduce-scatter, all-gather and all-reduce
of a 2 MiB fp32 buffer on 2 gloo ranks over loopback. A trace's fake process group allocates nothing
for them, nor does NCCL on a GPU: where they run at a CPU trial's peak, the trial stands over its
trace by about this much (docs/results.md, "The fsdp stack's memory estimate against its runner on
CPU").

    .venv/bin/python tests/benchmarks/gloo_copies.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.rank.memory import PeakTensorBytes

BUFFER = 2 * 262_144  # fp32 elements: 2 MiB


def _rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    whole, shard, gathered = torch.ones(BUFFER), torch.empty(BUFFER // 2), torch.empty(BUFFER)
    calls: dict[str, Callable[[], object]] = {
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, whole),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, shard),
        "all_reduce": lambda: dist.all_reduce(whole),
    }
    for name, call in calls.items():
        call()  # the first call's one-off buffers are not the steady state
        with PeakTensorBytes() as tracker:
            call()
        if rank == 0:
            print(f"{name:24s} allocator peak {tracker.peak / 2**20:.2f} MiB for a {BUFFER * 4 / 2**20:.2f} MiB buffer")
    dist.destroy_process_group()


def main() -> int:
    from tests.service.processes import free_port

    mp.spawn(_rank, args=(free_port(),), nprocs=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
