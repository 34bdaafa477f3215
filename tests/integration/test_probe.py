"""The probe of a 4-device CPU cluster on this machine."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipette.clusterfile import cluster_from_dict
from pipette.model import ModelSpec
from workers.host.probe import inventory, probe_cluster, training_nodes


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_probe_of_four_cpu_devices() -> None:
    start = time.monotonic()
    profile = probe_cluster(cpu_devices_per_node=4, model=ModelSpec.preset("tiny-llama"))
    elapsed = time.monotonic() - start
    assert profile.method == "measured" and profile.measured_at
    assert profile.world == 4 and all(d.spec.kind == "cpu" for d in profile.devices)
    off = ~np.eye(4, dtype=bool)
    assert np.all(np.isfinite(profile.bandwidth[off])) and np.all(profile.bandwidth[off] > 0)
    assert np.all(profile.latency[off] >= 0)
    assert np.allclose(profile.bandwidth, profile.bandwidth.T)
    for d in profile.devices:
        assert set(d.spec.peak_flops) == {"fp32", "bf16"} and d.spec.memory_bandwidth > 0
        assert d.free_memory is not None and 0 < d.free_memory <= d.spec.memory_bytes
    assert cluster_from_dict(profile.to_dict()).method == "measured"  # readable as a cluster file
    if not _has_nvml():
        assert profile.extra["nvml"] == ["NVMLError_LibraryNotFound"]  # why the node counted as CPU
    assert elapsed <= 60, elapsed


def _has_nvml() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return False
    pynvml.nvmlShutdown()
    return True


def test_without_a_gpu_the_inventory_falls_back_to_cpu_devices() -> None:
    """NVML is installed (nvidia-ml-py) but has no library to load here: the node is profiled
    as CPU worker processes sharing its RAM, and says why."""
    if _has_nvml():
        pytest.skip("this machine has NVML: the fallback is for machines without a GPU")
    found = inventory(3)
    assert found["kind"] == "cpu" and found["nvml"] == "NVMLError_LibraryNotFound"
    devices = found["devices"]
    assert [d["local_index"] for d in devices] == [0, 1, 2]
    assert len({d["memory"] for d in devices}) == 1 and all(0 < d["free"] <= d["memory"] for d in devices)
    with open("/proc/meminfo") as f:
        total_kib = int(f.readline().split()[1])
    assert 3 * devices[0]["memory"] == pytest.approx(total_kib * 1024, rel=0.01)


def test_on_a_gpu_cluster_only_gpu_nodes_are_measured() -> None:
    """A CPU-only Ray head (KubeRay's default) next to GPU workers is no training device; on a
    CPU-only cluster every node's CPU devices are."""

    head = {"name": "head", "address": "10.0.0.1", "kind": "cpu", "devices": [{"local_index": 0}]}
    gpus = [{"name": f"g{i}", "address": f"10.0.0.{i + 2}", "kind": "gpu", "devices": [{"local_index": 0}]}
            for i in range(2)]
    kept, dropped = training_nodes([head, *gpus])
    assert kept == gpus and dropped == [head]
    cpus = [head, {**head, "name": "w1", "address": "10.0.0.9"}]
    assert training_nodes(cpus) == (cpus, [])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_probe_whose_rendezvous_port_was_taken_starts_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 binds the rendezvous port a moment after its node picked it free; another process
    took it in between once ("Address already in use", two test workers starting ranks at once)
    and the probe failed. The probe starts again on a new port."""
    from workers.host import probe
    from workers.host.monitor import Watched
    from workers.host.outcome import Outcome

    real, calls = probe.run_ranks, []

    def first_port_taken(*args: object, **kwargs: object) -> Watched:
        calls.append(1)
        if len(calls) == 1:
            return Watched(Outcome("failed", "rank 0 exited with status 1\nOSError: [Errno 98] Address already "
                                   "in use"), 0.1, "", ())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(probe, "run_ranks", first_port_taken)
    profile = probe_cluster(cpu_devices_per_node=2, model=ModelSpec.preset("tiny-llama"))
    assert len(calls) == 2 and profile.world == 2

    calls.clear()
    monkeypatch.setattr(probe, "run_ranks", lambda *a, **k: calls.append(1) or Watched(
        Outcome("failed", "OSError: [Errno 98] Address already in use"), 0.1, "", ()))
    with pytest.raises(probe.PipetteError, match="the probe failed"):
        probe_cluster(cpu_devices_per_node=2, model=ModelSpec.preset("tiny-llama"))
    assert len(calls) == probe.PORT_RACE_ATTEMPTS  # and not for ever
