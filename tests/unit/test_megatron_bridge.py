"""The Megatron family from Megatron-Bridge's runs (issue 45): the loader of megatron_bridge_moe_dense.csv,
the recipes as options of the megatron stack (fp8 per-tensor, mxfp8, nvfp4 at the FP4 peak), and what
LoRA changes in a step: frozen base weights get no weight-gradient GEMM (the backward is one GEMM a
linear layer, not two) and the rank-16 adapters are thin GEMMs priced on the roofline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.errors import SpecError
from pipette.perf import PerfModel
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
    assert fp4.low_precision_peak == "fp4" and fp4.fp8_efficiency == MEGATRON_NVFP4_EFFICIENCY
    assert mx.low_precision_peak == fp8.low_precision_peak == "fp8"
    row = next(r for r in BRIDGE.rows if r.stack == "megatron+nvfp4" and "GB300" in r.row_id)
    assert _compute(row, fp4) < 0.8 * _compute(row, fp8)  # 15 PFLOP/s of FP4 against 5 of FP8
    with pytest.raises(SpecError, match="two FP8 recipes"):
        get_stack("megatron+fp8+nvfp4")
