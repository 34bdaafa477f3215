"""The memory estimator: its parts, and the orderings the papers predict."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.estimates import MEMORY_PARTS
from pipette.memory import (
    MEGATRON_OPTIONS,
    SAFETY_MARGIN,
    MemoryOptions,
    estimate_memory,
    stage_breakdowns,
)
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec

GiB = 1024**3
H100 = 80 * GiB
LLAMA2_7B = ModelSpec.preset("llama2-7b")
LLAMA3_8B = ModelSpec.preset("llama3-8b")
BF16_ADAM = TrainingSpec(global_batch=64, seq_len=4096, dtype="bf16", optimizer="adamw")


def cfg(**kw: int | str) -> ParallelConfig:
    base: dict[str, int | str] = {"tp": 1, "pp": 1, "dp": 1, "mbs": 1, "global_batch": 64}
    base.update(kw)
    return ParallelConfig(**base)  # type: ignore[arg-type]


def test_breakdown_sums_to_peak_on_every_kind() -> None:
    for config in (cfg(), cfg(tp=2, pp=4, dp=2, mbs=2, zero_stage=1), cfg(dp=8, zero_stage=3)):
        for kind in ("gpu", "cpu"):
            est = estimate_memory(LLAMA3_8B, BF16_ADAM, config, H100, device_kind=kind)
            assert tuple(est.breakdown) == MEMORY_PARTS
            # the breakdown is the allocator's reserve; Pipette's runner compares the device-used figure
            # (issue 46: the reserve and the bytes outside the allocator, on a GPU only)
            assert sum(est.breakdown.values()) == est.reserved_bytes
            assert est.peak_bytes == est.device_used_bytes == est.reserved_bytes + (est.outside_bytes if kind == "gpu"
                                                                                    else 0)
            assert est.capacity_bytes == H100


def test_the_estimate_gives_live_and_reserved_bytes_and_fits_on_the_reserved() -> None:
    """Two figures: the live tensors (what max_memory_allocated reports) and what the device must
    hold (the allocator's fragmentation and workspaces on top); capacity is compared with the latter."""
    for kind in ("gpu", "cpu"):
        est = estimate_memory(LLAMA3_8B, BF16_ADAM, cfg(tp=2, pp=2, dp=2, mbs=2, zero_stage=1), H100, device_kind=kind)
        tensors = sum(v for k, v in est.breakdown.items() if k != "overhead")
        assert est.live_bytes == tensors and est.reserved_bytes > est.live_bytes
        # Pipette's runner compares the device-used figure on a GPU (issue 46); a CPU rank has nothing outside
        assert est.peak_bytes == est.device_used_bytes > est.reserved_bytes if kind == "gpu" else \
            est.peak_bytes == est.reserved_bytes == est.device_used_bytes
        d = est.to_dict()
        assert (d["live_bytes"], d["reserved_bytes"], d["device_used_bytes"]) == (
            est.live_bytes, est.reserved_bytes, est.device_used_bytes)
    gpu = estimate_memory(LLAMA3_8B, BF16_ADAM, cfg(mbs=4), H100)
    capacity = (gpu.live_bytes + gpu.reserved_bytes) // 2  # the live tensors fit, the reserved bytes do not
    between = estimate_memory(LLAMA3_8B, BF16_ADAM, cfg(mbs=4), capacity)
    assert not between.fits() and between.shortfall() == between.device_used_bytes - capacity


def test_full_finetune_is_16_bytes_per_param_and_does_not_fit_one_gpu() -> None:
    fp16 = replace(BF16_ADAM, dtype="fp16")
    est = estimate_memory(LLAMA2_7B, fp16, cfg(), H100, options=MEGATRON_OPTIONS)
    state = est.breakdown["weights"] + est.breakdown["gradients"] + est.breakdown["optimizer"]
    # Mixed-precision Adam: 2 (fp16 weights) + 2 (grads) + 12 (fp32 master, m, v).
    assert abs(state - 16 * LLAMA2_7B.total_params()) <= 3
    assert not est.fits(SAFETY_MARGIN)
    assert est.shortfall(SAFETY_MARGIN) > 0


def test_megatron_bf16_keeps_an_fp32_gradient_buffer_unsharded_by_the_distributed_optimizer() -> None:
    """Megatron-LM under --bf16 accumulates and reduces gradients in fp32: 2 + 4 + 12/d bytes per
    parameter with the distributed optimizer (ZeRO-1), what SimuMax's B200 runs measured."""
    psi = LLAMA2_7B.total_params()
    for zero, dp in ((0, 1), (1, 4)):
        est = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(zero_stage=zero, dp=dp, global_batch=64), H100,
                              options=MEGATRON_OPTIONS)
        assert abs(est.breakdown["gradients"] - 4 * psi) <= 3
        assert abs(est.breakdown["optimizer"] - 12 * psi / dp) <= 3 * dp


def test_deepspeed_bf16_without_zero_holds_fp32_gradients() -> None:
    """DeepSpeed's BF16_Optimizer (bf16, ZeRO-0): 2 (bf16 weights) + 4 (fp32 gradients) + 12,
    18 bytes per parameter, as llama3.2-1b measured on an H100 (h100_single_gpu.csv)."""
    est = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(), H100)
    state = est.breakdown["weights"] + est.breakdown["gradients"] + est.breakdown["optimizer"]
    assert abs(state - 18 * LLAMA2_7B.total_params()) <= 3
    zero1 = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(zero_stage=1), H100)  # ZeRO keeps bf16 gradients
    assert zero1.breakdown["gradients"] == 2 * LLAMA2_7B.total_params()


def test_lora_fits_one_gpu_and_trains_far_less_state() -> None:
    lora = replace(BF16_ADAM, method="lora", lora=LoraSpec(rank=16))
    full = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(), H100)
    est = estimate_memory(LLAMA2_7B, lora, cfg(), H100)
    assert est.fits(SAFETY_MARGIN)
    trained = est.breakdown["gradients"] + est.breakdown["optimizer"]
    full_trained = full.breakdown["gradients"] + full.breakdown["optimizer"]
    assert trained < 0.01 * full_trained
    # The frozen base is still there, in bf16.
    assert est.breakdown["weights"] >= 2 * LLAMA2_7B.total_params()


def test_zero_stages_reduce_memory_monotonically() -> None:
    peaks = [
        estimate_memory(LLAMA3_8B, BF16_ADAM, cfg(dp=8, zero_stage=z), H100).peak_bytes
        for z in (0, 1, 2, 3)
    ]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]


def test_zero1_shards_optimizer_states_over_dp() -> None:
    z0 = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(dp=8), H100).breakdown
    z1 = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(dp=8, zero_stage=1), H100).breakdown
    assert z1["optimizer"] == pytest.approx(z0["optimizer"] / 8, rel=1e-6)
    assert z1["gradients"] == z0["gradients"] / 2  # ZeRO-0 bf16 keeps them in fp32 (BF16_Optimizer)


def test_recompute_orders_activations() -> None:
    eager = MemoryOptions(flash_attention=False)
    act = {
        mode: estimate_memory(
            LLAMA2_7B, BF16_ADAM, cfg(recompute=mode), H100, options=eager
        ).breakdown["activations"]
        for mode in ("none", "selective", "full")
    }
    assert act["full"] < act["selective"] < act["none"]


def test_flash_attention_drops_the_score_term() -> None:
    flash = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(), H100).breakdown["activations"]
    eager = estimate_memory(
        LLAMA2_7B, BF16_ADAM, cfg(), H100, options=MemoryOptions(flash_attention=False)
    ).breakdown["activations"]
    s, a, layers = BF16_ADAM.seq_len, LLAMA2_7B.heads, LLAMA2_7B.layers
    assert eager - flash == pytest.approx(layers * 2 * a * s * s, rel=1e-6)


def test_gpt_layer_matches_korthikanti() -> None:
    # sbh(34 + 5as/h) per layer without recomputation, eager attention, fp16 (eq. 2).
    gpt = ModelSpec.gpt(2048, 4, 16, max_seq=1024)
    training = TrainingSpec(global_batch=8, seq_len=1024, dtype="fp16", optimizer="adam")
    opts = MemoryOptions(flash_attention=False)
    s, b, h, a = 1024, 1, 2048, 16
    first = stage_breakdowns(gpt, training, cfg(global_batch=8, pp=4), options=opts)[0]
    # Stage 0 of 4 holds one layer for min(p, m) = 4 micro-batches.
    assert first["activations"] == pytest.approx(4 * s * b * h * (34 + 5 * a * s / h), rel=1e-9)


def test_first_1f1b_stage_holds_more_micro_batches() -> None:
    stages = stage_breakdowns(LLAMA2_7B, BF16_ADAM, cfg(pp=4))
    act = [st["activations"] for st in stages]
    # Equal layers per stage: stage i holds min(p - i, m) = 4, 3, 2 micro-batches.
    assert act[0] / act[1] == pytest.approx(4 / 3, rel=1e-6)
    assert act[1] / act[2] == pytest.approx(3 / 2, rel=1e-6)
    few = stage_breakdowns(LLAMA2_7B, BF16_ADAM, cfg(pp=4, global_batch=2))
    assert few[0]["activations"] == few[1]["activations"]  # only m = 2 micro-batches


def test_interleaved_first_stage_holds_more_than_1f1b() -> None:
    plain = stage_breakdowns(LLAMA2_7B, BF16_ADAM, cfg(pp=4))[0]["activations"]
    inter = stage_breakdowns(
        LLAMA2_7B, BF16_ADAM, cfg(pp=4, schedule="interleaved", virtual_stages=2)
    )[0]["activations"]
    assert inter > plain


def test_tensor_parallelism_shards_weights() -> None:
    one = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(), H100).breakdown["weights"]
    two = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(tp=2), H100).breakdown["weights"]
    # Norms are replicated, so a little more than half.
    assert 0.5 * one < two < 0.501 * one


def test_gqa_kv_heads_replicate_beyond_kv_heads() -> None:
    w8 = estimate_memory(LLAMA3_8B, BF16_ADAM, cfg(tp=8), H100).breakdown["weights"]
    w16 = estimate_memory(LLAMA3_8B, BF16_ADAM, cfg(tp=16), H100).breakdown["weights"]
    assert w8 / 2 < w16 < w8


def test_last_stage_with_logits_can_be_heaviest() -> None:
    big_vocab = TrainingSpec(global_batch=64, seq_len=8192, dtype="bf16", optimizer="adamw")
    est = estimate_memory(LLAMA3_8B, big_vocab, cfg(pp=2, mbs=8, global_batch=8), H100)
    stages = stage_breakdowns(LLAMA3_8B, big_vocab, cfg(pp=2, mbs=8, global_batch=8))
    assert est.stage == 1 and stages[1]["logits"] > 0 and stages[0]["logits"] == 0
    assert est.reserved_bytes == max(sum(st.values()) for st in stages)


def test_cpu_kind_uses_process_overhead() -> None:
    tiny = ModelSpec.preset("tiny-llama")
    training = TrainingSpec(global_batch=8, seq_len=128, dtype="fp32", optimizer="adamw")
    gpu = estimate_memory(tiny, training, cfg(global_batch=8), GiB)
    cpu = estimate_memory(tiny, training, cfg(global_batch=8), GiB, device_kind="cpu")
    assert cpu.breakdown["overhead"] != gpu.breakdown["overhead"]
    # fp32 training: no master copy, Adam m and v only.
    assert cpu.breakdown["optimizer"] == pytest.approx(8 * tiny.total_params(), abs=2)


def test_bad_inputs_raise_spec_errors() -> None:
    with pytest.raises(SpecError) as e:
        estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(), H100, device_kind="tpu")
    assert e.value.field == "device.kind"
    with pytest.raises(SpecError):
        estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(), 0)
    with pytest.raises(SpecError):
        stage_breakdowns(LLAMA2_7B, BF16_ADAM, cfg(pp=2), options=MemoryOptions(stage_layers=(1, 2)))


def test_nanotron_balances_its_stages_by_compute_cost_with_the_lm_head_as_a_block() -> None:
    """nanotron's split (``get_block_compute_costs``): the LM head counts as a block, so the last
    stage gets fewer layers than the even split and the first, which holds the most micro-batches
    under 1F1B, more; its memory estimate follows the split it names."""
    from pipette.memory import NANOTRON_OPTIONS, compute_balanced_stage_layers, stage_breakdowns

    model = ModelSpec.preset("llama3-8b")
    for pp in (2, 4, 8):
        layers = compute_balanced_stage_layers(model, pp)
        assert sum(layers) == model.layers and len(layers) == pp
        assert layers[-1] < model.layers // pp <= layers[0]
    assert compute_balanced_stage_layers(model, 1) == (model.layers,)
    assert compute_balanced_stage_layers(model, 4) == (9, 9, 8, 6)
    config = cfg(pp=4, dp=2, mbs=1, zero_stage=1, global_batch=64)
    uniform = stage_breakdowns(model, BF16_ADAM, config, options=replace(NANOTRON_OPTIONS, stage_balance="uniform"))
    balanced = stage_breakdowns(model, BF16_ADAM, config, options=NANOTRON_OPTIONS)
    assert balanced[0]["activations"] == uniform[0]["activations"] * 9 // 8 or \
        abs(balanced[0]["activations"] / uniform[0]["activations"] - 9 / 8) < 1e-6
    with pytest.raises(SpecError) as e:
        replace(NANOTRON_OPTIONS, stage_balance="by-memory")
    assert e.value.field == "options.stage_balance" and "uniform, compute" in str(e.value.fix)


def test_nanotron_keeps_fp32_gradients_unsharded_and_shards_its_master_copy_under_zero1() -> None:
    """nanotron's FP32GradientAccumulator: fp32 gradient buffers for every parameter whatever the
    ZeRO stage, the fp32 master copy sharded with ZeRO-1: 2 + 4 + 12/d bytes per parameter;
    DDP's buckets copy every gradient under ZeRO-0."""
    from pipette.memory import NANOTRON_OPTIONS

    psi = LLAMA2_7B.total_params()
    est = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(zero_stage=1, dp=4, global_batch=64), H100,
                          options=NANOTRON_OPTIONS)
    assert abs(est.breakdown["gradients"] - 4 * psi) <= 3 and abs(est.breakdown["optimizer"] - 12 * psi / 4) <= 12
    assert est.breakdown["buffers"] == 0
    zero0 = estimate_memory(LLAMA2_7B, BF16_ADAM, cfg(zero_stage=0, dp=4, global_batch=64), H100,
                            options=NANOTRON_OPTIONS)
    assert zero0.breakdown["buffers"] == zero0.breakdown["gradients"]  # every gradient copied once
