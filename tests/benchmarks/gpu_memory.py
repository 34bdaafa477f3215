"""The fits boundary on a real GPU: run a grid of single-GPU candidates of Pipette's own runner
and record, for each, what the caching allocator saw (``workers.rank.memory.allocator_record``:
peak allocated, peak reserved, inactive split blocks, retries, memory outside the allocator)
beside the memory estimator's prediction, as the table the fits boundary is calibrated on.

    python tests/benchmarks/gpu_memory.py --csv OUT.csv [--grid 8b] [--budget-s 300]

The default grid is the Llama-3-8B LoRA job of the fits-boundary issue (r=16 on q,k,v,o, seq
4096, global batch 8, bf16, AdamW, ZeRO-0), micro-batch 1-8 with and without full
recomputation, the GPU capped to the H100's 81559 MiB. Rows are run in the order listed and
written as they finish; a row is not started once ``--budget-s`` has passed.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipette.config import ParallelConfig
from pipette.memory import estimate_memory
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.host.local import run_local
from workers.spec import TrialSpec

H100_BYTES = 81559 * 2**20
GiB = 2**30

#: (model, method, seq, global batch, [(mbs, recompute), ...]); the boundary rows first
GRIDS = {
    "8b": ("llama3-8b", "lora", 4096, 8, [(2, "none"), (4, "full"), (1, "none"), (4, "none"), (2, "full"),
                                          (8, "full"), (1, "full")]),
    # the H100 rows' boundary again at an H200's whole capacity (--cap device): held-out capacity
    "8b-h200": ("llama3-8b", "lora", 4096, 8, [(4, "none"), (8, "full"), (8, "none")]),
    "3b": ("llama3.2-3b", "lora", 4096, 8, [(4, "none"), (8, "full"), (2, "none")]),
}

FIELDS = ("label", "status", "step_s", "peak_allocated_gib", "peak_reserved_gib", "peak_inactive_split_gib",
          "alloc_retries", "allocator_ooms", "outside_allocator_gib", "predicted_gib", "predicted_with_margin_gib",
          "oom_asked_gib", "wall_s", "error")


def _gib(values: object) -> float | str:
    return round(values[0] / GiB, 3) if isinstance(values, list) and values else ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True, help="write the table here (a .json beside it holds every record)")
    ap.add_argument("--grid", default="8b", choices=sorted(GRIDS))
    ap.add_argument("--budget-s", type=float, default=600.0, help="start no row after this many seconds")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--cap", choices=("h100", "device"), default="h100",
                    help="cap the GPU at the H100's 81559 MiB (default) or use the whole device")
    ap.add_argument("--rows", default="", help="run only these rows of the grid (0-based, comma-separated)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on a GPU machine", file=sys.stderr)
        return 0
    name, method, seq, global_batch, rows = GRIDS[args.grid]
    if args.rows:
        rows = [rows[int(i)] for i in args.rows.split(",")]
    capacity = H100_BYTES if args.cap == "h100" else torch.cuda.get_device_properties(0).total_memory
    cap_bytes = H100_BYTES if args.cap == "h100" else None
    model = ModelSpec.preset(name)
    lora = LoraSpec(rank=16, alpha=32.0, targets=("q_proj", "k_proj", "v_proj", "o_proj")) if method == "lora" else None
    training = TrainingSpec(global_batch=global_batch, seq_len=seq, dtype="bf16", optimizer="adamw",
                            method=method, lora=lora)  # type: ignore[arg-type]
    started = time.monotonic()
    records = []
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for mbs, recompute in rows:
            if time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: the remaining rows are not run", flush=True)
                break
            config = ParallelConfig(tp=1, pp=1, dp=1, mbs=mbs, global_batch=global_batch, zero_stage=0,
                                    recompute=recompute)  # type: ignore[arg-type]
            predicted = estimate_memory(model, training, config, capacity, device_kind="gpu")
            spec = TrialSpec(model, training, config, device_kind="gpu", memory_cap_bytes=cap_bytes,
                             min_steps=3, max_steps=5)
            m = run_local(spec, timeout_s=args.timeout)
            label = f"{name} {method} seq{seq} gbs{global_batch} mbs{mbs} rc:{recompute}"
            row = {
                "label": label, "status": m.status,
                "step_s": round(statistics.median(m.step_times), 4) if m.status == "ok" and m.step_times else "",
                "peak_allocated_gib": _gib(m.extra.get("peak_allocated_bytes")),
                "peak_reserved_gib": _gib(m.extra.get("peak_reserved_bytes")),
                "peak_inactive_split_gib": _gib(m.extra.get("peak_inactive_split_bytes")),
                "alloc_retries": (m.extra.get("alloc_retries") or [""])[0],
                "allocator_ooms": (m.extra.get("allocator_ooms") or [""])[0],
                "outside_allocator_gib": _gib(m.extra.get("outside_allocator_bytes")),
                "predicted_gib": round(predicted.peak_bytes / GiB, 3),
                "predicted_with_margin_gib": round(predicted.peak_bytes * 1.10 / GiB, 3),
                "oom_asked_gib": round(m.extra["oom_bytes"] / GiB, 3) if "oom_bytes" in m.extra else "",
                "wall_s": round(float(m.extra.get("wall_s") or 0), 1),
                "error": (m.error or "")[:200] if m.status not in ("ok", "oom") else "",
            }
            writer.writerow(row)
            f.flush()
            records.append({**row, "breakdown": predicted.breakdown, "extra": m.extra,
                            "step_times": list(m.step_times)})
            print(json.dumps(row), flush=True)
    Path(args.csv).with_suffix(".json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "capacity_bytes": capacity, "torch": torch.__version__,
         "rows": records}, indent=1, default=str))
    print(f"{len(records)} rows in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
