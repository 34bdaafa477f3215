"""Peak memory per rank and the memory cap that turns an over-size trial into ``oom``.

* GPU: ``torch.cuda.max_memory_allocated`` (live tensor bytes, by the caching allocator), and
  ``max_memory_reserved`` beside it (what the allocator held, which is what runs out).
* CPU: there is no allocator counter to read, so the CPU allocator's own allocation and free
  events during the step (``torch.profiler``) give its peak, on top of the tensors alive when
  the step starts; plus the peak resident set size (``ru_maxrss``) of the process.
* The cap: on CPU an address-space limit (``RLIMIT_AS``) of the process's size when the
  trial starts plus the cap, so an allocation past it fails as a real out-of-memory; on a GPU
  the caching allocator's per-process fraction of the device.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch

_OOM_BYTES = re.compile(r"(?:tried to allocate|allocate)\s+([0-9]+(?:\.[0-9]+)?)\s*(bytes|[KMG]i?B)?", re.I)
_UNITS = {None: 1, "bytes": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach. Fake tensors (a memory
    trace's, ``workers.rank.fsdp_trace``) hold none: their storages all read data pointer 0, so
    counting them added the size of whichever was seen last."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta and not isinstance(obj, FakeTensor):
            try:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:
                # a wrapper subclass (DTensor) has no storage of its own (its local tensor is
                # counted), and a storage FSDP2 freed after a reshard has no data pointer
                continue
    return sum(seen.values())


class PeakTensorBytes:
    """Peak live tensor bytes during the block on CPU: the bytes alive at entry plus the most the
    CPU allocator had handed out, net of what it took back, at any moment inside it, read from its
    own allocation and free events (``torch.profiler`` with ``profile_memory``) on this thread,
    where autograd runs a CPU backward. The allocator sees what a count of operators' outputs did
    not: FSDP2 frees an unsharded parameter by resizing its storage to 0 and gathers into it again
    by resizing it back. The base is taken after a garbage collection: tensors of earlier work in
    unreachable cycles are not the step's (docs/results.md, "The fsdp stack's memory estimate
    against its runner on CPU": both faults, measured)."""

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self._profile: Any = None

    def __enter__(self) -> PeakTensorBytes:
        from torch.profiler import ProfilerActivity, profile

        gc.collect()  # a cycle of tensors nothing reaches is no longer the step's: not in its base
        self.base = live_tensor_bytes()
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        prof, self._profile = self._profile, None
        with _quiet_stderr():
            prof.__exit__(*exc)
        if exc[0] is not None:  # the step failed (an out-of-memory, say): its error, not a count
            return
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        live = 0
        for event in events:
            live += event.nbytes()
            self.peak = max(self.peak, live)

    @property
    def peak_bytes(self) -> int:
        return self.base + self.peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto writes two lines to the process's stderr at each start and stop of a profile
    ("USDT: ... profiler_start"), whatever ``KINETO_LOG_LEVEL`` says; a rank's stderr is what a
    failed trial shows its user."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def apply_memory_cap(cap_bytes: int, device: torch.device | None = None) -> int:
    """Limit what the rank may allocate on ``device``; returns the limit set, in bytes.

    Host (CPU devices): the process's current size plus ``cap_bytes``. GPU: the caching
    allocator refuses to hold more than ``cap_bytes`` of the device
    (``torch.cuda.set_per_process_memory_fraction``), and raises its own out-of-memory error,
    as a smaller GPU would."""
    if device is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, cap_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        return int(fraction * total)
    limit = address_space_bytes() + cap_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    return limit


def oom_bytes(error: BaseException) -> int | None:
    """The bytes an allocation asked for, when ``error`` is an out-of-memory error; else None."""
    text = str(error)
    if isinstance(error, MemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text:
        m = _OOM_BYTES.search(text)
        if not m:
            return 0
        return int(float(m.group(1)) * _UNITS[(m.group(2) or "bytes").lower()])
    return None


def oom_where(error: BaseException) -> str:
    """``device`` for a GPU allocator's out-of-memory error, ``host`` for the host's (a
    ``MemoryError``, or an allocation past the address-space cap)."""
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError) or "CUDA out of memory" in text:
        return "device"
    return "host"


def allocator_record(device: torch.device) -> dict[str, int]:
    """What the CUDA caching allocator saw on ``device`` so far (``torch.cuda.memory_stats``):
    the peak live bytes, the peak it held, the peak it held but could not use (inactive
    split blocks: fragmentation), how often it had to free its cache and retry, and the
    device memory in use outside it (the CUDA context, cuBLAS/NCCL workspaces: ``mem_get_info``
    less what the allocator holds now). The fits boundary is fitted on these (docs/models.md)."""
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved_now = int(stats.get("reserved_bytes.all.current", 0))
    return {
        "peak_allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
        "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
        "peak_inactive_split_bytes": int(stats.get("inactive_split_bytes.all.peak", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "allocator_ooms": int(stats.get("num_ooms", 0)),
        "outside_allocator_bytes": max(0, int(total - free) - reserved_now),
    }
