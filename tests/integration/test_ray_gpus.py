"""The Ray side of GPU trials, on a Ray that declares GPUs this machine does not have
(``ray.init(num_gpus=2)``): the ranks' bundles hold Ray GPUs, each rank is shown the GPU its
placement names among those Ray gave the trial, and a rank that cannot use it fails the trial
naming its rank, host and GPU index. A CPU cluster file on that Ray is refused in one line.
Run in a subprocess: its Ray is not the session's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = r"""
import json, os, sys
os.environ.pop("RAY_ADDRESS", None)
import ray
ray.init(address="local", num_cpus=4, num_gpus=2, object_store_memory=200 * 1024**2, include_dashboard=False,
         log_to_driver=False)
from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.errors import PipetteError
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.host.executor import run_trial
from workers.host.ray_cluster import check_devices
from workers.spec import TrialSpec

out = {}
try:
    check_devices(load_cluster(sys.argv[1]))
except PipetteError as e:
    out["cpu_file_refused"] = str(e)
spec = TrialSpec(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=4, seq_len=16, dtype="bf16"),
                 ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=4, placement=(1, 0)), device_kind="gpu")
m = run_trial(spec, timeout_s=120)
out |= {"status": m.status, "error": m.error, "gpus": m.extra.get("gpus")}
print("@@result " + json.dumps(out))
ray.shutdown()
"""


def test_gpu_ranks_hold_ray_gpus_and_a_failed_one_is_named_with_its_gpu() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "examples" / "clusters" / "cpu-4.yaml")],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    lines = [x for x in done.stdout.splitlines() if x.startswith("@@result ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(lines[-1][len("@@result "):])
    assert "has CPU devices, but Ray has 2 GPU(s)" in out["cpu_file_refused"]
    # Rank 0 is placed on GPU 1 and rank 1 on GPU 0: the trial holds both, so each gets its own.
    assert out["status"] == "failed" and out["gpus"] == ["1", "0"], out
    first = out["error"].splitlines()[0]
    assert first.startswith("rank ") and ", GPU " in first and "exited with status" in first, out["error"]
    assert "sees no GPU" in out["error"]
