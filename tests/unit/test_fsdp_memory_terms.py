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


def _last(config: ParallelConfig, options: MemoryOptions, phase: str | None = None) -> dict[str, int]:
    return stage_breakdowns(MODEL, TRAIN, config, options=options, phase=phase)[-1]


def test_a_fused_loss_keeps_the_logits_and_their_gradient_in_the_training_dtype() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=64, zero_stage=3, recompute="selective")
    logits = 2 * 2048 * 32000
    eager = _last(cfg, FSDP_OPTIONS, "loss")["logits"]
    fused = _last(cfg, replace(FSDP_OPTIONS, fused_loss=True), "loss")["logits"]
    assert eager == logits * 3 * 4  # 3 fp32 copies: the bf16 logits are dropped before the backward
    assert fused == logits * (2 + 2)
    # the head's backward: the logits' bf16 gradient
    assert _last(cfg, FSDP_OPTIONS, "head")["logits"] == logits * 2


def test_unsynced_gradients_under_a_pipeline_accumulate_in_fp32() -> None:
    # FSDP2 upcasts each unsynced unsharded gradient to reduce_dtype (FSDPParam.to_accumulated_grad_if_needed)
    pp = ParallelConfig(tp=1, pp=2, dp=4, mbs=1, global_batch=64, zero_stage=3, recompute="full")
    layer, stage_layers = MODEL.layer_params(), MODEL.layers // 2
    sharded = (stage_layers * layer + MODEL.embedding_params()) * 4 / 4  # fp32 over dp 4, with the embedding
    # through the micro-batches: the unsharded fp32 accumulators of every unit, the root's (here the
    # embedding) too, and no sharded ones (no sync until the last micro-batch)
    unsharded = (stage_layers * layer + MODEL.embedding_params()) * 4
    grads = stage_breakdowns(MODEL, TRAIN, pp, options=FSDP_OPTIONS, phase="layer")[0]["gradients"]
    assert grads == pytest.approx(unsharded, rel=1e-6)
    # after the backward: the sharded ones too
    grads = stage_breakdowns(MODEL, TRAIN, pp, options=FSDP_OPTIONS, phase="step")[0]["gradients"]
    assert grads == pytest.approx(sharded + unsharded, rel=1e-6)


def test_dtensor_tensor_parallelism_saves_the_gathered_norm_outputs() -> None:
    cfg = ParallelConfig(tp=4, pp=1, dp=2, mbs=1, global_batch=64, zero_stage=3, recompute="full")
    megatron_like = replace(FSDP_OPTIONS, tp_saves_gathered_inputs=False)
    sbh = 2048 * 1 * 1024 * 2
    # two norm outputs of the rebuilt layer in a layer's backward, whole instead of 1/t ...
    extra = _last(cfg, FSDP_OPTIONS, "layer")["activations"] - _last(cfg, megatron_like, "layer")["activations"]
    assert extra == pytest.approx(2 * sbh * (1 - 1 / 4), abs=2)
    # ... and the final norm's at the loss
    extra = _last(cfg, FSDP_OPTIONS, "loss")["activations"] - _last(cfg, megatron_like, "loss")["activations"]
    assert extra == pytest.approx(sbh * (1 - 1 / 4), abs=2)
    no_tp = replace(cfg, tp=1, dp=8)
    assert _last(no_tp, FSDP_OPTIONS)["activations"] == _last(no_tp, megatron_like)["activations"]


def test_loss_parallel_holds_four_fp32_copies_under_tensor_parallelism() -> None:
    cfg = ParallelConfig(tp=4, pp=1, dp=2, mbs=1, global_batch=64, zero_stage=3, recompute="full")
    per_rank = 1 * 2048 * 32000 / 4
    assert _last(cfg, FSDP_OPTIONS, "loss")["logits"] == int(per_rank * 4 * 4)
    assert _last(replace(cfg, tp=1, dp=8), FSDP_OPTIONS, "loss")["logits"] == int(4 * per_rank * 3 * 4)


def test_the_embeddings_backward_makes_its_whole_vocabulary_gradient_under_dtensor_tp() -> None:
    cfg = ParallelConfig(tp=4, pp=1, dp=2, mbs=1, global_batch=64, zero_stage=3, recompute="full")
    beyond_rows = 32000 * 1024 * 2 * (1 - 1 / 4)  # V x h in bf16, less the rank's own rows
    root = (2 * 32000 * 1024 / 4 + 1024) * 2  # the root unit's unsharded gradients: embedding, head, norm
    embed, step = _last(cfg, FSDP_OPTIONS, "embed"), _last(cfg, FSDP_OPTIONS, "step")
    assert embed["activations"] == embed["logits"] == 0
    assert embed["gradients"] - step["gradients"] == pytest.approx(beyond_rows + root, rel=1e-6)
    # Megatron makes only its rows' gradient, and without TP there is nothing beyond them: no such phase
    # (a phase a stage does not go through gives its heaviest)
    for options, config in ((replace(FSDP_OPTIONS, tp_embedding_grad_whole=False), cfg),
                            (FSDP_OPTIONS, replace(cfg, tp=1, dp=8))):
        assert _last(config, options, "embed") == _last(config, options)


def test_the_fragmentation_is_an_option_the_fsdp_stack_fits_on_reserved_bytes() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=64, zero_stage=3, recompute="full")
    a = _last(cfg, replace(FSDP_OPTIONS, fragmentation=1.0))
    b = _last(cfg, replace(FSDP_OPTIONS, fragmentation=1.5))
    # on the transient bytes the allocator holds over the step (pipette.memory_fsdp2.reserve): every
    # layer's kept input, the rebuilt layer, the head's and the loss's (the logits and their copies)
    loss, layer, head = (_last(cfg, FSDP_OPTIONS, ph) for ph in ("loss", "layer", "head"))
    kept = MODEL.layers * 2048 * 2 * 1024 * 2
    held = loss["activations"] + layer["activations"] - kept + loss["logits"] + head["logits"]
    assert b["overhead"] - a["overhead"] == pytest.approx(0.5 * held, abs=2)
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


LLAMA_8B_DP8 = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8, zero_stage=3, recompute="selective")


def _phases(config: ParallelConfig, model: ModelSpec = MODEL, train: TrainingSpec = TRAIN) -> dict[str, dict[str, int]]:
    from pipette.memory_fsdp2 import PHASES

    return {ph: stage_breakdowns(model, train, config, options=FSDP_OPTIONS, phase=ph)[-1] for ph in PHASES}


def test_fsdp2_gathers_the_root_for_the_head_and_two_layers_in_a_layers_backward() -> None:
    """``fully_shard(stage, reshard_after_forward=True)``: the root is resharded after the forward
    (not at the loss), gathered again for the head's backward (its all-gather output and the
    unsharded copy both alive), and held while the layers' backward gathers one layer and prefetches
    the next; the layer's reduce-scatter copies (bf16 gradient and its fp32 copy) beside them."""
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=64, zero_stage=3, recompute="selective")
    every = _phases(cfg)
    sharded = MODEL.total_params() * 4 / 8
    root = (MODEL.embedding_params() + MODEL.head_params()) * 2
    layer = MODEL.layer_params() * 2
    assert every["loss"]["weights"] == pytest.approx(sharded, rel=1e-6)
    assert every["head"]["weights"] == pytest.approx(sharded + 2 * root, rel=1e-6)
    assert every["layer"]["weights"] == pytest.approx(sharded + root + 2 * layer, rel=1e-6)
    assert every["layer"]["buffers"] == pytest.approx(MODEL.layer_params() * (2 + 4), rel=1e-6)
    assert every["loss"]["buffers"] == every["head"]["buffers"] == 0
    # without reshard_after_forward (zero_stage 2) every unit stays gathered: nothing is gathered again
    z2 = _phases(replace(cfg, zero_stage=2))
    assert z2["loss"]["weights"] == z2["head"]["weights"] == z2["layer"]["weights"] == pytest.approx(
        sharded + root + MODEL.layers * layer, rel=1e-6)


def test_the_estimate_is_its_heaviest_phase() -> None:
    for cfg in (LLAMA_8B_DP8, replace(LLAMA_8B_DP8, recompute="full", mbs=2, global_batch=16)):
        every = _phases(cfg, MODEL, TRAIN)
        assert stage_breakdowns(MODEL, TRAIN, cfg, options=FSDP_OPTIONS)[-1] == max(
            every.values(), key=lambda part: sum(part.values()) - part["overhead"])


def test_full_recomputation_rebuilds_a_layer_after_the_loss_not_beside_it() -> None:
    """Llama 3 8B, mbs 2, full recomputation (traced: the peak is the loss's backward with every
    layer's input kept, 0.125 GiB a layer, and 3 fp32 copies of the logits; no layer rebuilt yet)."""
    from pipette.model import MODEL_PRESETS

    model = MODEL_PRESETS["llama3-8b"]
    train = TrainingSpec(global_batch=16, seq_len=8192, dtype="bf16", optimizer="adamw")
    cfg = replace(LLAMA_8B_DP8, recompute="full", mbs=2, global_batch=16)
    every = _phases(cfg, model, train)
    sbh = 8192 * 2 * model.hidden * 2
    assert every["loss"]["activations"] == pytest.approx(model.layers * sbh + 2 * sbh, rel=1e-6)  # + final norm
    assert every["layer"]["activations"] > every["loss"]["activations"]  # the rebuilt layer
    assert every["loss"]["logits"] == 3 * 4 * 8192 * 2 * model.vocab
    heaviest = stage_breakdowns(model, train, cfg, options=FSDP_OPTIONS)[0]
    assert heaviest == every["loss"]


def test_an_unknown_phase_is_refused() -> None:
    from pipette.errors import SpecError

    with pytest.raises(SpecError, match="unknown phase"):
        stage_breakdowns(MODEL, TRAIN, LLAMA_8B_DP8, options=FSDP_OPTIONS, phase="warmup")


def test_op_sac_under_sequence_parallel_tp_keeps_w2s_whole_partial_sum_and_the_reduce_scatters() -> None:
    from pipette.memory import _op_sac_saved

    # per layer and micro-batch the policy saves wq, wv, w1 and w2's mm outputs, the SDPA output and the
    # reduce-scatters' (wo's, w2's); with the layer's input. w2's mm output is the whole sequence's partial
    # sum under TP (traced at Llama 3 70B tp8: 2.08 s x h x d per layer)
    sb, h, f, kv, d = 2048, 1024, 3584, 256, 2
    split = (h + h + f) / 4 + kv / 4  # wq, SDPA, w1 over t = 4; wv over min(t, kv_heads) = 4
    assert _op_sac_saved(MODEL, 2048, 1, d, 4, 4, True) == d * sb * (split + h + 2 * h / 4 + h / 4)
    # one rank: w2's output and the input, whole
    assert _op_sac_saved(MODEL, 2048, 1, d, 1, 1, True) == d * sb * (h + h + f + kv + 2 * h)
