"""Megatron-Core's memory terms (issue 46): Transformer Engine's quantized linear inputs under the FP8 /
MXFP8 / NVFP4 recipes, the fused SwiGLU, the pipeline split that counts the embedding and the loss as
layers, the allocator's reserve as a share of the live bytes, and Megatron-Bridge's recipes as run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.memory import embedding_loss_stage_layers, estimate_memory, stage_breakdowns
from pipette.memory_options import (
    GPU_OVERHEAD_BYTES,
    MEGATRON_OPTIONS,
    MEGATRON_RESERVED_SHARE,
    MXFP8_INPUT_BYTES,
    NVFP4_INPUT_BYTES,
)
from pipette.model import ModelSpec
from pipette.space import check
from pipette.stacks import get_stack
from pipette.training import TrainingSpec
from tests.benchmarks.calibration import calibration_dir, load_megatron_bridge, row_memory_options

LLAMA = ModelSpec(
    name="llama-4l", layers=4, hidden=1024, heads=8, kv_heads=2, ffn_hidden=3584, vocab=32000, max_seq=4096
)
TRAINING = TrainingSpec(global_batch=8, seq_len=4096, dtype="bf16", optimizer="adamw", zero_stages=(1,))
ONE = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8, zero_stage=1)
TOKENS, D = 4096, 2


def _activations(options: object) -> int:
    return stage_breakdowns(LLAMA, TRAINING, ONE, options=options)[0]["activations"]  # type: ignore[arg-type]


def test_the_fused_swiglu_keeps_no_silu_output() -> None:
    unfused = _activations(replace(MEGATRON_OPTIONS, fused_swiglu=False))
    assert unfused - _activations(MEGATRON_OPTIONS) == pytest.approx(
        LLAMA.layers * D * TOKENS * LLAMA.ffn_hidden, abs=4
    )


@pytest.mark.parametrize(("recipe", "q"), [("fp8", 1.0), ("mxfp8", MXFP8_INPUT_BYTES), ("nvfp4", NVFP4_INPUT_BYTES)])
def test_the_recipes_save_their_linear_inputs_quantized(recipe: str, q: float) -> None:
    # two norm outputs (h) and the down projection's input (f) at q bytes instead of 2, and a q-byte copy
    # of the attention's output for the output projection
    h, f = LLAMA.hidden, LLAMA.ffn_hidden
    per_layer = TOKENS * (2 * (D - q) * h + (D - q) * f - q * h)
    saved = _activations(MEGATRON_OPTIONS) - _activations(get_stack(f"megatron+{recipe}").memory_options)
    assert saved == pytest.approx(LLAMA.layers * per_layer, abs=8)


def test_only_per_tensor_fp8_holds_its_weights_in_one_byte() -> None:
    weights = {
        r: stage_breakdowns(LLAMA, TRAINING, ONE, options=get_stack(f"megatron+{r}").memory_options)[0]["weights"]
        for r in ("fp8", "mxfp8", "nvfp4")
    }
    bf16 = stage_breakdowns(LLAMA, TRAINING, ONE, options=MEGATRON_OPTIONS)[0]["weights"]
    assert weights["mxfp8"] == weights["nvfp4"] == bf16 > weights["fp8"]


def test_the_embedding_and_the_loss_count_as_layers_where_the_layers_alone_do_not_split() -> None:
    assert embedding_loss_stage_layers(126, 8, 4) == (15, 16, 16, 16, 16, 16, 16, 15)  # Llama 3.1 405B
    assert embedding_loss_stage_layers(80, 4, 5) is None  # 80 split evenly: no flags needed
    assert embedding_loss_stage_layers(125, 8, 4) is None  # 127 does not split either
    model = replace(LLAMA, layers=126)
    training = replace(TRAINING, global_batch=64, schedules=("interleaved",), max_virtual_stages=4)
    config = ParallelConfig(
        tp=1, pp=8, dp=1, mbs=1, global_batch=64, zero_stage=1, schedule="interleaved", virtual_stages=4
    )
    assert "interleaved_layers" in check(model, training, config, 8)
    assert "interleaved_layers" not in check(model, training, config, 8, embedding_loss_split=True)
    assert get_stack("megatron").embedding_loss_split and not get_stack("fsdp").embedding_loss_split
    stages = stage_breakdowns(model, training, config, options=MEGATRON_OPTIONS)
    assert stages[0]["weights"] > stages[1]["weights"]  # the embedding outweighs the layer it replaces here


def test_the_reserve_is_a_share_of_the_live_bytes() -> None:
    est = estimate_memory(LLAMA, TRAINING, ONE, 80 * 2**30, options=MEGATRON_OPTIONS)
    tensors = est.live_bytes
    assert est.reserved_bytes - tensors == pytest.approx(
        GPU_OVERHEAD_BYTES + MEGATRON_RESERVED_SHARE * tensors, rel=1e-6
    )


def test_megatron_bridge_rows_are_estimated_as_their_recipes_ran() -> None:
    rows = load_megatron_bridge(calibration_dir(), cp=True).rows
    assert len(rows) == 84 and sum(r.config.cp > 1 for r in rows) == 17
    options = row_memory_options(rows[0])
    # Transformer Engine's fused cross entropy and the Llama perf scripts' bf16 gradient reduction
    assert options.fused_loss and not options.bf16_fp32_grads
    assert replace(options, fused_loss=False, bf16_fp32_grads=True) == get_stack(rows[0].stack).memory_options
