"""Re-run every ``h100_single_gpu.csv`` trial (runner ``deepspeed-trial``) on this machine's
GPU and compare: status (ok / oom) and median step time against the file's.

    python tests/benchmarks/gpu_trials.py [--json OUT.json] [--only 1b]

Target (issue 12): every candidate that ran there runs again within 5% of the file's step
time, and runs out of memory where the file says oom. Each trial is a fresh
``python -m workers.rank.train`` process (``workers.host.local.run_local``), the GPU capped to the H100's
81559 MiB so that a larger GPU runs out of memory where the H100 did.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.calibration import calibration_dir, load_h100_single_gpu
from workers.host.local import run_local
from workers.spec import TrialSpec

H100_BYTES = 81559 * 2**20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", default="", help="run only rows whose label contains this")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    directory = calibration_dir()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on a GPU machine", file=sys.stderr)
        return 0
    device = torch.cuda.get_device_name()
    rows = [r for r in load_h100_single_gpu(directory) if r.runner == "deepspeed-trial" and args.only in r.label]
    out = []
    started = time.monotonic()
    for r in rows:
        spec = TrialSpec(r.model, r.training, r.config, device_kind="gpu", memory_cap_bytes=H100_BYTES)
        m = run_local(spec, timeout_s=args.timeout)
        median = statistics.median(m.step_times) if m.status == "ok" and m.step_times else None
        ratio = median / r.step_time if median and r.step_time else None
        row = {
            "label": r.label, "file_status": r.status, "status": m.status, "file_step_s": r.step_time,
            "step_s": median, "ratio": ratio, "step_times": list(m.step_times),
            "file_peak_gib": r.peak_allocated_gib,
            "peak_gib": m.peak_memory[0] / 2**30 if m.peak_memory else None,
            "reserved_gib": (m.extra.get("peak_reserved_bytes") or [0])[0] / 2**30 or None,
            "file_wall_s": r.trial_wall_s, "wall_s": m.extra.get("wall_s"),
            "error": m.error[:300] if m.status not in ("ok", "oom") else "",
        }
        out.append(row)
        agree = "same" if m.status == r.status else "DIFFERENT"
        timing = f"{median:.4f} s vs {r.step_time:.4f} s ({ratio - 1:+.1%})" if ratio else ""
        print(f"{r.label:60s} {r.status:>4s} -> {m.status:<7s} {agree:9s} {timing} "
              f"peak {row['peak_gib'] or 0:.1f} GiB (file {r.peak_allocated_gib or 0:.1f}) "
              f"wall {row['wall_s']:.0f} s (file {r.trial_wall_s or 0:.0f}) {row['error']}", flush=True)
    timed = [x for x in out if x["ratio"] is not None]
    within = [x for x in timed if abs(x["ratio"] - 1) <= 0.05]
    same = [x for x in out if x["status"] == x["file_status"]]
    print(f"\n{device}: {len(same)}/{len(out)} same status; {len(within)}/{len(timed)} step times within 5% "
          f"(median ratio {statistics.median([x['ratio'] for x in timed]) if timed else float('nan'):.3f}); "
          f"{time.monotonic() - started:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
