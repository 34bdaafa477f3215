"""A power-capped part's attention rate (issue 48): ``DeviceSpec.attention_flops`` prices the fused
attention kernel apart from the tensor-core peaks the GEMMs run at; torchtitan's 500 W H100s keep it at
the uncapped bf16 peak (tests/benchmarks/calibration.py, ``h100_96gb``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.perf import PerfModel
from pipette.stacks import get_stack
from pipette.training import TrainingSpec
from tests.benchmarks.calibration import h100_96gb, stack_cluster


def test_the_attention_rate_round_trips_and_is_left_out_when_unset() -> None:
    capped = h100_96gb(0.7)
    assert capped.attention_flops == 989e12 and capped.peak("bf16") == pytest.approx(0.7 * 989e12)
    assert DeviceSpec.from_dict(capped.to_dict()) == capped
    plain = DeviceSpec.preset("H100-80GB")
    assert "attention_flops" not in plain.to_dict() and DeviceSpec.from_dict(plain.to_dict()) == plain
    with pytest.raises(SpecError, match="attention FLOP/s"):
        replace(plain, attention_flops=0.0)


def test_only_the_fused_attention_runs_at_it() -> None:
    """Llama 3.1 8B at 32k tokens on 8 capped H100s: with the attention at the uncapped peak the fused
    kernel's time is the capped one's x the cap, and nothing else moves."""
    model = ModelSpec.preset("llama3-8b")
    training = TrainingSpec(global_batch=8, seq_len=32768)
    config = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8, zero_stage=3, recompute="full")
    k = get_stack("fsdp").constants
    share = 0.7
    capped = h100_96gb(share)

    def model_on(device: DeviceSpec) -> PerfModel:
        return PerfModel(model, training, config, stack_cluster("H100-96GB-HBM2e", 1, 8, device), constants=k)

    fast, slow = model_on(capped), model_on(replace(capped, attention_flops=None))
    assert fast.compute.attention[0] == pytest.approx(slow.compute.attention[0] * share)
    assert fast.compute.attention[1] == pytest.approx(slow.compute.attention[1] * share)
    layers = model.layers
    gap = slow.compute.forward[0] - fast.compute.forward[0]
    assert gap == pytest.approx(layers * (slow.compute.attention[0] - fast.compute.attention[0]))
