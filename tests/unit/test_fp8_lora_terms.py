"""megatron+fp8 as Transformer Engine runs it (issue 28, MLPerf's Llama-2-70B LoRA): FP8 weights,
a frozen linear layer's input not kept for the backward, fused casts, fused attention."""

from __future__ import annotations

from dataclasses import replace

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.memory import MEGATRON_OPTIONS, estimate_memory, stage_breakdowns
from pipette.model import ModelSpec
from pipette.perf import MEGATRON_CONSTANTS, estimate_perf
from pipette.stacks import get_stack
from pipette.training import LoraSpec, TrainingSpec

MODEL = replace(ModelSpec.preset("llama2-70b"), max_seq=8192)
LORA = TrainingSpec(global_batch=8, seq_len=8192, method="lora", lora=LoraSpec(16, 32.0))
FULL = TrainingSpec(global_batch=8, seq_len=8192)
GB = 1e9
NODE = homogeneous_cluster("H100-80GB", 1, 8, 450 * GB, 50 * GB)
MLPERF_H100 = ParallelConfig(tp=4, pp=1, dp=2, mbs=1, global_batch=8, zero_stage=1, recompute="none")


def _stage(training: TrainingSpec, **options: bool) -> dict[str, int]:
    return stage_breakdowns(MODEL, training, MLPERF_H100, options=replace(MEGATRON_OPTIONS, **options))[0]


def test_fp8_weights_hold_each_linear_weight_in_one_byte() -> None:
    bf16 = _stage(LORA, fp8_weights=False)["weights"]
    fp8 = _stage(LORA, fp8_weights=True)["weights"]
    h, kv, f, t = MODEL.hidden, MODEL.kv_dim, MODEL.ffn_hidden, MLPERF_H100.tp
    linear_per_rank = MODEL.layers * (2 * h * h + 2 * h * kv + 3 * h * f) / t  # q, o; k, v; gate, up, down
    assert abs((bf16 - fp8) - linear_per_rank * (2 - 1)) < MODEL.layers  # 1 B saved per weight (int rounding)


def test_a_frozen_linear_input_is_not_kept_under_lora() -> None:
    kept = _stage(LORA, frozen_inputs_saved=True)["activations"]
    dropped = _stage(LORA, frozen_inputs_saved=False)["activations"]
    s, h, f, t, d = 8192, MODEL.hidden, MODEL.ffn_hidden, MLPERF_H100.tp, 2
    # q, k, v, o have adapters: only the MLP norm's output (h, sequence-parallel) and down's input (f)
    per_layer = d * s * (h + f) / t
    assert abs((kept - dropped) - MODEL.layers * per_layer) < MODEL.layers
    # full training needs every input for the weight gradients: nothing changes
    full = [_stage(FULL, frozen_inputs_saved=keep)["activations"] for keep in (True, False)]
    assert full[0] == full[1]


def test_an_adapter_on_the_mlp_keeps_its_input() -> None:
    mlp = replace(LORA, lora=LoraSpec(16, 32.0, targets=("q_proj", "down_proj")))
    kept = stage_breakdowns(MODEL, mlp, MLPERF_H100, options=replace(MEGATRON_OPTIONS, frozen_inputs_saved=True))[0]
    dropped = stage_breakdowns(MODEL, mlp, MLPERF_H100, options=MEGATRON_OPTIONS)[0]
    s, h, t, d = 8192, MODEL.hidden, MLPERF_H100.tp, 2
    assert abs((kept["activations"] - dropped["activations"]) - MODEL.layers * d * s * h / t) < MODEL.layers


def test_megatron_fp8_is_transformer_engine() -> None:
    stack = get_stack("megatron+fp8")
    assert stack.memory_options.fp8_weights and not stack.memory_options.frozen_inputs_saved
    assert stack.constants.fp8_gemms and stack.constants.fp8_casts_fused and stack.constants.flash_attention
    # the bf16 stack keeps the constants it was fitted with (its packed documents attending within themselves)
    assert get_stack("megatron").constants == replace(MEGATRON_CONSTANTS, varlen_attention=True)
    # fp8 without the fsdp stack's overrides stays torchao's: casts counted
    assert not get_stack("fsdp+fp8").constants.fp8_casts_fused


def test_fused_casts_cost_nothing_and_unfused_ones_do() -> None:
    k = replace(MEGATRON_CONSTANTS, fp8_gemms=True, flash_attention=True)
    cast = estimate_perf(MODEL, LORA, MLPERF_H100, NODE, constants=k)
    fused = estimate_perf(MODEL, LORA, MLPERF_H100, NODE, constants=replace(k, fp8_casts_fused=True))
    assert fused.breakdown["compute"] < cast.breakdown["compute"]
    assert fused.breakdown["tp_comm"] == cast.breakdown["tp_comm"]


def test_mlperf_h100_layout_fits_an_h100() -> None:
    est = estimate_memory(MODEL, LORA, MLPERF_H100, NODE.min_usable_memory, stack=get_stack("megatron+fp8"))
    assert est.peak_bytes < 80 * 2**30
    # and the bf16 estimate without Transformer Engine's terms does not
    assert estimate_memory(MODEL, LORA, MLPERF_H100, NODE.min_usable_memory, stack=get_stack("megatron")).peak_bytes \
        > est.peak_bytes


def test_tp_overlap_hides_tensor_parallel_collectives_under_the_gemms() -> None:
    k = replace(MEGATRON_CONSTANTS, fp8_gemms=True, flash_attention=True, fp8_casts_fused=True)
    exposed = estimate_perf(MODEL, LORA, MLPERF_H100, NODE, constants=k)
    half = estimate_perf(MODEL, LORA, MLPERF_H100, NODE, constants=replace(k, tp_overlap=0.001))
    hidden = estimate_perf(MODEL, LORA, MLPERF_H100, NODE, constants=replace(k, tp_overlap=1.0))
    assert exposed.breakdown["tp_comm"] > half.breakdown["tp_comm"] > hidden.breakdown["tp_comm"] == 0.0
    assert hidden.breakdown["compute"] == exposed.breakdown["compute"]
    # no tensor parallelism, nothing to hide
    one = replace(MLPERF_H100, tp=1, dp=8)
    assert estimate_perf(MODEL, LORA, one, NODE, constants=replace(k, tp_overlap=1.0)).breakdown["tp_comm"] == 0.0


def test_op_sac_keeps_every_other_matmul_output_and_the_attention() -> None:
    from pipette.memory import FSDP_OPTIONS

    model = ModelSpec.preset("llama3-8b")
    train = TrainingSpec(global_batch=16, seq_len=8192)
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=16, zero_stage=3, recompute="selective")
    sb, h, kv, f, d = 2 * 8192, model.hidden, model.kv_dim, model.ffn_hidden, 2
    saved = d * sb * (4 * h + kv + f)  # input, wq, SDPA, w2; wv; w1
    rebuilt = d * sb * (2 * h + 2 * kv + 4 * f + 4 * h)  # one layer's full activations while it recomputes
    head = d * sb * 2 * h  # the final norm's input and output on the last stage
    # at the loss (FSDP2's phases, pipette.memory_fsdp2): every layer's saved outputs and the head's; in a
    # layer's backward: the saved outputs and the layer it recomputes
    for phase, expected in (("loss", model.layers * saved + head), ("layer", model.layers * saved + rebuilt)):
        sac = stage_breakdowns(model, train, cfg, options=FSDP_OPTIONS, phase=phase)[0]["activations"]
        korthikanti = stage_breakdowns(model, train, cfg, options=replace(FSDP_OPTIONS, op_sac=False),
                                       phase=phase)[0]["activations"]
        assert abs(sac - expected) < model.layers
        assert sac < korthikanti / 2


def test_fsdp2_under_pipelining_keeps_its_layers_and_gradients_unsharded() -> None:
    from pipette.memory import FSDP_OPTIONS

    model = ModelSpec.preset("llama3-8b")
    train = TrainingSpec(global_batch=16, seq_len=4096)
    flat = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=16, zero_stage=3, recompute="full")
    piped = ParallelConfig(tp=1, pp=2, dp=4, mbs=1, global_batch=16, zero_stage=3, recompute="full")
    one = stage_breakdowns(model, train, flat, options=FSDP_OPTIONS, phase="layer")[0]
    two = stage_breakdowns(model, train, piped, options=FSDP_OPTIONS, phase="step")[1]  # the last stage
    stage_layers = model.layers // 2
    layer = model.layer_params() * 2  # bf16 unsharded
    # after the backward: the sharded fp32 gradients plus every unit's unsharded gradient (synced at the
    # last micro-batch), accumulated in reduce_dtype fp32 (FSDPParam.to_accumulated_grad_if_needed): 2x the
    # bf16 layer, and the root's (the head and the final norm)
    stage_psi = stage_layers * model.layer_params() + model.head_params()
    sharded_fp32 = stage_psi * 4 / piped.dp
    assert abs(two["gradients"] - (sharded_fp32 + stage_psi * 4)) < 1e6
    # every layer of the stage stays gathered (no reshard after forward): far above two layers in flight
    assert two["weights"] >= sharded_fp32 + stage_layers * layer
    assert one["buffers"] < 6 * layer  # without pipelining: two layers in flight, one layer's reduce
