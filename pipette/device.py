"""``DeviceSpec``: one GPU, or on a machine without one, one CPU worker process.

Preset peaks are the vendors' dense (no sparsity) tensor-core figures; the probe of the
workers replaces them with measured numbers. They live here, as data, so no formula
holds a hardware constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pipette.errors import SpecError, UnknownPresetError

GiB = 1024**3
MiB = 1024**2
GB = 1000**3
TFLOPS = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """One device: its memory, its peak FLOP/s per dtype and its memory bandwidth.

    ``efficiency`` holds measured points ``(gemm_flops, achieved / peak)`` of the matmul
    throughput curve, from the probe; empty means "use the calibrated default curve".
    """

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    kind: str = "gpu"
    efficiency: tuple[tuple[float, float], ...] = field(default=())
    #: The 16-bit rate the fused attention kernel is priced against where it is not ``peak_flops``' (None:
    #: the same): on a power-capped part whose peaks are scaled for the cap, the assumption (not measured
    #: here) that the cap lowers the clocks under the power-bound GEMMs and not under the fused attention
    attention_flops: float | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise SpecError(
                f"memory must be positive, got {self.memory_bytes!r}",
                field="device.memory_bytes",
                fix="give the device memory in bytes (e.g. 80e9)",
            )
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise SpecError(
                "peak FLOP/s must be given and positive for each dtype",
                field="device.peak_flops",
                fix="give e.g. {bf16: 312e12, fp32: 19.5e12}",
            )
        if self.memory_bandwidth <= 0:
            raise SpecError(
                f"memory bandwidth must be positive, got {self.memory_bandwidth!r}",
                field="device.memory_bandwidth",
                fix="give it in bytes/s (e.g. 2.0e12)",
            )
        if self.attention_flops is not None and not self.attention_flops > 0:
            raise SpecError(
                f"attention FLOP/s must be positive, got {self.attention_flops!r}",
                field="device.attention_flops",
                fix="leave it out to price attention at the bf16 peak",
            )
        if self.kind not in ("gpu", "cpu"):
            raise SpecError(
                f"unknown kind {self.kind!r}", field="device.kind", fix="use gpu or cpu"
            )

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; a dtype without tensor-core support falls back: ``tf32`` (fp32
        matmuls on TF32 tensor cores) to ``fp32`` where the device has no TF32 peak (a CPU, V100,
        T4: PyTorch runs such matmuls in plain fp32 there)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "bf16" and "fp16" in self.peak_flops:
            raise SpecError(
                f"{self.name} has no bf16 support",
                field="training.dtype",
                fix="use fp16 on this device",
            )
        return self.peak_flops.get("fp32", min(self.peak_flops.values()))

    def with_memory(self, memory_bytes: int) -> DeviceSpec:
        return replace(self, memory_bytes=int(memory_bytes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "kind": self.kind,
            "efficiency": [list(p) for p in self.efficiency],
            **({"attention_flops": self.attention_flops} if self.attention_flops is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        try:
            return cls(
                name=str(data["name"]),
                memory_bytes=int(data["memory_bytes"]),
                peak_flops={str(k): float(v) for k, v in dict(data["peak_flops"]).items()},
                memory_bandwidth=float(data["memory_bandwidth"]),
                kind=str(data.get("kind", "gpu")),
                efficiency=tuple((float(a), float(b)) for a, b in data.get("efficiency", ())),
                attention_flops=None if data.get("attention_flops") is None else float(data["attention_flops"]),
            )
        except KeyError as e:
            raise SpecError(
                f"missing {e.args[0]!r}",
                field=f"device.{e.args[0]}",
                fix="give name, memory_bytes, peak_flops and memory_bandwidth, or a preset name",
            ) from None
        except (TypeError, ValueError) as e:
            raise SpecError(f"bad value ({e})", field="device", fix="check the numbers") from None

    @classmethod
    def preset(cls, name: str) -> DeviceSpec:
        try:
            return DEVICE_PRESETS[name.lower()]
        except KeyError:
            raise UnknownPresetError(
                f"unknown device preset {name!r}",
                field="device",
                fix=f"use one of {', '.join(sorted(DEVICE_PRESETS))}",
            ) from None


def cpu_device(memory_bytes: int, flops: float = 50e9, memory_bandwidth: float = 10e9) -> DeviceSpec:
    """One CPU worker process with its share of RAM.

    The default FLOP/s and bandwidth are placeholders for planning only; the probe
    measures the real ones (``workers.host.probe``).
    """
    return DeviceSpec(
        name="cpu",
        memory_bytes=int(memory_bytes),
        peak_flops={"fp32": flops, "bf16": flops},
        memory_bandwidth=memory_bandwidth,
        kind="cpu",
    )


def _gpu(name: str, mem: float, bf16: float | None, fp16: float, fp32: float, bw: float,
         fp8: float | None = None, tf32: float | None = None, fp4: float | None = None) -> DeviceSpec:
    peaks = {"fp16": fp16 * TFLOPS, "fp32": fp32 * TFLOPS}
    if bf16 is not None:
        peaks["bf16"] = bf16 * TFLOPS
    if fp8 is not None:
        peaks["fp8"] = fp8 * TFLOPS
    if fp4 is not None:
        peaks["fp4"] = fp4 * TFLOPS
    if tf32 is not None:
        peaks["tf32"] = tf32 * TFLOPS
    return DeviceSpec(name, int(mem), peaks, bw * 1e12, "gpu")


# Dense peaks from the vendor data sheets (NVIDIA A100, H100 SXM, H200 SXM, V100 SXM2, T4).
# fp32 means what PyTorch runs for fp32 matmuls by default (TF32 off): the CUDA-core peak.
# B200: NVIDIA HGX B200 data sheet, per GPU (the sheet gives 8): 180 GB HBM3e at 8 TB/s,
# FP16/BF16 tensor 2.25 PFLOPS dense (4.5 with sparsity), FP32 75 TFLOPS.
# FP8 (dense): H100 SXM / H200 SXM / GH200 3,958 TFLOPS with sparsity = 1,979 dense; HGX B200
# 72 PFLOPS with sparsity for 8 GPUs = 4.5 PFLOPS dense per GPU. A100, V100, T4 have no FP8.
# GH200: NVIDIA GH200 Grace Hopper Superchip data sheet: the H100's peaks (BF16 989 TFLOPS
# dense, FP32 67 TFLOPS) with 96 GB HBM3 at 4 TB/s, or 144 GB HBM3e at 4.9 TB/s.
# TF32 tensor cores (dense; the sheets print twice these with sparsity): A100 156 TFLOPS; H100 SXM,
# H200 SXM and GH200 494.5 (989 with sparsity); HGX B200 1,100 per GPU (2.2 PFLOPS with sparsity).
# Volta (V100) and Turing (T4) have none: there ``tf32`` falls back to the fp32 peak.
# FP4 (NVFP4 / MXFP4 tensor cores, Blackwell only), dense: HGX B200 144 PFLOPS with sparsity for 8 GPUs
# = 9 PFLOPS per GPU.
# The devices of 2026 (per GPU; NVIDIA's data sheets print the rack or the 8-GPU board, with sparsity:
# dense = half, per GPU = the total over 72 or 8):
# GB200: GB200 NVL72 data sheet: FP4 1,440 PFLOPS, FP8/FP6 720, FP16/BF16 360, TF32 180 (sparse), FP32
#   5,760 TFLOPS, 13.4 TB HBM3e at 576 TB/s, NVLink 130 TB/s for 72 GPUs: per GPU dense FP4 10,000, FP8
#   5,000, BF16 2,500, TF32 1,250, FP32 80 TFLOPS, 186 GB at 8 TB/s, NVLink 1.8 TB/s (900 GB/s a direction).
# GB300: GB300 NVL72 data sheet: FP4 1,440 | 1,080 PFLOPS (sparse | dense), FP8/FP6 720, FP16/BF16 360,
#   TF32 180 (sparse), FP32 6 PFLOPS, up to 21 TB HBM3e at 576 TB/s, NVLink 130 TB/s: per GPU dense FP4
#   15,000, FP8 5,000, BF16 2,500, TF32 1,250, FP32 80 TFLOPS (6,000 / 72, rounded down as the GPU sheet), 288 GB at
#   8 TB/s, NVLink 1.8 TB/s.
# B300: HGX B300 data sheet (8 GPUs): FP4 144 | 108 PFLOPS (sparse | dense), FP8/FP6 72, FP16/BF16 36,
#   TF32 18 (sparse), FP32 600 TFLOPS, 2.3 TB HBM3e at 64 TB/s, NVLink 14.4 TB/s: per GPU dense FP4
#   13,500, FP8 4,500, BF16 2,250, TF32 1,125, FP32 75 TFLOPS, 288 GB at 8 TB/s, NVLink 1.8 TB/s.
# Memory of the Blackwell parts: what nvidia-smi reports as the device's total (the data sheets' "180 GB"
# and "186 GB" are GiB-sized stacks less what the driver keeps): B200 183,359 MiB, GB200 189,471 MiB,
# GB300 284,208 MiB, B300 SXM6 275,040 MiB (public nvidia-smi outputs of each part; the data sheets' GB
# figures were 6.8% below the B200's and GB200's).
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    d.name.lower(): d
    for d in [
        _gpu("A100-40GB", 40 * GiB, 312, 312, 19.5, 1.555, tf32=156),
        _gpu("A100-80GB", 80 * GiB, 312, 312, 19.5, 2.039, tf32=156),
        _gpu("H100-80GB", 80 * GiB, 989, 989, 67, 3.35, fp8=1979, tf32=494.5),
        _gpu("H200-141GB", 141 * GB, 989, 989, 67, 4.8, fp8=1979, tf32=494.5),
        _gpu("B200-180GB", 183359 * MiB, 2250, 2250, 75, 8.0, fp8=4500, tf32=1100, fp4=9000),
        _gpu("B300-288GB", 275040 * MiB, 2250, 2250, 75, 8.0, fp8=4500, tf32=1125, fp4=13500),
        _gpu("GB200-186GB", 189471 * MiB, 2500, 2500, 80, 8.0, fp8=5000, tf32=1250, fp4=10000),
        _gpu("GB300-288GB", 284208 * MiB, 2500, 2500, 80, 8.0, fp8=5000, tf32=1250, fp4=15000),
        _gpu("GH200-96GB", 96 * GB, 989, 989, 67, 4.0, fp8=1979, tf32=494.5),
        _gpu("GH200-144GB", 144 * GB, 989, 989, 67, 4.9, fp8=1979, tf32=494.5),
        _gpu("V100-32GB", 32 * GiB, None, 125, 15.7, 0.9),
        _gpu("T4-16GB", 16 * GiB, None, 65, 8.1, 0.32),
        cpu_device(4 * GiB),
    ]
}
