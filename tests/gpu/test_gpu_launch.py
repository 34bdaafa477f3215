"""The launch files for a one-GPU cluster run as printed (``(cd DIR && ./launch.sh)``), with
the deepspeed launcher, on the GPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from pipette.clusterfile import cluster_from_dict
from pipette.config import ParallelConfig
from pipette.contract import EVENT_PREFIX
from pipette.emit import write_launch_files
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.spec import TrialSpec

ROOT = Path(__file__).resolve().parents[2]


def test_emitted_launch_runs_on_one_gpu(tmp_path: Path) -> None:
    cluster = cluster_from_dict({"name": "one-gpu", "device": "H100-80GB", "nodes": 1, "devices_per_node": 1,
                                 "intra_node": {"bandwidth": "450 GB/s", "latency": "3 us"}})
    training = TrainingSpec(global_batch=8, seq_len=128, dtype="bf16", method="lora", lora=LoraSpec(rank=8))
    config = ParallelConfig(tp=1, pp=1, dp=1, mbs=4, global_batch=8, recompute="full")
    spec = TrialSpec(ModelSpec.preset("tiny-llama"), training, config, min_steps=4, max_steps=4)
    options = {k: v for k, v in spec.runner_options().items() if k != "device_kind"}  # found at launch
    out = tmp_path / "best"
    write_launch_files(out, spec.model, training, config, cluster, extra={"trial": options})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")}
    env |= {"MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(["bash", "-c", f"cd {out} && ./launch.sh"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    log = (out / "launch.log").read_text()  # every line of the launch's output; the terminal gets a summary
    events = [json.loads(x[len(EVENT_PREFIX):]) for x in log.splitlines() if x.startswith(EVENT_PREFIX)]
    assert done.stdout.strip().splitlines()[-1].startswith(f"launch of {config.label}: 4 timed steps on 1 rank here")
    rank = next(e for e in events if e["event"] == "rank")
    assert rank["device_kind"] == "gpu" and rank["master_port"] == str(port)
    finished = next(e for e in events if e["event"] == "done")
    assert finished["device"] == "cuda:0" and len(finished["step_times"]) == 4
    print("launch steps", [round(t, 4) for t in finished["step_times"]], "python", sys.executable)
