"""The pipette and hf-deepspeed stacks price the fused attention at FlashAttention-2's measured rates
(``PerfConstants.flash_attention_rates``): PyTorch's SDPA runs its flash backend under Hugging Face's
models, which on an H100 reaches 14-33% of the bf16 peak forward and backward (Dao-AILab/flash-attention's
README benchmark) and 12-16% of a B200's (cudnn-frontend's timing of SDPA's flash backend; both in
data/kernels/flash_attention.csv), where the GEMM curve the attention was priced on before reaches 70-71% of
an H100's at long sequences (a 131k-token Llama 3.1 8B plan at 97% HFU)."""

from __future__ import annotations

import csv
import math
from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.efficiency import flash_attention_rate
from pipette.kernel_tables import FLASH_CAUSAL_RATE
from pipette.model import ModelSpec
from pipette.perf import PerfModel
from pipette.perf_moe import attention_width
from pipette.stacks import get_stack
from pipette.training import TrainingSpec
from tests.benchmarks import kernel_tables

H100 = DeviceSpec.preset("H100-80GB")


def test_the_rates_are_derived_from_the_carried_timings() -> None:
    with open(kernel_tables.CARRIED_FLASH, newline="") as f:
        derived = kernel_tables.causal_rates([r for r in csv.DictReader(f) if kernel_tables.kept_flash(r)])
    assert {fam: {d: tuple((s, round(x, 3)) for s, x in pts) for d, pts in by.items()}
            for fam, by in derived.items()} == FLASH_CAUSAL_RATE
    assert set(FLASH_CAUSAL_RATE) == {"a100", "h100", "b200"}
    assert set(FLASH_CAUSAL_RATE["b200"]) == {128}  # PyTorch SDPA's flash backend, 4k-131k tokens


def test_the_rate_is_read_at_the_nearest_head_size_log_interpolated_and_held_at_the_ends() -> None:
    h64, h128 = dict(FLASH_CAUSAL_RATE["h100"][64]), dict(FLASH_CAUSAL_RATE["h100"][128])
    assert flash_attention_rate(H100, 128, 4096) == pytest.approx(h128[4096])
    assert flash_attention_rate(H100, 64, 2048) == pytest.approx(h64[2048])
    assert flash_attention_rate(H100, 80, 2048) == pytest.approx(h64[2048])  # nearer 64
    assert flash_attention_rate(H100, 256, 2048) == pytest.approx(h128[2048])
    mid = flash_attention_rate(H100, 128, math.sqrt(4096 * 8192))
    assert mid == pytest.approx((h128[4096] + h128[8192]) / 2)
    assert flash_attention_rate(H100, 128, 131072) == pytest.approx(h128[16384])  # held past the last timing
    assert flash_attention_rate(H100, 128, 128) == pytest.approx(h128[512])
    assert flash_attention_rate(DeviceSpec.preset("A100-80GB"), 128, 4096) == pytest.approx(
        dict(FLASH_CAUSAL_RATE["a100"][128])[4096])
    b200 = dict(FLASH_CAUSAL_RATE["b200"][128])
    assert flash_attention_rate(DeviceSpec.preset("GB200-186GB"), 64, 65536) == pytest.approx(b200[65536])
    assert flash_attention_rate(DeviceSpec.preset("V100-32GB"), 128, 4096) is None  # none timed
    assert flash_attention_rate(DeviceSpec.preset("T4-16GB"), 128, 4096) is None
    from pipette.device import cpu_device

    assert flash_attention_rate(cpu_device(2**30), 128, 4096) is None


def _attention(stack: str, seq: int, device: str | DeviceSpec = "H100-80GB") -> tuple[float, float, float]:
    """(forward, backward, the forward's FLOPs as FlashAttention counts them) of one layer's attention."""
    from pipette.clusterfile import homogeneous_cluster

    model = ModelSpec.preset("llama3.1-8b")
    training = TrainingSpec(global_batch=8, seq_len=seq)
    config = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8, zero_stage=1, recompute="none")
    cluster = homogeneous_cluster(device, 1, 8, 450e9, 50e9)
    pm = PerfModel(model, training, config, cluster, constants=get_stack(stack).constants)
    flops = 4.0 * seq * seq * attention_width(model) * 0.5
    return pm.compute.attention[0], pm.compute.attention[1], flops


@pytest.mark.parametrize("stack", ["pipette", "hf-deepspeed"])
@pytest.mark.parametrize("seq", [4096, 32768, 131072])
def test_the_hugging_face_stacks_attend_at_flash_attention_2s_rate(stack: str, seq: int) -> None:
    fwd, bwd, flops = _attention(stack, seq)
    rate = flash_attention_rate(H100, 128, seq)
    assert rate is not None and rate <= 0.34
    assert flops / (fwd * H100.peak("bf16")) == pytest.approx(rate, rel=1e-6)
    assert bwd == pytest.approx(2.5 * fwd)  # FlashAttention's convention: the backward's FLOPs 2.5x


def test_without_it_the_attention_ran_on_the_gemm_curve_at_twice_the_kernels_rate() -> None:
    """What the change corrects: the GEMM curve put a 32k-token causal attention at over 0.6 of the peak."""
    from pipette import stacks

    before = replace(stacks.HF_DEEPSPEED.constants, flash_attention_rates=False)
    model = ModelSpec.preset("llama3.1-8b")
    training = TrainingSpec(global_batch=8, seq_len=32768)
    config = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8, zero_stage=1, recompute="none")
    from pipette.clusterfile import homogeneous_cluster

    cluster = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9)
    old = PerfModel(model, training, config, cluster, constants=before).compute.attention[0]
    new, _, flops = _attention("pipette", 32768)
    assert flops / (old * H100.peak("bf16")) > 0.6
    assert new > 2.0 * old


def test_other_stacks_and_devices_keep_their_own_attention_prices() -> None:
    """The fsdp stack keeps its fitted attention efficiency, and a device no FlashAttention-2 timing covers
    (an MI300X, say) the GEMM curve; on a B200 the Hugging Face stacks attend at SDPA's flash backend's rate."""
    fsdp_fwd, _, flops = _attention("fsdp", 32768)
    assert flops / (fsdp_fwd * H100.peak("bf16")) == pytest.approx(get_stack("fsdp").constants.attention_efficiency)
    with_rates = replace(get_stack("fsdp").constants, flash_attention_rates=True)
    assert with_rates.attention_efficiency > 0  # a fitted efficiency comes first
    b200 = DeviceSpec.preset("B200-180GB")
    fwd, _, flops = _attention("pipette", 32768, "B200-180GB")
    assert flops / (fwd * b200.peak("bf16")) == pytest.approx(flash_attention_rate(b200, 128, 32768))
    other = replace(H100, name="MI300X-192GB")
    fwd, _, flops = _attention("pipette", 32768, other)
    assert flash_attention_rate(other, 128, 32768) is None
    assert flops / (fwd * other.peak("bf16")) > 0.4  # the GEMM curve
