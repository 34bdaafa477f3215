"""The memory-pressure stall (pipette.perf.MemoryPressure, the megatron stack's ``alloc-pressure``
option): priced only where asked for, so every other stack predicts exactly as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.memory import MEGATRON_OPTIONS, estimate_memory
from pipette.model import ModelSpec
from pipette.perf import MEGATRON_CONSTANTS, MemoryPressure, PerfModel
from pipette.stacks import MEGATRON, MEGATRON_PRESSURE, STACKS, get_stack
from pipette.training import TrainingSpec

MODEL = ModelSpec.preset("llama3.1-8b")
TRAINING = TrainingSpec(global_batch=256, seq_len=4096, dtype="bf16", optimizer="adamw", recompute=("none",))
NODE = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9)
#: Ultra-Scale's 8B one-node pipeline near capacity (71.5 GB measured): tp1 pp2 dp4 mbs1
NEAR = ParallelConfig(tp=1, pp=2, dp=4, mbs=1, global_batch=256, zero_stage=1, recompute="none")
#: the same node far from capacity: tp8, 16 micro-batches of 2
FAR = ParallelConfig(tp=8, pp=1, dp=1, mbs=2, global_batch=256, zero_stage=1, recompute="none")


def test_the_stall_is_zero_below_onset_linear_above_and_capped() -> None:
    mp = MemoryPressure(stall_s=2.0, onset=0.5, options=MEGATRON_OPTIONS)
    assert mp.stall(40.0, 100.0) == 0.0 and mp.stall(50.0, 100.0) == 0.0
    assert mp.stall(75.0, 100.0) == pytest.approx(1.0)
    assert mp.stall(100.0, 100.0) == pytest.approx(2.0) and mp.stall(130.0, 100.0) == pytest.approx(2.0)
    assert MemoryPressure(0.0, 0.5, MEGATRON_OPTIONS).stall(99.0, 100.0) == 0.0


def test_no_stack_prices_it_by_default() -> None:
    for stack in STACKS.values():
        assert stack.constants.memory_pressure is None, stack.name
        for option in stack.available_options:
            if option != "alloc-pressure":
                assert get_stack(f"{stack.name}+{option}").constants.memory_pressure is None
    assert MEGATRON.constants == replace(MEGATRON_CONSTANTS, varlen_attention=True)
    for cfg in (NEAR, FAR):
        pm = PerfModel(MODEL, TRAINING, cfg, NODE, constants=MEGATRON.constants)
        assert pm.pressure_stall == 0.0


def test_the_option_is_the_megatron_stacks_only() -> None:
    stack = get_stack("megatron+alloc-pressure")
    assert stack.options == ("alloc-pressure",) and stack.options_note is None  # priced
    assert stack.constants.memory_pressure == MEGATRON_PRESSURE
    for name in ("pipette", "hf-deepspeed", "fsdp"):
        with pytest.raises(SpecError):
            get_stack(f"{name}+alloc-pressure")
    # under fp8 the stall is priced on the fp8 memory estimate (FP8 weights)
    both = get_stack("megatron+alloc-pressure+fp8")
    assert both.constants.memory_pressure is not None and both.constants.fp8_gemms
    assert both.constants.memory_pressure.options == both.memory_options
    assert both.memory_options.fp8_weights


def test_it_adds_one_stall_per_pipeline_slot_near_capacity_and_nothing_far_from_it() -> None:
    k = get_stack("megatron+alloc-pressure").constants
    capacity = NODE.min_usable_memory
    near = estimate_memory(MODEL, TRAINING, NEAR, capacity, options=MEGATRON_OPTIONS)
    assert near.peak_bytes / capacity > MEGATRON_PRESSURE.onset
    stall = MEGATRON_PRESSURE.stall(near.peak_bytes, capacity)
    assert stall > 0
    base = PerfModel(MODEL, TRAINING, NEAR, NODE, constants=MEGATRON.constants).step_time()
    with_stall = PerfModel(MODEL, TRAINING, NEAR, NODE, constants=k).step_time()
    m, p = NEAR.grad_accum, NEAR.pp
    assert with_stall - base == pytest.approx((m + p - 1) * stall, rel=1e-9)  # 1F1B: (m + p - 1) slots
    far = estimate_memory(MODEL, TRAINING, FAR, capacity, options=MEGATRON_OPTIONS)
    assert far.peak_bytes / capacity < MEGATRON_PRESSURE.onset
    assert (PerfModel(MODEL, TRAINING, FAR, NODE, constants=k).step_time()
            == PerfModel(MODEL, TRAINING, FAR, NODE, constants=MEGATRON.constants).step_time())


def test_the_estimate_breakdown_keeps_its_parts() -> None:
    k = replace(MEGATRON_CONSTANTS, memory_pressure=MEGATRON_PRESSURE)
    est = PerfModel(MODEL, TRAINING, NEAR, NODE, constants=k).estimate()
    assert est.step_time == pytest.approx(sum(est.breakdown.values()))
