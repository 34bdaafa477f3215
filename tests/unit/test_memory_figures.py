"""The estimate's three named figures (issue 46): live (max_memory_allocated), reserved (the caching
allocator) and device-used (the reserve, the CUDA context, NCCL's buffers and workspaces: what nvidia-smi
shows), each stack comparing the one its fits prior was fitted on, and `pipette plan` saying which."""

from __future__ import annotations

import pytest

from cli.plan import memory_figure_lines
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.memory import estimate_memory, outside_allocator_bytes
from pipette.memory_options import (
    CUDA_CONTEXT_BYTES,
    NCCL_BUFFSIZE_BYTES,
    NCCL_CHANNELS,
    NCCL_PEERS_PER_CHANNEL,
    MemoryOptions,
)
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

MODEL = ModelSpec.preset("llama3-8b")
TRAINING = TrainingSpec(global_batch=64, seq_len=4096, dtype="bf16", optimizer="adamw")
CONFIG = ParallelConfig(tp=2, pp=2, dp=2, mbs=1, global_batch=64, zero_stage=1)
H100 = 80 * 2**30
PER_COMMUNICATOR = NCCL_CHANNELS * NCCL_PEERS_PER_CHANNEL * NCCL_BUFFSIZE_BYTES


def test_outside_the_allocator_is_the_context_and_a_buffer_set_per_communicator() -> None:
    assert PER_COMMUNICATOR == 128 * 2**20  # 16 channels x 2 peers x NCCL_BUFFSIZE's 4 MiB
    assert outside_allocator_bytes(ParallelConfig(tp=1, pp=1, dp=1, mbs=1, global_batch=1)) == CUDA_CONTEXT_BYTES
    assert outside_allocator_bytes(CONFIG) == CUDA_CONTEXT_BYTES + 3 * PER_COMMUNICATOR  # tp, pp and dp groups


@pytest.mark.parametrize(
    ("stack", "figure"),
    [
        ("pipette", "device-used"),
        ("hf-deepspeed", "device-used"),
        ("megatron", "reserved"),
        ("megatron+fp8", "reserved"),
        ("nanotron", "reserved"),
        ("fsdp", "reserved"),
    ],
)
def test_each_stack_compares_the_figure_its_prior_was_fitted_on(stack: str, figure: str) -> None:
    est = estimate_memory(MODEL, TRAINING, CONFIG, H100, stack=stack)
    assert est.capacity_figure == figure and est.peak_bytes == est.figure(figure)
    assert est.live_bytes < est.reserved_bytes < est.device_used_bytes == est.reserved_bytes + est.outside_bytes
    assert est.reserved_bytes == sum(est.breakdown.values())
    d = est.to_dict()
    assert (d["device_used_bytes"], d["outside_bytes"], d["capacity_figure"]) == (
        est.device_used_bytes,
        est.outside_bytes,
        figure,
    )


def test_a_cpu_rank_has_nothing_outside_its_figures() -> None:
    est = estimate_memory(MODEL, TRAINING, CONFIG, H100, device_kind="cpu")
    assert est.outside_bytes == 0 and est.device_used_bytes == est.reserved_bytes == est.peak_bytes


def test_only_a_figure_a_prior_is_fitted_on_is_compared() -> None:
    with pytest.raises(SpecError, match="capacity_figure"):
        MemoryOptions(capacity_figure="live")


def test_the_plan_says_which_figure_it_compares_with_the_capacity() -> None:
    pipette = memory_figure_lines(estimate_memory(MODEL, TRAINING, CONFIG, H100, stack="pipette"), "pipette")
    megatron = memory_figure_lines(estimate_memory(MODEL, TRAINING, CONFIG, H100, stack="megatron"), "megatron")
    assert [line.split()[0] for line in pipette[:3]] == ["live", "reserved", "device-used"]
    assert "the device-used figure (pipette's fits prior" in pipette[-1] and "80.0 GiB" in pipette[-1]
    assert "the reserved figure (megatron's fits prior" in megatron[-1]
