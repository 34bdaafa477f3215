"""The devices of 2026 (issue 45): B300, GB200 and GB300 presets with their data sheets' dense peaks,
and the NVL72 rack as one NVLink domain of 72 GPUs in trays of 4 (examples/clusters/gb200-nvl72.yaml)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipette.clusterfile import cluster_from_dict, load_cluster
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec, MiB
from pipette.efficiency import family
from pipette.errors import ClusterFileError
from pipette.model import ModelSpec
from pipette.perf import estimate_perf
from pipette.plan import make_plan
from pipette.training import TrainingSpec

NVL72 = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "gb200-nvl72.yaml"


@pytest.mark.parametrize(("name", "bf16", "fp8", "fp4", "memory"), [
    # memory: what nvidia-smi reports as each part's total (issue 46; pipette/device.py)
    ("B300-288GB", 2250e12, 4500e12, 13500e12, 275040 * MiB),
    ("GB200-186GB", 2500e12, 5000e12, 10000e12, 189471 * MiB),
    ("GB300-288GB", 2500e12, 5000e12, 15000e12, 284208 * MiB),
])
def test_presets_carry_the_data_sheets_dense_peaks(name: str, bf16: float, fp8: float, fp4: float,
                                                   memory: int) -> None:
    d = DeviceSpec.preset(name)
    assert (d.peak("bf16"), d.peak_flops["fp8"], d.peak_flops["fp4"], d.memory_bytes) == (bf16, fp8, fp4, memory)
    assert d.memory_bandwidth == 8e12 and family(d) == "b200"  # priced on the Blackwell curve


def _nvl72_without_domain() -> dict[str, object]:
    return {"name": "trays", "device": "GB200-186GB", "nodes": 18, "devices_per_node": 4,
            "intra_node": {"bandwidth": "900 GB/s", "latency": "2 us"},
            "inter_node": {"bandwidth": "400 Gbit/s", "latency": "8 us"}}


def test_nvl72_rack_is_one_nvlink_domain_of_72_gpus_in_trays_of_4() -> None:
    rack = load_cluster(NVL72)
    assert rack.world == 72 and len(rack.nodes) == 18 and len(rack.devices_on(0)) == 4
    assert rack.bandwidth[0, 71] == 900e9 and rack.bandwidth[0, 1] == 900e9
    assert set(rack.link_domain_of.tolist()) == {0}
    trays = cluster_from_dict(_nvl72_without_domain())
    assert len(set(trays.link_domain_of.tolist())) == 18


def test_tp_across_trays_runs_at_nvlink_speed_in_the_rack_not_through_nics() -> None:
    model, training = ModelSpec.preset("llama3-70b"), TrainingSpec(global_batch=72, seq_len=8192)
    config = ParallelConfig(tp=8, pp=1, dp=9, mbs=1, global_batch=72, zero_stage=1, recompute="full")
    rack = estimate_perf(model, training, config, load_cluster(NVL72), stack="megatron")
    trays = estimate_perf(model, training, config, cluster_from_dict(_nvl72_without_domain()), stack="megatron")
    # each TP group of 8 spans two trays: in the rack NVLink (900 GB/s), as trays NICs (2 x 4 x 50 GB/s x 0.4)
    assert rack.breakdown["tp_comm"] < 0.5 * trays.breakdown["tp_comm"]


def test_plan_on_the_nvl72_rack_ranks_llama3_70b_candidates() -> None:
    rack = load_cluster(NVL72)
    plan = make_plan(ModelSpec.preset("llama3-70b"), TrainingSpec(global_batch=144, seq_len=8192), rack,
                     stack="megatron+fp8")
    assert plan.ranked and plan.best.config.world <= 72
    assert np.isfinite(plan.best.perf.step_time) and plan.best.perf.step_time > 0


def test_a_domain_that_splits_a_node_is_refused_in_one_line() -> None:
    data = _nvl72_without_domain() | {"nvlink_domain": {"devices": 6, "bandwidth": "900 GB/s"}}
    with pytest.raises(ClusterFileError, match="splits node 1"):
        cluster_from_dict(data)
