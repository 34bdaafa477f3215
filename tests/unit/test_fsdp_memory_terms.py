"""The fsdp stack's memory terms of issue 28 (torchtitan): the fused loss, FSDP2's fp32 no-sync
gradients under pipelining, DTensor TP's gathered norm outputs, loss_parallel's fp32 copies and the
stack's own fragmentation (docs/stacks.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.memory import (
    FRAGMENTATION,
    FSDP_COMPILE_FRAGMENTATION,
    FSDP_FRAGMENTATION,
    FSDP_OPTIONS,
    MemoryOptions,
    stage_breakdowns,
)
from pipette.model import ModelSpec
from pipette.stacks import get_stack
from pipette.training import TrainingSpec

MODEL = ModelSpec(name="llama-small", layers=8, hidden=1024, heads=16, kv_heads=4, ffn_hidden=3584, vocab=32000,
                  max_seq=2048, arch="llama")
TRAIN = TrainingSpec(global_batch=64, seq_len=2048, dtype="bf16", optimizer="adamw", recompute=("selective", "full"))
GB = 2**30


def _last(config: ParallelConfig, options: MemoryOptions) -> dict[str, int]:
    return stage_breakdowns(MODEL, TRAIN, config, options=options)[-1]


def test_a_fused_loss_keeps_the_logits_and_their_gradient_in_the_training_dtype() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=64, zero_stage=3, recompute="selective")
    logits = 2 * 2048 * 32000
    eager = _last(cfg, FSDP_OPTIONS)["logits"]
    fused = _last(cfg, replace(FSDP_OPTIONS, fused_loss=True))["logits"]
    assert eager == logits * (2 + 3 * 4)  # bf16 logits + 3 fp32 copies
    assert fused == logits * (2 + 2)


def test_unsynced_gradients_under_a_pipeline_accumulate_in_fp32() -> None:
    # FSDP2 upcasts each unsynced unsharded gradient to reduce_dtype (FSDPParam.to_accumulated_grad_if_needed)
    pp = ParallelConfig(tp=1, pp=2, dp=4, mbs=1, global_batch=64, zero_stage=3, recompute="full")
    grads = stage_breakdowns(MODEL, TRAIN, pp, options=FSDP_OPTIONS)[0]["gradients"]
    layer, stage_layers = MODEL.layer_params(), MODEL.layers // 2
    sharded = (stage_layers * layer + MODEL.embedding_params()) * 4 / 4  # fp32 over dp 4, with the embedding
    assert grads == pytest.approx(sharded + stage_layers * layer * 4, rel=1e-6)  # + unsharded fp32


def test_dtensor_tensor_parallelism_saves_the_gathered_norm_outputs() -> None:
    cfg = ParallelConfig(tp=4, pp=1, dp=2, mbs=1, global_batch=64, zero_stage=3, recompute="full")
    megatron_like = replace(FSDP_OPTIONS, tp_saves_gathered_inputs=False)
    extra = _last(cfg, FSDP_OPTIONS)["activations"] - _last(cfg, megatron_like)["activations"]
    sbh = 2048 * 1 * 1024 * 2
    # two norm outputs of the rebuilt layer, and the final norm's, whole instead of 1/t
    assert extra == pytest.approx(3 * sbh * (1 - 1 / 4), abs=2)
    no_tp = replace(cfg, tp=1, dp=8)
    assert _last(no_tp, FSDP_OPTIONS)["activations"] == _last(no_tp, megatron_like)["activations"]


def test_loss_parallel_holds_four_fp32_copies_under_tensor_parallelism() -> None:
    cfg = ParallelConfig(tp=4, pp=1, dp=2, mbs=1, global_batch=64, zero_stage=3, recompute="full")
    per_rank = 1 * 2048 * 32000 / 4
    assert _last(cfg, FSDP_OPTIONS)["logits"] == int(per_rank * (2 + 4 * 4))
    assert _last(replace(cfg, tp=1, dp=8), FSDP_OPTIONS)["logits"] == int(4 * per_rank * (2 + 3 * 4))


def test_the_fragmentation_is_an_option_the_fsdp_stack_fits_on_reserved_bytes() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=64, zero_stage=3, recompute="selective")
    a = _last(cfg, replace(FSDP_OPTIONS, fragmentation=1.0))
    b = _last(cfg, replace(FSDP_OPTIONS, fragmentation=1.5))
    assert b["overhead"] - a["overhead"] == pytest.approx(0.5 * (a["activations"] + a["logits"]), abs=2)
    assert MemoryOptions().fragmentation == FRAGMENTATION
    assert FSDP_OPTIONS.fragmentation == FSDP_FRAGMENTATION != FRAGMENTATION


def test_fsdp_compile_fuses_the_loss_and_uses_its_own_fragmentation() -> None:
    plain, compiled = get_stack("fsdp").memory_options, get_stack("fsdp+compile+fp8").memory_options
    assert not plain.fused_loss and compiled.fused_loss
    assert compiled.fragmentation == FSDP_COMPILE_FRAGMENTATION
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=64, zero_stage=3, recompute="selective")
    assert sum(_last(cfg, compiled).values()) < sum(_last(cfg, plain).values()) - GB // 4
    # other stacks' compile changes nothing in memory
    assert get_stack("hf-deepspeed+compile").memory_options == get_stack("hf-deepspeed").memory_options


def test_one_micro_batch_without_a_pipeline_has_no_gradient_at_its_peak() -> None:
    """A trace of the runner (workers.rank.fsdp_trace, Llama 3 8B over 8 ranks, one micro-batch):
    the peak is the loss's backward, before any sharded gradient exists. With a second micro-batch
    the first one's reduced gradients are there during the second's backward."""
    from pipette.model import MODEL_PRESETS

    model = MODEL_PRESETS["llama3-8b"]
    train = TrainingSpec(global_batch=8, seq_len=8192, dtype="bf16", optimizer="adamw")
    one = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8, zero_stage=3, recompute="selective")
    assert stage_breakdowns(model, train, one, options=FSDP_OPTIONS)[0]["gradients"] == 0
    two = replace(one, global_batch=16)
    sharded = 4 * model.total_params() / 8
    assert stage_breakdowns(model, replace(train, global_batch=16), two,
                            options=FSDP_OPTIONS)[0]["gradients"] == pytest.approx(sharded, rel=0.01)
