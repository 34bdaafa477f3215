"""Achieved fraction of a device's peak FLOP/s as a function of the GEMM size.

A matmul reaches its peak only when it is large enough to fill every streaming
multiprocessor and hide its memory traffic; small GEMMs are latency- and bandwidth-bound.
We use a saturating (Michaelis-Menten / roofline-knee) curve in the FLOPs of one GEMM
``x``, as in the compute models of vTrain (Bang et al. 2024, sec. 4.2, profiled
per-operator throughput) and Calculon (Isaev et al. 2023, sec. 3.2, efficiency tables):

    eff(x) = eff_max * r / (1 + r),   r = (x / x_half) ** n

(a Hill curve; ``n = 1`` is the plain hyperbola)
``eff_max`` is the fraction of the data-sheet peak that large GEMMs reach and ``x_half``
the GEMM size at which half of it is reached. Both are physical properties of a device
family. When the device probe has measured points (``DeviceSpec.efficiency``), those are
used instead, interpolated in log(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipette.device import DeviceSpec

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class EfficiencyCurve:
    """``eff(x) = max_fraction * r / (1 + r)``, ``r = (x / half_flops) ** steepness``,
    or measured points when given."""

    max_fraction: float
    half_flops: float
    steepness: float = 1.0
    points: tuple[tuple[float, float], ...] = ()

    def __call__(self, gemm_flops: float | FloatArray) -> FloatArray:
        x = np.maximum(np.asarray(gemm_flops, dtype=np.float64), 1.0)
        if len(self.points) >= 2:
            pts = sorted(self.points)
            xs = np.log([max(p[0], 1.0) for p in pts])
            ys = np.array([p[1] for p in pts], dtype=np.float64)
            return np.asarray(np.clip(np.interp(np.log(x), xs, ys), 1e-3, 1.0), dtype=np.float64)
        if len(self.points) == 1:
            return np.full_like(x, float(np.clip(self.points[0][1], 1e-3, 1.0)))
        r = (x / self.half_flops) ** self.steepness
        return np.asarray(self.max_fraction * r / (1.0 + r), dtype=np.float64)


# ---- fitted constants --------------------------------------------------------------
# Fitted with scipy.optimize.least_squares on log(predicted/measured) step times by
# tests/benchmarks/accuracy.py --fit. A100 figures: the vTrain A100 set (Bang et al. 2024,
# Megatron-DeepSpeed, fp16). H100 figures: the Ultra-Scale Playbook H100 set (nanotron,
# bf16). They differ per family because the achieved fraction of the tensor-core peak and
# the size needed to fill the SMs are properties of the chip (108 SMs vs 132 SMs, HBM2e vs
# HBM3), which is why the constant is per family.
A100_MAX_FRACTION = 0.710  # vTrain A100 set
A100_HALF_FLOPS = 1.27e10  # vTrain A100 set
H100_MAX_FRACTION = 0.672  # Ultra-Scale H100 set (healthy rows)
H100_HALF_FLOPS = 5.06e10  # Ultra-Scale H100 set (healthy rows)
# Hill exponent of the curve, shared by the families (both sets).
STEEPNESS = 1.20
# B200 (HGX B200, 148 SMs, 2.25 PFLOP/s dense bf16 from the data sheet: DeviceSpec preset). No
# GEMM of ours was timed on one: fitted (tests/benchmarks/stack_fit.py, the megatron stack with
# its vTrain + Ultra-Scale constants) on SimuMax's Megatron-LM llama3-70b-l12 runs on 8x B200
# (simumax_b200_megatron.csv) and checked on its llama3-405b-l4 and llama3-70b-l8 runs.
B200_MAX_FRACTION = 0.488  # SimuMax llama3-70b-l12 (Megatron-LM, bf16)
B200_HALF_FLOPS = 5.50e10  # SimuMax llama3-70b-l12
# GPUs of no calibrated family: the A100 curve, the best-documented one, is the neutral default.
DEFAULT_MAX_FRACTION = A100_MAX_FRACTION
DEFAULT_HALF_FLOPS = A100_HALF_FLOPS
# CPU workers before the probe has measured them (a cluster file's ``preset: cpu``): a core
# fills its vector units with a far smaller GEMM than a GPU its SMs, so the GPU curve put a CPU
# step thousands of times too slow. Fitted (least squares on the log) to one thread's fp32
# torch.matmul of n^3 squares, n = 8-1024 (tests/benchmarks/cpu_gemm.py): half of the best rate
# at 1.8e5 FLOPs (a 45^3 GEMM). The runs: docs/results.md, "CPU GEMM efficiency".
CPU_MAX_FRACTION = 0.980
CPU_HALF_FLOPS = 1.84e5
CPU_STEEPNESS = 0.96


#: bf16 matmul throughput of one H100 80GB HBM3 as the probe measured it (workers.rank.probe,
#: CUDA events; the run: tests/benchmarks/results/h100-2026-11-23/probe.json): (FLOPs of one
#: GEMM, fraction of the 989 TFLOP/s data-sheet peak), at 1024^3, 2048^3, 4096^3 (twice),
#: 4096 x 4096 x 14336 and 8192^3. Small GEMMs are bound by the ~10 us a kernel takes at least.
H100_MEASURED_BF16: tuple[tuple[float, float], ...] = (
    (2.147e9, 0.148), (1.718e10, 0.708), (1.374e11, 0.694), (4.810e11, 0.725), (1.100e12, 0.710),
)


def family(device: DeviceSpec) -> str:
    """The calibrated device family: ``a100``, ``h100`` (H100 and H200: same SMs), ``b200`` (B200, GB200,
    B300, GB300), ``cpu`` or ``other``."""
    if device.kind == "cpu":
        return "cpu"
    if device.kind != "gpu":
        return "other"
    name = device.name.upper()
    if "A100" in name:
        return "a100"
    if "H100" in name or "H200" in name or "GH200" in name:
        return "h100"
    if "B200" in name or "B300" in name:
        # GB200, B300 and GB300 are Blackwell too (the same SM and 5th-generation tensor cores; the B300
        # differs in FP4 rate and memory): the B200's curve is the nearest measured one
        return "b200"
    return "other"


def default_curve(device: DeviceSpec) -> EfficiencyCurve:
    """The calibrated curve of the device's family, or its measured points when present."""
    fam = family(device)
    if fam == "a100":
        curve = EfficiencyCurve(A100_MAX_FRACTION, A100_HALF_FLOPS, STEEPNESS)
    elif fam == "h100":
        curve = EfficiencyCurve(H100_MAX_FRACTION, H100_HALF_FLOPS, STEEPNESS)
    elif fam == "b200":
        curve = EfficiencyCurve(B200_MAX_FRACTION, B200_HALF_FLOPS, STEEPNESS)
    elif fam == "cpu":
        curve = EfficiencyCurve(CPU_MAX_FRACTION, CPU_HALF_FLOPS, CPU_STEEPNESS)
    else:
        curve = EfficiencyCurve(DEFAULT_MAX_FRACTION, DEFAULT_HALF_FLOPS, STEEPNESS)
    if device.efficiency:
        return EfficiencyCurve(curve.max_fraction, curve.half_flops, curve.steepness, device.efficiency)
    return curve


def kernel_curve(device: DeviceSpec) -> EfficiencyCurve | None:
    """The GEMM curve of ``device``'s family from measured kernel timings (``pipette.kernel_tables``:
    Vidur, XLA and SimuMax GEMMs of A100, H100 and B200), or None for a family none was timed on."""
    from pipette.kernel_tables import GEMM_EFFICIENCY

    pts = GEMM_EFFICIENCY.get(family(device))
    return EfficiencyCurve(1.0, 1.0, 1.0, pts) if pts else None


#: the GPU whose attention timings a device uses: itself, or the same chip (B300 is GB300's Blackwell
#: Ultra; H100 and GH200 have the H200's SMs)
_ATTENTION_TIMED_ON = (("GB300", "GB300"), ("B300", "GB300"), ("GB200", "GB200"), ("B200", "B200"),
                       ("H200", "H200"), ("GH200", "H200"), ("H100", "H200"))


def kernel_attention(device: DeviceSpec) -> tuple[float, float] | None:
    """(forward, backward) fraction of the bf16 peak of fused causal attention on ``device`` from measured
    kernel timings (``pipette.kernel_tables``: cuDNN's), or None where none was timed on its chip."""
    from pipette.kernel_tables import ATTENTION_EFFICIENCY

    if device.kind != "gpu":
        return None
    name = device.name.upper()
    return next((ATTENTION_EFFICIENCY[gpu] for token, gpu in _ATTENTION_TIMED_ON if token in name), None)


def flash_attention_rate(device: DeviceSpec, head_dim: int, seq: float) -> float | None:
    """The fraction of ``device``'s bf16 peak FlashAttention-2 reaches on causal attention forward and
    backward over ``seq`` keys (``pipette.kernel_tables.FLASH_CAUSAL_RATE``: its README's H100 and A100
    benchmarks, PyTorch SDPA's flash backend timed on a B200 by cudnn-frontend; the nearest head size
    timed, log-interpolated in the sequence and held at the ends), or None for a family none was timed on."""
    from pipette.kernel_tables import FLASH_CAUSAL_RATE

    by_dim = FLASH_CAUSAL_RATE.get(family(device))
    return read_by_sequence(by_dim, head_dim, seq) if by_dim and seq > 0 else None


def read_by_sequence(by_dim: dict[int, tuple[tuple[int, float], ...]], head_dim: int, seq: float) -> float:
    """A FlashAttention table's value (``pipette.kernel_tables``: per head size, (sequence, value)) at the
    nearest head size timed, log-interpolated in the sequence and held at the ends."""
    pts = by_dim[min(by_dim, key=lambda d: (abs(d - head_dim), d))]
    return float(np.interp(np.log(seq), np.log([s for s, _ in pts]), [r for _, r in pts]))


__all__ = ["H100_MEASURED_BF16", "EfficiencyCurve", "default_curve", "family", "flash_attention_rate",
           "kernel_attention", "kernel_curve", "read_by_sequence"]
