"""One device's part of the cluster probe (run by ``workers.probe`` in a fresh process).

Link matrix: ping-pong between the two devices of each pair, in rounds of disjoint pairs
(the circle method: n - 1 rounds for even n), at two message sizes; the one-way time
``t(S) = alpha + S / beta`` at the two sizes gives latency ``alpha`` and bandwidth ``beta``.
Compute: achieved matmul FLOP/s per dtype and shape, and a copy bandwidth for memory.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

EVENT_PREFIX = "@@pipette "
SIZES = (8 * 1024, 4 * 1024 * 1024)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """Disjoint pairs covering every pair once: n - 1 rounds (n even), n rounds (n odd)."""
    ring = list(range(n)) + ([-1] if n % 2 else [])
    m = len(ring)
    out = []
    for _ in range(m - 1):
        pairs = [(ring[i], ring[m - 1 - i]) for i in range(m // 2)]
        out.append([(min(a, b), max(a, b)) for a, b in pairs if a >= 0 and b >= 0])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return out


def _pingpong(me: int, peer: int, first: bool, nbytes: int, iters: int) -> float:
    """Median one-way time (half the round trip), measured on the pair's first device."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    times = []
    for i in range(iters + 2):
        start = time.perf_counter()
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if i >= 2:
            times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def links(rank: int, world: int, iters: int) -> dict[str, list[float]]:
    """This rank's measured (peer, size) -> one-way seconds, for pairs it leads."""
    found: dict[str, list[float]] = {}
    for pairs in rounds(world):
        for a, b in pairs:
            if rank in (a, b):
                peer = b if rank == a else a
                t = [_pingpong(rank, peer, rank == a, size, iters) for size in SIZES]
                if rank == a:
                    found[str(b)] = t
        dist.barrier()
    return found


def matmul_flops(shapes: list[tuple[int, int, int]], budget_s: float) -> dict[str, list[list[float]]]:
    """Achieved FLOP/s per dtype at each (m, k, n)."""
    out: dict[str, list[list[float]]] = {}
    for name, dtype in DTYPES.items():
        for m, k, n in shapes:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            a @ b  # warm-up
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < budget_s:
                a @ b
                count += 1
            elapsed = time.perf_counter() - start
            out.setdefault(name, []).append([m, k, n, 2.0 * m * k * n * count / elapsed])
    return out


def copy_bandwidth(nbytes: int = 64 * 1024 * 1024, reps: int = 5) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2.0 * nbytes * reps / (time.perf_counter() - start)  # read + write


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options: dict[str, Any] = json.loads(os.environ.get("PIPETTE_PROBE", "{}"))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    result = {
        "rank": rank,
        "links": links(rank, world, int(options.get("iters", 8))) if world > 1 else {},
        "matmul": matmul_flops([tuple(s) for s in options.get("shapes", [[256, 256, 256], [512, 512, 512]])],
                               float(options.get("budget_s", 0.15))),
        "copy_bandwidth": copy_bandwidth(),
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        sys.stdout.write(EVENT_PREFIX + json.dumps({"event": "done", "ranks": gathered}) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
