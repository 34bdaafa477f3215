"""Megatron-Core's memory terms on a model with experts (issue 46): the routed and shared experts stored as
the dense MLP is (Transformer Engine's quantized linear inputs, the fused SwiGLU), the recompute modules a
Megatron-Bridge recipe names (``mla_up_proj``, ``moe_act``, ``mlp``), the precision-aware optimizer's bf16
moments, and DeepSeek-V3's own pipeline layout: Megatron-Bridge's MoE rows, every one of which ran, kept."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.memory import estimate_memory, stage_breakdowns
from pipette.memory_moe import MlpSaving, layer_mlp_activations, routed_tokens
from pipette.memory_options import MEGATRON_OPTIONS, MXFP8_INPUT_BYTES
from pipette.model import MODEL_PRESETS
from pipette.stacks import get_stack
from pipette.training import TrainingSpec
from tests.benchmarks.calibration import BRIDGE_FUSED_LOSS, calibration_dir, row_memory_options
from tests.benchmarks.fits_boundary import rule_breaks
from tests.benchmarks.moe_rows import bridge_moe_memory, load_bridge_moe

QWEN = MODEL_PRESETS["qwen3-30b-a3b"]
DEEPSEEK = MODEL_PRESETS["deepseek-v3"]
TRAINING = TrainingSpec(global_batch=64, seq_len=4096, dtype="bf16", optimizer="adamw", zero_stages=(1,))
EP8 = ParallelConfig(tp=1, pp=1, dp=8, ep=8, etp=1, mbs=1, global_batch=64, zero_stage=1)
D = 2


def test_the_experts_keep_quantized_inputs_and_no_silu_output() -> None:
    moe = QWEN.moe
    assert moe is not None
    h, f = QWEN.hidden, moe.expert_ffn
    copies = routed_tokens(moe, 4096.0)
    q = MXFP8_INPUT_BYTES
    _, bf16, _ = layer_mlp_activations(QWEN, EP8, 4096, D)
    _, te, _ = layer_mlp_activations(QWEN, EP8, 4096, D, MlpSaving(fused_swiglu=True, input_bytes=q))
    # per token copy: fc1's input and the down projection's input at q bytes, no SiLU output
    assert bf16 - te == pytest.approx(copies * ((D - q) * h + D * f + (D - q) * f))
    _, act, _ = layer_mlp_activations(QWEN, EP8, 4096, D, MlpSaving(fused_swiglu=True, recompute=("moe_act",)))
    _, fused, _ = layer_mlp_activations(QWEN, EP8, 4096, D, MlpSaving(fused_swiglu=True))
    assert fused - act == pytest.approx(copies * D * f)  # bf16: the activation's output is rebuilt


def test_recompute_modules_drop_mla_up_projections_and_whole_moe_layers() -> None:
    config = ParallelConfig(tp=1, pp=1, dp=64, ep=64, etp=1, mbs=1, global_batch=64, zero_stage=1)
    small = replace(DEEPSEEK, layers=4)
    base = stage_breakdowns(small, TRAINING, config, options=MEGATRON_OPTIONS)[0]
    up = stage_breakdowns(
        small, TRAINING, config, options=replace(MEGATRON_OPTIONS, recompute_modules=("mla_up_proj",))
    )[0]
    mla = DEEPSEEK.attention.mla  # type: ignore[union-attr]
    assert mla is not None
    per_layer = D * 4096 * DEEPSEEK.heads * (mla.qk_head_dim * 2 + mla.v_head_dim)  # q, k and v up-projected
    assert base["activations"] - up["activations"] == pytest.approx(4 * per_layer, rel=1e-6)
    mlp = stage_breakdowns(small, TRAINING, config, options=replace(MEGATRON_OPTIONS, recompute_modules=("mlp",)))[0]
    # DeepSeek-V3's first 3 layers are dense: 3 dense MLPs and 1 MoE layer's kept no more; one MoE layer's
    # rebuilt at a time
    dense, sparse, _ = layer_mlp_activations(small, config, 4096, D, MlpSaving(fused_swiglu=True))
    assert base["activations"] - mlp["activations"] == pytest.approx(3 * dense + sparse, rel=1e-6)
    assert mlp["buffers"] - base["buffers"] == pytest.approx(sparse, rel=1e-6)


def test_bf16_moments_halve_adam_s_state() -> None:
    fp32 = stage_breakdowns(QWEN, TRAINING, EP8, options=MEGATRON_OPTIONS)[0]["optimizer"]
    bf16 = stage_breakdowns(QWEN, TRAINING, EP8, options=replace(MEGATRON_OPTIONS, optimizer_moment_bytes=4))[0]
    # master 4 + moments 8 -> master 4 + moments 4 bytes per parameter
    assert bf16["optimizer"] == pytest.approx(fp32 * 8 / 12, rel=1e-6)


def test_each_deepseek_row_runs_its_recipe_s_layout_and_recompute_modules() -> None:
    rows = {r.row_id: r for r in load_bridge_moe(calibration_dir()).rows}
    gb300 = dict(bridge_moe_memory(rows["mb:26.04.01:DGX-GB300:DeepSeekV3:MXFP8:pretrain:main"]))  # pp 2 x vp 8
    assert gb300["stage_layers"] == (32, 29) and gb300["recompute_modules"] == ("mla_up_proj",)
    assert gb300["optimizer_moment_bytes"] == 4 and gb300["bf16_fp32_grads"] is False
    graphed = dict(bridge_moe_memory(rows["mb:26.08:DGX-GB300:DeepSeekV3:MXFP8:pretrain:main"]))
    assert graphed["recompute_modules"] == ()
    h100 = dict(bridge_moe_memory(rows["mb:25.09:DGX-H100:DeepSeekV3 (dropless):FP8-CS:pretrain:main"]))
    assert h100["recompute_modules"] == ("mla_up_proj", "mlp") and sum(h100["stage_layers"]) == 61  # type: ignore
    qwen = dict(bridge_moe_memory(rows["mb:26.08:DGX-GB200:Qwen3_30B_a3B:MXFP8:pretrain:main"]))
    assert qwen == {"bf16_fp32_grads": False}


def test_bridge_moe_rows_that_ran_are_kept() -> None:
    """Every MoE row ran: none below the keep threshold of the megatron prior, none refused by a rule (the old
    estimate dropped 23 of 29: 21 by the chance to fit, 11 by the even-split rule)."""
    rows = [replace(r, fused_loss=BRIDGE_FUSED_LOSS) for r in load_bridge_moe(calibration_dir()).rows]
    assert len(rows) == 30  # one per layout and recipe, B300 included (tests/benchmarks/moe_rows.py, load_bridge_moe)
    for r in rows:
        prior = get_stack(r.stack).gpu_fits_prior
        est = estimate_memory(r.model, r.training, r.config, r.cluster.min_usable_memory, options=row_memory_options(r))
        assert prior.chance_to_fit(est, r.cluster.min_usable_memory) >= 0.02, r.row_id
        assert rule_breaks(r) == [], r.row_id
    # Qwen3-30B-A3B at micro-batch 4 on GB200 (MXFP8): 1.09 of the device before, now under it
    qwen = next(r for r in rows if r.row_id == "mb:26.08:DGX-GB200:Qwen3_30B_a3B:MXFP8:pretrain:main")
    est = estimate_memory(
        qwen.model, qwen.training, qwen.config, qwen.cluster.min_usable_memory, options=row_memory_options(qwen)
    )
    assert est.peak_bytes < 0.95 * qwen.cluster.min_usable_memory
