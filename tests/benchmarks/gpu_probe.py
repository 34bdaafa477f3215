"""What the probe's rank program measures on this machine's GPU, against plain torch timed in
the same run: matmul FLOP/s per dtype at square sizes and at Llama projections, and the
device-to-device copy bandwidth (bytes read + written).

    python tests/benchmarks/gpu_probe.py [--json OUT.json]

Target (issue 12): on one H100, bf16 matmul >= 600 TFLOP/s and HBM copy >= 2 TB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipette.contract import EVENT_PREFIX  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from workers.probe_plan import probe_shapes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on a GPU machine", file=sys.stderr)
        return 0
    shapes = probe_shapes("gpu", ModelSpec.preset("llama3.1-8b"), 4096)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29612",
           "LOCAL_RANK": "0", "PIPETTE_PROBE": json.dumps({"device_kind": "gpu", "shapes": shapes}),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "workers.rank.probe"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    if done.returncode != 0:
        print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
        return 1
    got = [json.loads(x[len(EVENT_PREFIX):]) for x in done.stdout.splitlines() if x.startswith(EVENT_PREFIX)]
    rank = got[-1]["ranks"][0]

    # Plain torch in this process: the same products, timed by torch.utils.benchmark.
    from torch.utils.benchmark import Timer

    plain: dict[str, list[list[float]]] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        for m, k, n in shapes:
            a = torch.randn(m, k, dtype=dtype, device="cuda")
            b = torch.randn(k, n, dtype=dtype, device="cuda")
            t = Timer("a @ b", globals={"a": a, "b": b}).blocked_autorange(min_run_time=0.3).median
            plain.setdefault(name, []).append([m, k, n, 2.0 * m * k * n / t])
    src = torch.ones(2**28, device="cuda")
    dst = torch.empty_like(src)
    copy_t = Timer("dst.copy_(src)", globals={"src": src, "dst": dst}).blocked_autorange(min_run_time=0.3).median
    plain_copy = 2.0 * src.numel() * 4 / copy_t
    del src, dst
    name = torch.cuda.get_device_name()
    print(f"{name} ({rank['backend']}, {rank['device']}); torch {torch.__version__}")
    print(f"{'dtype':5s} {'m x k x n':>22s} {'probe TFLOP/s':>14s} {'plain torch':>12s} {'ratio':>6s}")
    for dtype, points in rank["matmul"].items():
        for (m, k, n, f), (_, _, _, p) in zip(points, plain[dtype], strict=True):
            print(f"{dtype:5s} {f'{m} x {k} x {n}':>22s} {f / 1e12:14.1f} {p / 1e12:12.1f} {f / p:6.2f}")
    peak = max(p[3] for p in rank["matmul"]["bf16"])
    copy = rank["copy_bandwidth"]
    print(f"copy: probe {copy / 1e12:.2f} TB/s, plain torch {plain_copy / 1e12:.2f} TB/s ({copy / plain_copy:.2f})")
    print(f"target: bf16 >= 600 TFLOP/s: {peak / 1e12:.0f} ({'met' if peak >= 600e12 else 'MISSED'}); "
          f"copy >= 2 TB/s: {copy / 1e12:.2f} ({'met' if copy >= 2e12 else 'MISSED'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "probe": rank, "plain": plain,
                                               "plain_copy": plain_copy}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
