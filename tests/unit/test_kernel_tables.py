"""Kernels as the base of the step-time model (issue 45): the GEMM curves of pipette/kernel_tables.py are
what tests/benchmarks/kernel_tables.py derives from the measured timings the project carries
(data/kernels/gemm.csv), and ``PerfConstants.kernel_tables_first`` prices GEMMs on them before any fitted curve."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest

from pipette.device import DeviceSpec
from pipette.efficiency import kernel_curve
from pipette.kernel_tables import GEMM_EFFICIENCY
from pipette.perf import _curve
from pipette.perf_constants import MEGATRON_CONSTANTS
from tests.benchmarks import kernel_tables


def test_the_tables_are_derived_from_the_carried_timings() -> None:
    with open(kernel_tables.CARRIED, newline="") as f:
        rows = [r for r in csv.DictReader(f) if kernel_tables.kept(r)]
    derived = kernel_tables.points(rows)
    assert set(derived) == set(GEMM_EFFICIENCY) == {"a100", "h100", "b200"}
    for fam, pts in derived.items():
        assert [(float(f"{x:.3g}"), round(e, 3)) for x, e, _ in pts] == list(GEMM_EFFICIENCY[fam])


@pytest.mark.parametrize(("preset", "large"), [("A100-80GB", 0.74), ("H100-80GB", 0.72), ("B200-180GB", 0.48)])
def test_large_gemms_reach_what_the_kernels_measured(preset: str, large: float) -> None:
    curve = kernel_curve(DeviceSpec.preset(preset))
    assert curve is not None and float(curve(2e12)) == pytest.approx(large, abs=0.03)
    assert float(curve(1e9)) < 0.1  # a small GEMM is bound by launch and memory


def test_kernel_tables_first_come_before_the_fitted_curves_and_after_the_probe() -> None:
    h100 = DeviceSpec.preset("H100-80GB")
    k = replace(MEGATRON_CONSTANTS, kernel_tables_first=True)
    assert _curve(k, h100) == kernel_curve(h100)
    assert _curve(MEGATRON_CONSTANTS, h100) != kernel_curve(h100)  # the fitted family curve
    probed = replace(h100, efficiency=((1e9, 0.2), (1e12, 0.6)))
    assert float(_curve(k, probed)(1e12)) == pytest.approx(0.6)
    assert kernel_curve(DeviceSpec.preset("V100-32GB")) is None


def test_fused_attention_runs_at_the_measured_rates_of_its_chip() -> None:
    from pipette.efficiency import kernel_attention
    from pipette.kernel_tables import ATTENTION_EFFICIENCY

    with open(kernel_tables.CARRIED_ATTENTION, newline="") as f:
        derived = kernel_tables.attention([r for r in csv.DictReader(f) if kernel_tables.kept_attention(r)])
    assert {g: (round(fw, 3), round(bw, 3)) for g, (fw, bw, _) in derived.items()} == ATTENTION_EFFICIENCY
    gb300, gb200 = DeviceSpec.preset("GB300-288GB"), DeviceSpec.preset("GB200-186GB")
    assert kernel_attention(DeviceSpec.preset("B300-288GB")) == kernel_attention(gb300) == ATTENTION_EFFICIENCY["GB300"]
    assert kernel_attention(DeviceSpec.preset("A100-80GB")) is None

    from pipette.config import ParallelConfig
    from pipette.model import ModelSpec
    from pipette.perf import PerfModel
    from pipette.training import TrainingSpec
    from tests.benchmarks.calibration import _bridge_cluster

    model, training = ModelSpec.preset("llama3-8b"), TrainingSpec(global_batch=8, seq_len=8192)
    config = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8, zero_stage=1, recompute="none")
    k = replace(MEGATRON_CONSTANTS, flash_attention=True, kernel_tables_first=True)
    step = {g: PerfModel(model, training, config, _bridge_cluster(g, 2, 4), constants=k).step_time()
            for g in ("GB200", "GB300")}
    assert step["GB300"] < step["GB200"]  # same bf16 peak; Blackwell Ultra's attention runs 10-18% faster
    assert gb300.peak("bf16") == gb200.peak("bf16")
