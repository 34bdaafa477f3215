"""PyTorch's SDPA under the Hugging Face models of the pipette and hf-deepspeed stacks: on the lent GPU
its causal forward + backward at head size 128 runs within a band of the FlashAttention-2 rate the step
time prices it at (``pipette.efficiency.flash_attention_rate``), and far below the GEMM curve the
attention was priced on before (issue 48: a 131k-token plan at 97% HFU). The measured rates are printed
for docs/results.md, "GPU runs"."""

from __future__ import annotations

import pytest
import torch

from pipette.device import DeviceSpec
from pipette.efficiency import flash_attention_rate

#: a token of the GPU's name -> the preset whose peak and family the rate is read for (H100 by default)
_PRESETS = (("GB200", "GB200-186GB"), ("B200", "B200-180GB"), ("H200", "H200-141GB"), ("A100", "A100-80GB"))


def _device() -> DeviceSpec:
    name = torch.cuda.get_device_name(0).upper()
    return DeviceSpec.preset(next((preset for token, preset in _PRESETS if token in name), "H100-80GB"))


def _sdpa_rate(seq: int, heads: int = 16, head_dim: int = 128, tokens: int = 16384) -> float:
    """Causal forward + backward TFLOP/s as FlashAttention counts them (forward 2 b h s^2 (2 d) / 2,
    backward 2.5x), with the batch of FlashAttention's README benchmark (16k tokens)."""
    b = max(1, tokens // seq)
    q, k, v = (torch.randn(b, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        step()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    forward = 4.0 * b * heads * seq * seq * head_dim / 2.0
    return 3.5 * forward / seconds


@pytest.mark.parametrize("seq", [4096, 16384])
def test_sdpa_runs_near_the_flash_attention_rate_the_step_time_prices(seq: int) -> None:
    device = _device()
    measured = _sdpa_rate(seq) / device.peak("bf16")
    priced = flash_attention_rate(device, 128, seq)
    print(f"{torch.cuda.get_device_name(0)} SDPA causal fwd+bwd, head 128, seq {seq}: {measured:.3f} of the bf16 peak "
          f"(priced {priced:.3f})")
    assert priced is not None
    assert 0.5 * priced < measured < 2.0 * priced
    assert measured < 0.6  # not the GEMM curve's 0.7
