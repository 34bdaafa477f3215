"""The probe of a 4-device CPU cluster on this machine."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipette.clusterfile import cluster_from_dict
from pipette.model import ModelSpec
from workers.probe import probe_cluster


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
    assert elapsed <= 60, elapsed
