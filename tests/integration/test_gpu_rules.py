"""CPU tests of the GPU path: each fails on the code that failed every trial on the first H100
run (the batch left on the host, the step agreement broadcast as a host tensor under NCCL, the
probe timing the CPU, Ray not owning the GPUs), without needing a GPU to fail.

The GPU itself is exercised by ``tests/gpu`` (run on an H100: see docs/workers.md)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.errors import PipetteError
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.host.probe import _profile, link_kinds
from workers.host.ray_cluster import assign_gpus, check_devices, rank_bundle
from workers.probe_plan import GPU_SIZES, SIZES, message_sizes, probe_shapes
from workers.rank.data import Batches
from workers.rank.devices import collective_device, rank_device
from workers.rank.hf_model import build_llama
from workers.rank.trial import Engine, _agree
from workers.spec import TrialSpec

ROOT = Path(__file__).resolve().parents[2]
META = torch.device("meta")


class EngineOnAnotherDevice:
    """A DeepSpeed engine's calling surface whose parameters live on ``device``: records the
    device of every tensor the step hands it, as a GPU engine would refuse a host tensor."""

    def __init__(self, device: torch.device):
        self.device = device
        self.inputs: list[torch.device] = []

    def __call__(self, input_ids: torch.Tensor) -> Any:
        self.inputs.append(input_ids.device)
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 8, device=input_ids.device))

    def backward(self, loss: torch.Tensor) -> None:
        pass

    def step(self) -> None:
        pass


def test_a_step_hands_the_engine_its_batch_on_the_engines_device() -> None:
    config = ParallelConfig(tp=1, pp=1, dp=1, mbs=2, global_batch=6)  # 3 micro-batches
    engine = Engine.__new__(Engine)
    engine.engine, engine.device, engine.pipeline, engine.config = EngineOnAnotherDevice(META), META, False, config
    engine.batches = Batches(vocab=64, seq_len=16, mbs=2, dp_index=0)
    labels: list[torch.device] = []

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels.append(target.device)
        return torch.tensor(2.0)

    engine.loss_fn = loss_fn
    assert engine.step() == pytest.approx(2.0)
    assert engine.engine.inputs == [META] * 3 and labels == [META] * 3


def test_collectives_use_a_tensor_on_the_backends_device() -> None:
    assert collective_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert collective_device("gloo", torch.device("cpu")) == torch.device("cpu")
    assert collective_device("gloo", torch.device("cuda", 0)) == torch.device("cpu")
    with pytest.raises(ValueError, match="NCCL collectives need a CUDA tensor"):
        collective_device("nccl", torch.device("cpu"))
    assert rank_device("cpu") == torch.device("cpu")


def test_a_gpu_rank_computes_on_the_gpu_its_local_rank_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("gpu") == torch.device("cuda", 3)


def test_the_step_agreement_runs_on_the_process_group(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert _agree(True, torch.device("cpu")) is True
        assert _agree(False, torch.device("cpu")) is False
    finally:
        dist.destroy_process_group()


def test_the_model_is_built_on_the_ranks_device_in_the_training_dtype() -> None:
    model = ModelSpec.preset("tiny-llama")
    on_meta = build_llama(model, device=META, dtype=torch.bfloat16)
    assert {p.device for p in on_meta.parameters()} == {META}
    assert {p.dtype for p in on_meta.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # the build leaves the default alone
    a, b = build_llama(model, seed=3), build_llama(model, seed=3)  # every rank builds the same weights
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_the_probe_measures_a_gpu_with_its_own_messages_and_curve() -> None:
    """The link fit uses the message sizes the ranks measured with (a GPU's are larger), the
    efficiency curve is the bf16 tensor cores', and the profile says what measured what."""
    assert message_sizes("gpu") == GPU_SIZES and message_sizes("cpu") == SIZES
    assert [8192, 8192, 8192] in probe_shapes("gpu", None, 512)
    beta, alpha = 400e9, 5e-6
    s1, s2 = GPU_SIZES
    node = {"name": "g0", "address": "10.0.0.2", "kind": "gpu",
            "devices": [{"local_index": i, "name": "NVIDIA H100 80GB HBM3", "memory": 80 * 2**30,
                         "free": 79 * 2**30, "topology": [0, 10], "bus_id": f"0000:0{i}:00.0",
                         "nvlink_peers": ["0000:ff:00.0"], "nvswitch": True} for i in range(2)]}
    ranks = [{"rank": r, "backend": "nccl", "device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3",
              "message_sizes": [s1, s2],
              "links": {"1": [alpha + s1 / beta, alpha + s2 / beta]} if r == 0 else {},
              "matmul": {"bf16": [[8192, 8192, 8192, 700e12], [1024, 1024, 1024, 140e12]],
                         "fp32": [[8192, 8192, 8192, 51e12]]},
              "copy_bandwidth": 3.0e12} for r in range(2)]
    slots = [(0, d) for d in node["devices"]]  # type: ignore[attr-defined]
    profile = _profile("h100x2", [node], slots, ranks, 1.0)
    assert profile.bandwidth[0, 1] == pytest.approx(beta) and profile.latency[0, 1] == pytest.approx(alpha)
    spec = profile.devices[0].spec
    assert spec.kind == "gpu" and spec.peak_flops["bf16"] == 700e12 and spec.memory_bandwidth == 3.0e12
    assert spec.efficiency[1] == pytest.approx((2.0 * 1024**3, 0.2))  # of the bf16 peak, not fp32's
    assert profile.extra["measured_by"][1] == {"rank": 1, "backend": "nccl", "device": "cuda:0",
                                               "device_name": "NVIDIA H100 80GB HBM3"}
    assert profile.extra["link_kind"] == [["self", "nvlink"], ["nvlink", "self"]]


def test_link_kinds_tell_nvlink_pcie_and_network_apart() -> None:
    def gpu(i: int, **kw: Any) -> dict[str, Any]:
        return {"local_index": i, "topology": [0, 30, 50][:3], "bus_id": f"b{i}", "nvlink_peers": [],
                "nvswitch": False} | kw

    pcie = {"kind": "gpu", "devices": [gpu(0, topology=[0, 30, 50]), gpu(1, topology=[30, 0, 50]),
                                       gpu(2, nvlink_peers=["b0"])]}
    pcie["devices"][0]["nvlink_peers"] = ["b2"]
    other = {"kind": "gpu", "devices": [gpu(0)]}
    slots = [(0, d) for d in pcie["devices"]] + [(1, other["devices"][0])]  # type: ignore[index]
    kinds = link_kinds([pcie, other], slots)
    assert kinds[0][1] == "pcie-host-bridge" and kinds[0][2] == "nvlink" and kinds[0][3] == "network"
    cpu = {"kind": "cpu", "devices": [{"local_index": 0}, {"local_index": 1}]}
    assert link_kinds([cpu], [(0, d) for d in cpu["devices"]])[0][1] == "host"  # type: ignore[attr-defined]


def test_gpu_ranks_hold_a_ray_gpu_each() -> None:
    assert rank_bundle("10.0.0.2", gpu=True) == {"CPU": 1.0, "GPU": 1.0, "node:10.0.0.2": 0.001}
    assert "GPU" not in rank_bundle("10.0.0.2", gpu=False)


def test_ranks_use_their_planned_gpus_among_those_ray_gave_the_trial() -> None:
    # The placement puts rank 0 on GPU 3 and rank 1 on GPU 2; Ray gave the actors 2 and 3.
    assert assign_gpus([0, 0], [3, 2], [["2"], ["3"]]) == (["3", "2"], True)
    # Ray gave GPUs the placement did not name (another job holds 2 and 3): Ray's, in order.
    assert assign_gpus([0, 0], [3, 2], [["5"], ["4"]]) == (["5", "4"], False)
    # Two nodes, numeric order (10 after 9).
    assert assign_gpus([0, 1, 1], [0, 9, 10], [["0"], ["10"], ["9"]]) == (["0", "9", "10"], True)
    with pytest.raises(PipetteError, match="only 1 GPU"):
        assign_gpus([0, 0], [0, 1], [["0"], []])


def test_a_gpu_cluster_file_on_a_ray_without_gpus_is_refused_in_one_line() -> None:
    gpus = load_cluster(ROOT / "examples" / "clusters" / "a100-2x8.yaml")
    with pytest.raises(PipetteError) as e:
        check_devices(gpus, [_local_ip()] * 2)
    assert "has 16 GPU(s) (A100-80GB) on 2 node(s)" in e.value.message and "has 0 GPU(s)" in e.value.message
    assert "RAY_ADDRESS" in (e.value.fix or "")
    check_devices(load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml"))  # CPU devices on a CPU Ray: fine


def test_a_gpu_trial_where_ray_has_no_gpus_fails_at_once() -> None:
    from workers.host.executor import run_trial

    spec = TrialSpec(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=2, seq_len=16, dtype="bf16"),
                     ParallelConfig(tp=1, pp=1, dp=1, mbs=2, global_batch=2), device_kind="gpu")
    start = time.monotonic()
    with pytest.raises(PipetteError, match="Ray has 0 GPU"):
        run_trial(spec, timeout_s=60)
    assert time.monotonic() - start < 10  # not the placement group's 60 s wait


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tune_refuses_a_gpu_cluster_file_without_gpus_before_any_trial(tmp_path: Path) -> None:
    """Was: the trial header, then nothing for ~10 minutes (issue 12)."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cli", "tune", "--model", "llama2-7b", "--method", "lora",
         "--global-batch", "16", "--seq-len", "512", "--cluster", "examples/clusters/a100-2x8.yaml",
         "--home", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=_without_ray_address(),
    )
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("pipette: error:")]
    assert len(errors) == 1 and "GPU" in errors[0] and "RAY_ADDRESS" in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "trial" not in done.stderr.split("pipette: error:")[0].lower()
    assert time.monotonic() - start < 120


def _local_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def _without_ray_address() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def test_profiles_keep_cpu_figures_on_cpu_nodes() -> None:
    """The CPU path stays as it was: gloo, host tensors, fp32 curve, small messages."""
    s1, s2 = SIZES
    node = {"name": "c", "address": "127.0.0.1", "kind": "cpu",
            "devices": [{"local_index": i, "name": "cpu", "memory": 2**30, "free": 2**29} for i in range(2)]}
    ranks = [{"rank": r, "backend": "gloo", "device": "cpu", "message_sizes": [s1, s2],
              "links": {"1": [1e-4, 1e-4 + s2 / 2e9]} if r == 0 else {},
              "matmul": {"fp32": [[256, 256, 256, 5e10], [512, 512, 512, 1e11]], "bf16": [[256, 256, 256, 2e10]]},
              "copy_bandwidth": 1e10} for r in range(2)]
    profile = _profile("c", [node], [(0, d) for d in node["devices"]], ranks, 1.0)  # type: ignore[attr-defined]
    assert profile.devices[0].spec.kind == "cpu" and profile.devices[0].spec.efficiency[0][1] == pytest.approx(0.5)
    assert np.isfinite(profile.bandwidth[0, 1]) and profile.extra["measured_by"][0]["backend"] == "gloo"
