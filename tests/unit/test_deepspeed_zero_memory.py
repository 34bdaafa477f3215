"""DeepSpeed's ZeRO-1/2 as the DeepSpeed stacks hold it (``MemoryOptions.deepspeed_zero``), term by term
from deepspeed/runtime/zero/stage_1_and_2.py and engine.py (0.19.8), under the ``ds_config.json``
Pipette writes (``overlap_comm``, ``contiguous_gradients``, ``reduce_bucket_size`` = the whole model's
trainable parameters). The CPU trials that measured them: tests/integration/test_zero_memory.py."""

from __future__ import annotations

import pytest

from pipette.config import ParallelConfig
from pipette.emit import deepspeed_config
from pipette.memory import estimate_memory, trainable_params
from pipette.memory_options import DEFAULT_OPTIONS, MEGATRON_OPTIONS
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

MODEL = ModelSpec.preset("tiny-llama")
FP32 = TrainingSpec(global_batch=8, seq_len=128, dtype="fp32")


def parts(zero: int, pp: int = 1, dp: int = 2, mbs: int = 1, stack: str = "pipette") -> dict[str, int]:
    config = ParallelConfig(tp=1, pp=pp, dp=dp, mbs=mbs, global_batch=8, zero_stage=zero)
    return estimate_memory(MODEL, FP32, config, 2**36, device_kind="cpu", stack=stack).breakdown


def test_the_deepspeed_stacks_hold_deepspeeds_zero_and_no_other_stack_does() -> None:
    assert DEFAULT_OPTIONS.deepspeed_zero and not MEGATRON_OPTIONS.deepspeed_zero
    assert parts(1, stack="hf-deepspeed")["buffers"] == parts(1)["buffers"]


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_clone_an_fp32_master_even_of_fp32_weights(zero: int) -> None:
    """``single_partition_of_fp32_groups``: the rank's partition ``.detach().clone()``d, fp32 or not:
    4 bytes a parameter over dp beside Adam's 8 over dp."""
    psi = MODEL.total_params()
    assert parts(zero)["optimizer"] == int(psi * (8 + 4) / 2)
    assert parts(0)["optimizer"] == int(psi * 8)  # ZeRO-0 steps the client optimizer on the weights


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_hold_two_reduce_buckets_one_under_a_pipeline(zero: int) -> None:
    """``setup_buckets``: two ``reduce_bucket_size`` buffers under ``overlap_comm``, at any dp; the
    pipeline engine's ``reduce_gradients(pipeline_parallel=True)`` makes one. The bucket is what the
    written config sets, the whole model's trainable parameters, on every stage."""
    bucket = deepspeed_config(FP32, ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=8, zero_stage=zero),
                              model=MODEL)["zero_optimization"]["reduce_bucket_size"]
    assert bucket == trainable_params(MODEL, FP32)
    assert parts(zero)["buffers"] == 2 * bucket * 4
    assert parts(zero, dp=1)["buffers"] == 2 * bucket * 4
    assert parts(zero, pp=2, dp=1)["buffers"] == bucket * 4


def test_zero_0s_flat_copy_comes_after_the_backward() -> None:
    """``buffered_allreduce_fallback`` flattens the gradients after the backward: it adds to the
    peak only what it holds beyond the activations and logits freed by then."""
    small = parts(0, mbs=1)
    assert small["activations"] + small["logits"] > small["gradients"]
    assert small["buffers"] == 0
    megatron = estimate_memory(MODEL, FP32, ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=8, zero_stage=0),
                               2**36, device_kind="cpu", options=MEGATRON_OPTIONS).breakdown
    assert megatron["buffers"] == MODEL.total_params() * 4  # a framework whose bucket lives through the backward
