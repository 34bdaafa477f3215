"""One device's part of the cluster probe (run by ``workers.host.probe`` in a fresh process).

It measures on the device it stands for (``workers.rank.devices``): on a GPU node the rank's GPU
with NCCL, on a CPU node host tensors with gloo. Every figure says which backend and which
device measured it.

Link matrix: ping-pong between the two devices of each pair, in rounds of disjoint pairs
(the circle method: n - 1 rounds for even n), at two message sizes; the one-way time
``t(S) = alpha + S / beta`` at the two sizes gives latency ``alpha`` and bandwidth ``beta``
(Hockney's model). GPU messages are larger (1 MiB and 64 MiB): at 4 MiB an NVLink transfer
takes about as long as its latency, so the slope would be noise.
Compute: achieved matmul FLOP/s per dtype and shape (bf16, fp16 and fp32 on a GPU, at
square sizes and at the model's own GEMM shapes), and a copy bandwidth (HBM on a GPU,
counting bytes read and written). GPU timings use CUDA events around back-to-back launches
after a warm-up, so the host's launch cost is not counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipette.contract import event_line
from workers.probe_plan import message_sizes
from workers.rank.devices import backend_for, collective_device, rank_device, set_matmul_precision
from workers.rank.store import rendezvous_store

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: on a GPU also fp16 and TF32 (fp32 tensors, the matmul on TF32 tensor cores: ``matmul_precision``)
GPU_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def matmul_precision(name: str, device: torch.device) -> Iterator[None]:
    """fp32 matmuls as a rank training in ``name`` runs them (``set_matmul_precision``: TF32 tensor
    cores for ``tf32`` on a GPU), restored afterwards."""
    before = torch.get_float32_matmul_precision()
    set_matmul_precision(name, device)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


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


class Timer:
    """Wall time of a block on ``device``: CUDA events on a GPU (the block's kernels, not the
    host's launches), ``perf_counter`` on the host."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn: Callable[[], object], reps: int) -> float:
        """Seconds per call of ``fn`` over ``reps`` calls, after one warm-up call."""
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps


def _pingpong(peer: int, first: bool, nbytes: int, iters: int, device: torch.device) -> float:
    """Median one-way time (half the round trip), measured on the pair's first device."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(iters + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL's send/recv return before the transfer ends
        if i >= 2:
            times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def links(rank: int, world: int, iters: int, device: torch.device, sizes: tuple[int, int]) -> dict[str, list[float]]:
    """This rank's measured (peer, size) -> one-way seconds, for pairs it leads."""
    found: dict[str, list[float]] = {}
    barrier = torch.zeros(1, device=collective_device(dist.get_backend(), device))
    for pairs in rounds(world):
        for a, b in pairs:
            if rank in (a, b):
                peer = b if rank == a else a
                t = [_pingpong(peer, rank == a, size, iters, device) for size in sizes]
                if rank == a:
                    found[str(b)] = t
        dist.all_reduce(barrier)  # a barrier on the backend's device
    return found


def matmul_flops(
    shapes: list[tuple[int, int, int]], budget_s: float, device: torch.device | None = None,
    dtypes: dict[str, torch.dtype] | None = None,
) -> dict[str, list[list[float]]]:
    """Achieved FLOP/s per dtype at each (m, k, n), on ``device`` (the host by default)."""
    device = device or torch.device("cpu")
    timer = Timer(device)
    out: dict[str, list[list[float]]] = {}
    for name, dtype in (dtypes or DTYPES).items():
        with matmul_precision(name, device):
            _time_shapes(out, name, dtype, shapes, budget_s, device, timer)
    return out


def _time_shapes(out: dict[str, list[list[float]]], name: str, dtype: torch.dtype,
                 shapes: list[tuple[int, int, int]], budget_s: float, device: torch.device, timer: Timer) -> None:
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)

        def product(a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
            return a @ b

        one = timer(product, 1)
        reps = max(1, min(1000, int(budget_s / max(one, 1e-7))))
        seconds = timer(product, reps)
        out.setdefault(name, []).append([m, k, n, 2.0 * m * k * n / seconds])
        del a, b, product


def copy_bandwidth(nbytes: int = 64 * 1024 * 1024, reps: int = 5, device: torch.device | None = None) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    device = device or torch.device("cpu")
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = Timer(device)(lambda: dst.copy_(src), reps)
    return 2.0 * nbytes / seconds


def measure(options: dict[str, Any], rank: int, world: int, device_kind: str) -> dict[str, Any]:
    """This rank's figures (distributed is initialized)."""
    device = rank_device(device_kind)
    gpu = device.type == "cuda"
    sizes = message_sizes(device_kind)
    shapes = [(int(m), int(k), int(n)) for m, k, n in options.get("shapes", [[256, 256, 256], [512, 512, 512]])]
    out: dict[str, Any] = {
        "rank": rank,
        "device": str(device),
        "backend": dist.get_backend(),
        "message_sizes": list(sizes),
        "links": links(rank, world, int(options.get("iters", 8)), device, sizes) if world > 1 else {},
        "matmul": matmul_flops(shapes, float(options.get("budget_s", 0.15)), device, GPU_DTYPES if gpu else DTYPES),
        "copy_bandwidth": copy_bandwidth(1024**3 if gpu else 64 * 1024 * 1024, 20 if gpu else 5, device),
    }
    if gpu:
        out["device_name"] = torch.cuda.get_device_name(device)
        out["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return out


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options: dict[str, Any] = json.loads(os.environ.get("PIPETTE_PROBE", "{}"))
    device_kind = str(options.get("device_kind", "cpu"))
    device = rank_device(device_kind)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = rendezvous_store(world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(backend_for(device_kind), store=store, rank=rank, world_size=world)
    result = measure(options, rank, world, device_kind)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)  # under NCCL it moves the objects through the rank's GPU
    if rank == 0:
        sys.stdout.write(event_line({"event": "done", "ranks": gathered}))
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
