"""The probe's rank program on one GPU measures the GPU: its matmul and copy figures are
within 2x of plain torch measured in the same run, with NCCL and ``cuda:0`` named; its TF32
figure is fp32 on the tensor cores (faster than plain fp32 from Ampere on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from pipette.contract import EVENT_PREFIX

ROOT = Path(__file__).resolve().parents[2]
N = 8192


def probe(options: dict) -> dict:  # type: ignore[type-arg]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611",
           "LOCAL_RANK": "0", "PIPETTE_PROBE": json.dumps(options),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "workers.rank.probe"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(x[len(EVENT_PREFIX):]) for x in done.stdout.splitlines() if x.startswith(EVENT_PREFIX)]
    return dict(lines[-1]["ranks"][0])


def plain_matmul(dtype: torch.dtype) -> float:
    a, b = torch.randn(N, N, dtype=dtype, device="cuda"), torch.randn(N, N, dtype=dtype, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    end.synchronize()
    return 2.0 * N**3 * 20 / (start.elapsed_time(end) / 1e3)


def plain_copy() -> float:
    src = torch.ones(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2.0 * src.numel() * 4 * 20 / (start.elapsed_time(end) / 1e3)


def test_the_probe_measures_the_gpu() -> None:
    got = probe({"device_kind": "gpu", "shapes": [[N, N, N], [4096, 2048, 8192]]})
    assert got["backend"] == "nccl" and got["device"] == "cuda:0"
    flops = {dtype: max(p[3] for p in points) for dtype, points in got["matmul"].items()}
    assert set(flops) == {"bf16", "fp16", "fp32", "tf32"}
    reference = {"bf16": plain_matmul(torch.bfloat16), "fp32": plain_matmul(torch.float32)}
    copy = plain_copy()
    name = torch.cuda.get_device_name()
    print(f"{name}: probe bf16 {flops['bf16'] / 1e12:.0f} TFLOP/s (plain {reference['bf16'] / 1e12:.0f}), "
          f"fp16 {flops['fp16'] / 1e12:.0f}, fp32 {flops['fp32'] / 1e12:.1f} (plain {reference['fp32'] / 1e12:.1f}); "
          f"copy {got['copy_bandwidth'] / 1e12:.2f} TB/s (plain {copy / 1e12:.2f})")
    for dtype, plain in reference.items():
        assert 0.5 <= flops[dtype] / plain <= 2.0, (dtype, flops[dtype], plain)
    assert 0.5 <= got["copy_bandwidth"] / copy <= 2.0, (got["copy_bandwidth"], copy)
    if torch.cuda.get_device_capability()[0] >= 8:  # Ampere and newer have TF32 tensor cores
        assert flops["tf32"] >= 2.0 * flops["fp32"], (flops["tf32"], flops["fp32"])
    if "H100" in name or "H200" in name:  # the floor for a Hopper GPU
        assert flops["bf16"] >= 600e12 and got["copy_bandwidth"] >= 2e12
