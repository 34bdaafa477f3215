"""Physical properties of the performance model (pipette.perf)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from pipette.cluster import ClusterProfile
from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.device import cpu_device
from pipette.efficiency import EfficiencyCurve, default_curve
from pipette.errors import SpecError
from pipette.estimates import TIME_PARTS
from pipette.model import ModelSpec
from pipette.perf import MEGATRON_CONSTANTS, PerfModel, estimate_perf
from pipette.training import LoraSpec, TrainingSpec

MODEL = ModelSpec.preset("llama2-7b")
TRAIN = TrainingSpec(global_batch=64, seq_len=2048, dtype="bf16")
GB = 1e9


def cluster(nodes: int = 2, per_node: int = 8, intra: float = 300 * GB, inter: float = 25 * GB) -> ClusterProfile:
    return homogeneous_cluster("A100-80GB", nodes, per_node, intra, inter)


def with_slow_link(c: ClusterProfile, i: int, j: int, bw: float) -> ClusterProfile:
    m = np.array(c.bandwidth, dtype=float)
    m[i, j] = m[j, i] = bw
    return ClusterProfile(c.name, c.nodes, c.devices, m, np.array(c.latency))


def cfg(**kw: object) -> ParallelConfig:
    base: dict[str, object] = dict(tp=1, pp=1, dp=1, mbs=1, global_batch=TRAIN.global_batch)
    base.update(kw)
    return ParallelConfig(**base)  # type: ignore[arg-type]


def test_breakdown_sums_to_step_time_and_keys_fixed() -> None:
    est = estimate_perf(MODEL, TRAIN, cfg(tp=2, pp=2, dp=4, zero_stage=1), cluster())
    assert tuple(est.breakdown) == TIME_PARTS
    assert math.isclose(sum(est.breakdown.values()), est.step_time, rel_tol=1e-12)
    assert all(v >= 0 for v in est.breakdown.values())
    assert est.tokens_per_s == pytest.approx(TRAIN.tokens_per_step / est.step_time)
    assert 0 < est.mfu < 1


def test_step_time_fast_path_matches_estimate() -> None:
    pm = PerfModel(MODEL, TRAIN, cfg(tp=4, pp=2, dp=2), cluster())
    assert pm.step_time() == pytest.approx(pm.estimate().step_time, rel=1e-12)


def test_more_tp_over_a_slow_link_is_slower() -> None:
    slow = cluster(nodes=1, per_node=8, intra=5 * GB, inter=5 * GB)
    t2 = estimate_perf(MODEL, TRAIN, cfg(tp=2, pp=4), slow)
    t8 = estimate_perf(MODEL, TRAIN, cfg(tp=8), slow)
    assert t8.breakdown["tp_comm"] > t2.breakdown["tp_comm"]
    assert t8.step_time > t2.step_time


def test_tp_group_across_nodes_is_slower_than_inside_one() -> None:
    c = cluster(nodes=2, per_node=4, inter=10 * GB)
    pm = PerfModel(MODEL, TRAIN, cfg(tp=4, dp=2), c)
    inside = pm.estimate([0, 1, 2, 3, 4, 5, 6, 7])
    across = pm.estimate([0, 1, 4, 5, 2, 3, 6, 7])
    assert across.breakdown["tp_comm"] > inside.breakdown["tp_comm"]


def test_bubble_fraction_shrinks_with_more_microbatches() -> None:
    c = cluster()
    fractions = []
    for gb in (8, 32, 128):
        tr = TrainingSpec(global_batch=gb, seq_len=2048)
        est = estimate_perf(MODEL, tr, cfg(pp=4, global_batch=gb), c)
        fractions.append(est.breakdown["bubble"] / est.step_time)
    assert fractions[0] > fractions[1] > fractions[2] > 0


def test_bubble_matches_narayanan_for_even_stages() -> None:
    # (p - 1) / m of the ideal time when stages are even and links free (32 layers / 4).
    c = cluster(nodes=1, per_node=4, intra=1e18, inter=1e18)
    pm = PerfModel(MODEL, TRAIN, cfg(pp=4), c)
    est = pm.estimate()
    m, p = cfg(pp=4).grad_accum, 4
    # The last stage also holds the LM head, so the bubble is at least (p-1)/m of compute.
    assert est.breakdown["bubble"] >= (p - 1) / m * est.breakdown["compute"] * 0.5


def test_interleaving_lowers_the_bubble() -> None:
    c = cluster()
    plain = estimate_perf(MODEL, TRAIN, cfg(pp=4), c)
    inter = estimate_perf(MODEL, TRAIN, cfg(pp=4, schedule="interleaved", virtual_stages=2), c)
    assert inter.breakdown["bubble"] < plain.breakdown["bubble"]
    assert inter.breakdown["pp_comm"] > plain.breakdown["pp_comm"]


def test_a_slow_link_in_the_dp_ring_raises_dp_comm() -> None:
    c = cluster(nodes=1, per_node=8)
    config = cfg(dp=8, mbs=8)
    fast = estimate_perf(MODEL, TRAIN, config, c)
    slow = estimate_perf(MODEL, TRAIN, config, with_slow_link(c, 3, 4, 1 * GB))
    assert slow.breakdown["dp_comm"] > 2 * fast.breakdown["dp_comm"]
    assert slow.breakdown["compute"] == fast.breakdown["compute"]


def test_lora_is_faster_than_full_finetuning() -> None:
    lora = TrainingSpec(global_batch=64, seq_len=2048, method="lora", lora=LoraSpec(rank=16))
    c = cluster()
    full = estimate_perf(MODEL, TRAIN, cfg(dp=8, mbs=2), c)
    adapters = estimate_perf(MODEL, lora, cfg(dp=8, mbs=2), c)
    assert adapters.step_time < full.step_time
    assert adapters.breakdown["dp_comm"] < full.breakdown["dp_comm"]
    assert adapters.breakdown["optimizer"] < full.breakdown["optimizer"]


def test_zero3_adds_parameter_gathers() -> None:
    c = cluster(inter=5 * GB)
    z1 = estimate_perf(MODEL, TRAIN, cfg(dp=16, zero_stage=1), c)
    z3 = estimate_perf(MODEL, TRAIN, cfg(dp=16, zero_stage=3), c)
    assert z1.breakdown["zero3_gather"] == 0.0
    assert z3.breakdown["zero3_gather"] > 0.0
    assert z3.step_time > z1.step_time


def test_zero1_shards_the_optimizer_step() -> None:
    c = cluster()
    z0 = estimate_perf(MODEL, TRAIN, cfg(dp=16, zero_stage=0), c)
    z1 = estimate_perf(MODEL, TRAIN, cfg(dp=16, zero_stage=1), c)
    assert z1.breakdown["optimizer"] == pytest.approx(z0.breakdown["optimizer"] / 16)


def test_full_recompute_costs_an_extra_forward() -> None:
    c = cluster()
    none = estimate_perf(MODEL, TRAIN, cfg(tp=2, dp=8), c)
    sel = estimate_perf(MODEL, TRAIN, cfg(tp=2, dp=8, recompute="selective"), c)
    full = estimate_perf(MODEL, TRAIN, cfg(tp=2, dp=8, recompute="full"), c)
    assert none.breakdown["compute"] < sel.breakdown["compute"] < full.breakdown["compute"]
    assert full.breakdown["tp_comm"] == pytest.approx(none.breakdown["tp_comm"] * 1.5, rel=0.05)


def test_placement_changes_communication_only() -> None:
    c = with_slow_link(cluster(nodes=2, per_node=4, inter=10 * GB), 0, 1, 1 * GB)
    pm = PerfModel(MODEL, TRAIN, cfg(tp=2, pp=2, dp=2), c)
    a = pm.estimate([0, 1, 2, 3, 4, 5, 6, 7])
    b = pm.estimate([7, 2, 6, 3, 5, 0, 4, 1])
    for part in ("compute", "optimizer"):
        assert a.breakdown[part] == b.breakdown[part]
    comm_parts = ("tp_comm", "pp_comm", "dp_comm", "embedding_sync")
    assert any(a.breakdown[p] != b.breakdown[p] for p in comm_parts)


def test_none_placement_uses_the_config_placement() -> None:
    c = with_slow_link(cluster(nodes=1, per_node=4), 0, 1, 1 * GB)
    placed = cfg(tp=2, dp=2).with_placement((0, 2, 1, 3))
    pm = PerfModel(MODEL, TRAIN, placed, c)
    assert pm.step_time() == pm.step_time([0, 2, 1, 3])
    assert pm.step_time() != pm.step_time([0, 1, 2, 3])


def test_bad_placement_raises_spec_error() -> None:
    pm = PerfModel(MODEL, TRAIN, cfg(dp=4), cluster(nodes=1, per_node=4))
    with pytest.raises(SpecError):
        pm.step_time([0, 1, 2])
    with pytest.raises(SpecError):
        pm.step_time([0, 1, 2, 9])


def test_too_few_devices_raises_spec_error() -> None:
    with pytest.raises(SpecError):
        PerfModel(MODEL, TRAIN, cfg(dp=32), cluster())


def test_cpu_devices_get_finite_predictions() -> None:
    tiny = ModelSpec.preset("tiny-llama")
    tr = TrainingSpec(global_batch=8, seq_len=128, dtype="fp32")
    c = homogeneous_cluster(cpu_device(4 * 2**30), 1, 4, 2 * GB, 2 * GB)
    for config in (cfg(dp=4, global_batch=8), cfg(tp=2, pp=2, global_batch=8, zero_stage=0)):
        est = estimate_perf(tiny, tr, config, c)
        assert math.isfinite(est.step_time) and est.step_time > 0
        assert all(math.isfinite(v) for v in est.breakdown.values())


def test_an_unprobed_cpu_device_is_not_given_a_gpus_efficiency_curve() -> None:
    # a cluster file's `preset: cpu` before any probe: one thread's fp32 matmul reaches half
    # its best rate at a 45^3 GEMM (tests/benchmarks/cpu_gemm.py), a GPU at 1.27e10 FLOPs
    curve = default_curve(cpu_device(2**30))
    assert float(curve(2 * 64**3)) > 0.5  # measured: 0.66-0.71 of the best rate (two runs)
    assert float(curve(2 * 16**3)) < 0.1  # measured: 0.04-0.05
    # the tiny Llama of the examples, 8 x 64 tokens on 4 CPU workers: its HF Trainer trials
    # measured 0.08-0.09 s a step on a 2-core machine (4 ranks on 2 cores, the frameworks'
    # overhead); the GPU curve said 290 s
    tiny = ModelSpec.preset("tiny-llama")
    tr = TrainingSpec(global_batch=8, seq_len=64, dtype="fp32")
    c = homogeneous_cluster(cpu_device(5 * 2**30), 1, 4, 2 * GB, 2 * GB)
    assert 0.003 < estimate_perf(tiny, tr, cfg(dp=4, global_batch=8, mbs=2), c).step_time < 1.0


def test_efficiency_curve_saturates_and_uses_measured_points() -> None:
    curve = EfficiencyCurve(0.8, 1e9)
    small, half, big = curve(np.array([1e7, 1e9, 1e13]))
    assert small < half < big < 0.8
    assert half == pytest.approx(0.4)
    measured = EfficiencyCurve(0.8, 1e9, points=((1e9, 0.3), (1e11, 0.6)))
    assert float(measured(1e10)) == pytest.approx(0.45)
    assert 0 < float(default_curve(cpu_device(2**30))(1e9)) <= 1


def test_tp_across_nodes_is_dragged_by_one_slow_nic_link() -> None:
    # Two 8-GPU nodes: a TP group of 16 crosses the cut on 8 channels; one slow
    # inter-node link sets the pace of all channels of its node (DESIGN: a slow link
    # slows the group that uses it).
    c = cluster(nodes=2, per_node=8, intra=300 * GB, inter=25 * GB)
    wide = PerfModel(MODEL, TRAIN, cfg(tp=16), c).estimate().breakdown["tp_comm"]
    slow = with_slow_link(c, 7, 15, 1 * GB)
    assert PerfModel(MODEL, TRAIN, cfg(tp=16), slow).estimate().breakdown["tp_comm"] > wide


def test_megatrons_interleaved_schedule_waits_only_on_its_warmup_and_flush_hops() -> None:
    """Megatron-Core overlaps an interleaved schedule's pipeline hops with the next chunk's compute
    (``overlap_p2p_comm``, Megatron-LM's default with virtual stages); the warmup's and the flush's hops
    still block: 2 (p - 1) + (v - 1) p of the m v chunks a pass (p 4, v 2, m 16: 10 of 32)."""
    c = cluster(inter=5 * GB)  # a slow inter-node link, so the hops weigh
    inter = cfg(pp=4, dp=4, schedule="interleaved", virtual_stages=2)  # 64 / 4 = 16 micro-batches a pipeline
    on = PerfModel(MODEL, TRAIN, inter, c, constants=MEGATRON_CONSTANTS).estimate().breakdown
    off = PerfModel(MODEL, TRAIN, inter, c, constants=replace(MEGATRON_CONSTANTS, overlap_p2p_comm=False)).estimate()
    assert MEGATRON_CONSTANTS.overlap_p2p_comm
    assert on["pp_comm"] == pytest.approx(off.breakdown["pp_comm"] * 10 / 32, rel=0.05)
    plain = cfg(pp=4, dp=4)  # 1F1B without virtual stages: Megatron-LM turns the overlap off
    assert PerfModel(MODEL, TRAIN, plain, c, constants=MEGATRON_CONSTANTS).step_time() == pytest.approx(
        PerfModel(MODEL, TRAIN, plain, c, constants=replace(MEGATRON_CONSTANTS, overlap_p2p_comm=False)).step_time())
