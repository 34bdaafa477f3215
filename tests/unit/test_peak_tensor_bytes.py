"""workers.rank.memory.PeakTensorBytes: a CPU rank's peak is the allocator's, on top of what the
step's process holds, not what earlier work left for the garbage collector."""

from __future__ import annotations

import gc

import pytest
import torch

from workers.rank.memory import PeakTensorBytes

MB = 1_000_000


def test_a_storage_freed_by_a_resize_is_not_counted_after_it() -> None:
    # FSDP2 frees an unsharded parameter so (storage.resize_(0)) and gathers into it again
    with PeakTensorBytes() as tracker:
        kept = torch.empty(MB // 4)  # 1 MB, alive to the end
        gathered = torch.empty(2 * MB // 4)  # 2 MB
        gathered.untyped_storage().resize_(0)
        later = torch.empty(MB // 4)  # 1 MB: the peak stays 3 MB, not 4
    assert tracker.peak_bytes - tracker.base == 3 * MB
    del kept, gathered, later


def test_a_temporary_counts_at_its_peak() -> None:
    a = torch.ones(500, 500)
    with PeakTensorBytes() as tracker:
        b = (a * 2) + 1  # a * 2 (1 MB) alive while + 1 allocates the result (1 MB)
        del b
    # (and the scalars 2 and 1 as 0-d tensors: a few bytes)
    assert 0 <= tracker.peak_bytes - tracker.base - 2 * 500 * 500 * 4 < 1024


def test_garbage_of_earlier_work_is_not_in_the_base() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self
            self.tensor = torch.empty(4 * MB // 4)  # 4 MB nothing reaches once dropped

    gc.collect()
    gc.disable()  # keep the cycle uncollected until the tracker looks
    try:
        with PeakTensorBytes() as clean:
            pass
        Cycle()
        with PeakTensorBytes() as tracker:
            pass
    finally:
        gc.enable()
    assert tracker.base - clean.base < MB


def test_a_failed_step_raises_its_own_error() -> None:
    with pytest.raises(MemoryError, match="the step's"):
        with PeakTensorBytes():
            raise MemoryError("the step's")
