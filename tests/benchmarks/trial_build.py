"""What a trial rank's build costs: seconds, peak RSS and the parameter bytes it holds, for the
rank-only build (``workers.rank.build``) against the whole-model build every rank did before
(``LlamaForCausalLM(config)`` in fp32 on the host, sharded afterwards), measured side by side
in one run; and where a real trial's wall time goes.

    ./dev bench trial_build [--json OUT.json] [--skip-70b] [--skip-trial]

Each build runs in a fresh process per rank, the ranks of one candidate at the same time (as a
trial runs them), so ``ru_maxrss`` is that rank's peak. The fixed overhead is the process's
RSS after importing torch, transformers, PEFT and DeepSpeed, before building anything.
Targets (issue 13): llama3.2-1b at tp2 on 2 CPU devices, each rank's build peak RSS <= 1.5 x
its shard's bytes + the fixed overhead, and build time >= 3x faster than the whole-model build;
llama2-70b LoRA at tp8 x pp4, one rank's shard under 12 GiB of peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GiB = 2**30


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(case: dict[str, Any]) -> dict[str, Any]:
    """Build one rank's model as ``case`` says, in this process; what it cost."""
    import deepspeed  # noqa: F401  # the rank's imports, counted in the fixed overhead
    import peft  # noqa: F401
    import torch
    import transformers

    from pipette.config import ParallelConfig
    from pipette.model import ModelSpec
    from pipette.training import LoraSpec, TrainingSpec
    from workers.rank.hf_model import TORCH_DTYPES
    from workers.spec import TrialSpec

    torch.set_num_threads(1)
    training = TrainingSpec(global_batch=8, seq_len=128, dtype=case["dtype"], method=case["method"],
                            lora=LoraSpec(rank=16) if case["method"] == "lora" else None)
    config = ParallelConfig(tp=case["tp"], pp=case["pp"], dp=1, mbs=1, global_batch=8)
    trial = TrialSpec(ModelSpec.preset(case["model"]), training, config)
    dtype = TORCH_DTYPES[case["dtype"]]
    base = current_rss()
    start = time.perf_counter()
    if case["how"] == "rank":
        from workers.rank.build import held_modules, materialize, prepare

        prep = prepare(trial, case["rank"], dtype)
        mine = held_modules(prep, trial, case["rank"])
        materialize(mine, torch.device("cpu"), dtype, 0, prep.std)
        params = {id(p): p for m in mine for p in m.parameters()}.values()
    else:  # the whole model in fp32 on the host, as every rank built it before, then its shard
        from workers.rank.hf_model import llama_config
        from workers.rank.tp_shard import shard_layers, shard_vocabulary

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(trial.model))
        tp_index = config.layout.index(case["rank"], "tp")
        if config.tp > 1:
            shard_layers(model, config.tp, tp_index)
            shard_vocabulary(model, config.tp, tp_index)
        params = {id(p): p for p in model.parameters()}.values()
    seconds = time.perf_counter() - start
    held = sum(p.numel() * p.element_size() for p in params)
    return {**case, "build_s": seconds, "peak_rss": rss(), "overhead_rss": base, "held_bytes": held}


def run_ranks(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases at the same time, each in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, __file__, "--one", json.dumps(c)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for c in cases]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        lines = [x for x in stdout.splitlines() if x.startswith("@@build ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"a build process failed ({p.returncode}):\n{stderr[-3000:]}")
        out.append(json.loads(lines[-1][len("@@build "):]))
    return out


def trial_breakdown() -> dict[str, Any]:
    """A real trial of llama3.2-1b LoRA at tp2 on 2 CPU devices: where its wall time goes."""
    from pipette.config import ParallelConfig
    from pipette.model import ModelSpec
    from pipette.training import LoraSpec, TrainingSpec
    from workers.host.local import run_local
    from workers.spec import TrialSpec

    trial = TrialSpec(ModelSpec.preset("llama3.2-1b"),
                      TrainingSpec(global_batch=2, seq_len=32, dtype="fp32", method="lora", lora=LoraSpec(rank=16)),
                      ParallelConfig(tp=2, pp=1, dp=1, mbs=1, global_batch=2), warmup_steps=1, min_steps=2, max_steps=2)
    m = run_local(trial, timeout_s=1200)
    return {"status": m.status, "error": m.error[:500], "wall_s": m.extra.get("wall_s"),
            "phases": m.extra.get("phases"), "step_times": list(m.step_times)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-trial", action="store_true")
    args = ap.parse_args()
    if args.one:
        print("@@build " + json.dumps(one(json.loads(args.one))), flush=True)
        return 0
    results: dict[str, Any] = {}
    small = {"model": "llama3.2-1b", "tp": 2, "pp": 1, "method": "lora", "dtype": "fp32"}
    for how in ("rank", "whole"):  # the new build first: the old one's page cache does not help it
        results[how] = run_ranks([small | {"how": how, "rank": r} for r in (0, 1)])
    print("llama3.2-1b LoRA fp32, tp2 on 2 CPU devices (both ranks at once):")
    print(f"{'build':6s} {'rank':>4s} {'seconds':>8s} {'peak RSS':>10s} {'overhead':>9s} {'held':>9s} "
          f"{'(peak - overhead) / held':>25s}")
    for how in ("rank", "whole"):
        for r in results[how]:
            ratio = (r["peak_rss"] - r["overhead_rss"]) / r["held_bytes"]
            print(f"{how:6s} {r['rank']:4d} {r['build_s']:8.1f} {r['peak_rss'] / GiB:9.2f}G "
                  f"{r['overhead_rss'] / GiB:8.2f}G {r['held_bytes'] / GiB:8.2f}G {ratio:25.2f}")
    speedup = max(r["build_s"] for r in results["whole"]) / max(r["build_s"] for r in results["rank"])
    worst = max((r["peak_rss"] - r["overhead_rss"]) / r["held_bytes"] for r in results["rank"])
    print(f"build {speedup:.1f}x faster (slowest rank against slowest rank; target >= 3x: "
          f"{'met' if speedup >= 3 else 'MISSED'}); peak RSS <= {worst:.2f} x held + overhead "
          f"(target <= 1.5: {'met' if worst <= 1.5 else 'MISSED'})")
    results["speedup"], results["rss_ratio"] = speedup, worst
    if not args.skip_70b:
        big = {"model": "llama2-70b", "tp": 8, "pp": 4, "method": "lora", "dtype": "bf16", "how": "rank"}
        (r,) = run_ranks([big | {"rank": 0}])
        results["llama2_70b"] = r
        print(f"llama2-70b LoRA bf16, tp8 x pp4, rank 0 (stage 0): built in {r['build_s']:.1f} s, holds "
              f"{r['held_bytes'] / GiB:.2f} GiB, peak RSS {r['peak_rss'] / GiB:.2f} GiB (target < 12 GiB: "
              f"{'met' if r['peak_rss'] < 12 * GiB else 'MISSED'})")
    if not args.skip_trial:
        t = trial_breakdown()
        results["trial"] = t
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in (t["phases"] or {}).items())
        print(f"a real trial (llama3.2-1b LoRA fp32, tp2, 2 CPU devices, 1 warm-up + 2 timed steps): {t['status']}, "
              f"{t['wall_s']:.1f} s: {phases}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
