"""The Megatron family from Megatron-Bridge's runs (issue 45): the loader of megatron_bridge_moe_dense.csv,
the recipes as options of the megatron stack (fp8 per-tensor, mxfp8, nvfp4 at the FP4 peak), and what
LoRA changes in a step: frozen base weights get no weight-gradient GEMM (the backward is one GEMM a
linear layer, not two) and the rank-16 adapters are thin GEMMs priced on the roofline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.errors import SpecError
from pipette.kernel_tables import ATTENTION_EFFICIENCY
from pipette.perf import PerfModel, tensor_rate_share
from pipette.perf_compute import _attention_times, _linear_times
from pipette.stacks import MEGATRON_NVFP4_EFFICIENCY, get_stack
from tests.benchmarks.calibration import calibration_dir, load_megatron_bridge

BRIDGE = load_megatron_bridge(calibration_dir())


def test_the_dense_rows_load_with_their_skips_counted() -> None:
    assert len(BRIDGE.rows) == 67
    assert BRIDGE.skipped["MoE (no shape in the set)"] == 71 and BRIDGE.skipped["context parallel (cp>1)"] == 17
    assert {r.stack for r in BRIDGE.rows} == {"megatron+fp8", "megatron+mxfp8", "megatron+nvfp4"}
    lora = [r for r in BRIDGE.rows if r.training.method == "lora"]
    assert len(lora) == 5 and all(r.training.lora is not None and len(r.training.lora.targets) == 7 for r in lora)
    assert {r.cluster.device_spec.name for r in BRIDGE.rows} == {"H100-80GB", "B200-180GB", "GB200-186GB",
                                                                "GB300-288GB"}


def _compute(row, constants) -> float:  # type: ignore[no-untyped-def]
    return PerfModel(row.model, row.training, row.config, row.cluster, constants=constants).estimate().breakdown[
        "compute"]


def test_a_lora_step_is_forward_plus_data_gradient_with_adapters_on_the_roofline() -> None:
    row = next(r for r in BRIDGE.rows
               if r.training.method == "lora" and "GB300" in r.row_id and r.stack.endswith("fp8"))
    row = replace(row, training=replace(row.training, document_len=None))  # one document a sequence, as counted
    full = replace(row, training=replace(row.training, method="full", lora=None))
    k = get_stack(row.stack).constants
    # full: forward + data and weight gradients (3 GEMMs a linear layer); LoRA: forward + data gradient (2);
    # attention's backward and the elementwise passes stay whole, and the adapters read and write T x h
    # activations: 0.78 of the full step on the roofline, 0.88 with the adapters on the GEMM curve
    assert 0.70 < _compute(row, k) / _compute(full, k) < 0.80
    assert _compute(row, replace(k, thin_gemm_roofline=False)) / _compute(full, k) > 0.85


def test_recipes_are_options_of_the_megatron_stack() -> None:
    fp8, mx, fp4 = (get_stack(f"megatron+{o}").constants for o in ("fp8", "mxfp8", "nvfp4"))
    assert fp8.fp8_gemms and mx.fp8_gemms and fp4.fp8_gemms
    # NVFP4's efficiency is its speedup over the FP8 tensor rate, not a share of the FP4 data-sheet peak
    assert fp4.low_precision_peak == mx.low_precision_peak == fp8.low_precision_peak == "fp8"
    assert fp4.fp8_efficiency == MEGATRON_NVFP4_EFFICIENCY > 1.0
    row = next(r for r in BRIDGE.rows if r.stack == "megatron+nvfp4" and "GB300" in r.row_id)
    assert _compute(row, fp4) < 0.8 * _compute(row, fp8)
    with pytest.raises(SpecError, match="two FP8 recipes"):
        get_stack("megatron+fp8+nvfp4")


def _linear_and_attention(row, constants) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    pm = PerfModel(row.model, row.training, row.config, row.cluster, constants=constants)
    t = float(row.config.mbs * row.training.seq_len)
    lin = sum(_linear_times(pm.kernels, row.model, row.training, t))
    return lin, sum(_attention_times(pm.kernels, row.model, t, pm.kv_seq))


def test_a_tensor_rate_share_scales_the_gemms_of_its_gpu_only_and_not_the_measured_attention() -> None:
    gb300 = next(r for r in BRIDGE.rows if r.stack == "megatron+fp8" and "GB300" in r.row_id)
    gb200 = next(r for r in BRIDGE.rows if r.stack == "megatron+fp8" and "GB200" in r.row_id)
    k = replace(get_stack("megatron+fp8").constants, tensor_rate_shares=())
    doubled = replace(k, tensor_rate_shares=(("GB300", 2.0),))
    lin, attn = _linear_and_attention(gb300, k)
    lin2, attn2 = _linear_and_attention(gb300, doubled)
    # GEMMs at twice the rate (at the same curve position: the curve is read at a size scaled by the peaks)
    assert lin2 == pytest.approx(lin / 2.0, rel=0.05) and attn2 == pytest.approx(attn)
    assert _linear_and_attention(gb200, doubled) == pytest.approx(_linear_and_attention(gb200, k))
    assert tensor_rate_share(doubled, gb300.cluster.device_spec) == 2.0
    assert tensor_rate_share(doubled, gb200.cluster.device_spec) == 1.0


def test_the_megatron_core_recipes_price_attention_at_cudnns_measured_rates() -> None:
    # GB200 and GB300 have the same BF16 data-sheet peak; cuDNN's fused attention runs faster on GB300
    # (Blackwell Ultra's softmax exponentials), which the GEMM curve at equal peaks could not say
    k = replace(get_stack("megatron+fp8").constants, tensor_rate_shares=())
    rows = {gpu: next(r for r in BRIDGE.rows if r.model.name == "llama3_8b" and r.stack == "megatron+fp8"
                      and gpu in r.row_id) for gpu in ("GB200", "GB300")}
    attn = {gpu: _linear_and_attention(row, k)[1] for gpu, row in rows.items()}
    fwd200, bwd200 = ATTENTION_EFFICIENCY["GB200"]
    fwd300, bwd300 = ATTENTION_EFFICIENCY["GB300"]
    # the forward's FLOPs F at rate f, the backward's 2.5 F at rate b: time ∝ 1/f + 2.5/b
    expected = (1 / fwd300 + 2.5 / bwd300) / (1 / fwd200 + 2.5 / bwd200)
    assert attn["GB300"] / attn["GB200"] == pytest.approx(expected)
    curve = replace(k, measured_attention=False)
    on_curve = [_linear_and_attention(row, curve)[1] for row in rows.values()]
    assert on_curve[0] == pytest.approx(on_curve[1])
