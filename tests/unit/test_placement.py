"""Rank placement: the topology-aware default, the two-level shortcut and the annealing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pipette import comm
from pipette.cluster import ClusterProfile
from pipette.clusterfile import cluster_from_dict, homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.placement import (
    _greedy_placement,
    default_placement,
    naive_placement,
    optimize_placement,
)

GBs = 1e9


def _cluster(nodes: int, per_node: int, slow_links: list[dict[str, Any]] | None = None,
             inter: str = "50 GB/s") -> ClusterProfile:
    return cluster_from_dict({
        "device": "H100-80GB", "nodes": nodes, "devices_per_node": per_node,
        "intra_node": {"bandwidth": "450 GB/s", "latency": "3 us"},
        "inter_node": {"bandwidth": inter, "latency": "10 us"},
        "slow_links": slow_links or [],
    })


def _config(tp: int, pp: int, dp: int) -> ParallelConfig:
    return ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=1, global_batch=dp)


def _comm_cost(config: ParallelConfig, cluster: ClusterProfile, tp_bytes: float = 1e9,
               dp_bytes: float = 2e9, pp_bytes: float = 1e8) -> Callable[[Any], float]:
    """The perf model's comm terms: slowest TP clique all-reduce, slowest DP ring
    all-reduce, and per pipeline boundary its slowest send."""
    def cost(placement: Any) -> float:
        mesh = config.layout
        t = 0.0
        if config.tp > 1:
            bw, lat = comm.clique_links(cluster, comm.device_groups(mesh, placement, "tp"))
            t += float(comm.allreduce_time(tp_bytes, config.tp, bw, lat).max())
        if config.dp > 1:
            bw, lat = comm.ring_links(cluster, comm.device_groups(mesh, placement, "dp"))
            t += float(comm.allreduce_time(dp_bytes, config.dp, bw, lat).max())
        if config.pp > 1:
            chains = comm.device_groups(mesh, placement, "pp")
            bw, lat = comm.pair_links(cluster, chains[:, :-1], chains[:, 1:])
            t += float(comm.p2p_time(pp_bytes, bw, lat).max(axis=0).sum())
        return t
    return cost


def _assert_placement(placement: tuple[int, ...], config: ParallelConfig, cluster: ClusterProfile) -> None:
    assert len(placement) == config.world
    assert len(set(placement)) == config.world
    assert all(isinstance(d, int) and 0 <= d < cluster.world for d in placement)


SLOW_DEVICE_1 = [{"devices": [1, j], "factor": 10} for j in range(8) if j != 1]
TWO_RACKS = _cluster(4, 8, [
    {"nodes": [0, 2], "factor": 2.5, "latency": "15 us"},
    {"nodes": [1, 3], "factor": 2.5, "latency": "15 us"},
    {"nodes": [2, 3], "factor": 4},
    {"devices": [8, 12], "factor": 4},
    {"devices": [9, 13], "factor": 4},
])


def test_naive_is_rank_order() -> None:
    assert naive_placement(_config(2, 2, 2)) == tuple(range(8))


@pytest.mark.parametrize("cluster", [
    _cluster(2, 4), _cluster(2, 4, [{"devices": [0, 1], "factor": 8}]), _cluster(2, 4, SLOW_DEVICE_1),
    TWO_RACKS,
], ids=["two-level", "slow-pair", "slow-device", "two-racks"])
@pytest.mark.parametrize("degrees", [(2, 2, 2), (4, 1, 2), (1, 2, 4), (2, 1, 2), (1, 1, 3), (4, 2, 1)])
def test_every_result_is_a_permutation_of_distinct_devices(
    cluster: ClusterProfile, degrees: tuple[int, int, int]
) -> None:
    config = _config(*degrees)
    _assert_placement(default_placement(config, cluster), config, cluster)
    result = optimize_placement(config, cluster, _comm_cost(config, cluster), max_evaluations=300)
    _assert_placement(result.placement, config, cluster)
    assert result.cost <= result.default_cost


@pytest.mark.parametrize(("cluster", "degrees"), [
    (cluster, degrees)
    for cluster in (_cluster(4, 8), TWO_RACKS, _cluster(2, 4, SLOW_DEVICE_1))
    for degrees in ((2, 2, 4), (4, 2, 2), (8, 2, 1), (4, 1, 2), (2, 1, 1))
    if degrees[0] <= len(cluster.devices_on(0)) and np.prod(degrees) <= cluster.world
])
def test_default_keeps_each_tp_group_inside_one_node(
    cluster: ClusterProfile, degrees: tuple[int, int, int]
) -> None:
    # tp divides every node's device count in all these cases.
    config = _config(*degrees)
    nodes = cluster.node_of[comm.device_groups(config.layout, default_placement(config, cluster), "tp")]
    assert np.all(nodes == nodes[:, :1])


def test_default_builds_tp_cliques_around_a_slow_pair() -> None:
    cluster = _cluster(2, 4, [{"devices": [0, 1], "factor": 8}])
    config = _config(2, 2, 2)
    groups = comm.device_groups(config.layout, default_placement(config, cluster), "tp")
    assert not any({0, 1} <= set(g.tolist()) for g in groups)
    nodes = cluster.node_of[groups]
    assert np.all(nodes == nodes[:, :1])


def test_the_greedy_returns_whole_nodes_in_rank_order_on_a_two_level_cluster() -> None:
    # default_placement skips the greedy on two-level clusters because of this.
    for cluster in (_cluster(2, 4), _cluster(4, 8), _cluster(3, 2)):
        for degrees in [(1, 1, 2), (2, 2, 2), (4, 2, 1), (2, 1, 4), (1, 4, 2), (2, 3, 1)]:
            config = _config(*degrees)
            if config.world <= cluster.world:
                assert _greedy_placement(config, cluster) == default_placement(config, cluster)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_slow_intra_link_beats_naive_and_never_loses_to_default(seed: int) -> None:
    cluster = _cluster(2, 4, [{"devices": [0, 1], "factor": 8}, {"devices": [2, 3], "factor": 8}])
    config = _config(2, 2, 2)
    cost = _comm_cost(config, cluster)
    result = optimize_placement(config, cluster, cost, seed=seed)
    naive = cost(np.array(naive_placement(config)))
    assert result.cost < naive
    assert result.cost <= result.default_cost
    assert result.cost == pytest.approx(cost(np.array(result.placement)))
    assert result.default_cost == pytest.approx(cost(np.array(default_placement(config, cluster))))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_slow_link_between_nodes_is_avoided_by_annealing(seed: int) -> None:
    # Rank t of one TP group talks to rank t of the other: naive and default both pair
    # devices 0 and 4, whose link is slow; only reordering inside a group avoids it.
    cluster = _cluster(2, 4, [{"devices": [0, 4], "factor": 10}])
    config = _config(4, 2, 1)
    cost = _comm_cost(config, cluster)
    result = optimize_placement(config, cluster, cost, seed=seed)
    assert result.method == "annealing"
    assert result.cost < result.default_cost
    assert result.cost < cost(np.array(naive_placement(config)))
    _assert_placement(result.placement, config, cluster)


def test_same_seed_same_answer() -> None:
    config = _config(4, 2, 2)
    cost = _comm_cost(config, TWO_RACKS)
    a = optimize_placement(config, TWO_RACKS, cost, seed=7, max_evaluations=400)
    b = optimize_placement(config, TWO_RACKS, cost, seed=7, max_evaluations=400)
    assert a == b


def test_annealing_stays_within_its_budget() -> None:
    config = _config(4, 2, 2)
    result = optimize_placement(config, TWO_RACKS, _comm_cost(config, TWO_RACKS), max_evaluations=50)
    assert result.evaluations <= 50


def test_fewer_ranks_than_devices_drop_the_slow_device() -> None:
    cluster = _cluster(2, 4, SLOW_DEVICE_1)
    config = _config(2, 1, 2)
    cost = _comm_cost(config, cluster)
    assert 1 not in default_placement(config, cluster)
    result = optimize_placement(config, cluster, cost)
    assert 1 not in result.placement
    assert result.cost < cost(np.array(naive_placement(config)))


def test_fewer_ranks_than_devices_avoid_the_slow_node_pair() -> None:
    cluster = _cluster(3, 4, [{"nodes": [0, 1], "bandwidth": "5 GB/s"}])
    config = _config(4, 1, 2)
    nodes = set(cluster.node_of[list(default_placement(config, cluster))].tolist())
    assert len(nodes) == 2 and 2 in nodes


def test_fewer_ranks_than_a_node_stay_in_one_node() -> None:
    cluster = _cluster(2, 8)
    config = _config(2, 1, 2)
    result = optimize_placement(config, cluster, _comm_cost(config, cluster))
    assert len(set(cluster.node_of[list(result.placement)].tolist())) == 1
    assert (result.method, result.evaluations) == ("default", 1)


def test_homogeneous_matrix_returns_the_default_after_one_evaluation() -> None:
    cluster = homogeneous_cluster("H100-80GB", 4, 8, 100 * GBs, 100 * GBs, 5e-6, 5e-6)
    for degrees in [(2, 4, 4), (1, 1, 32), (8, 2, 1), (4, 2, 2)]:
        config = _config(*degrees)
        result = optimize_placement(config, cluster, _comm_cost(config, cluster))
        assert (result.method, result.evaluations) == ("default", 1)
        assert result.cost == result.default_cost


def test_two_level_cluster_with_tp_filling_a_node_needs_no_search() -> None:
    cluster = _cluster(16, 8)
    config = _config(8, 4, 4)
    result = optimize_placement(config, cluster, _comm_cost(config, cluster))
    assert (result.method, result.evaluations) == ("default", 1)
    assert result.placement == default_placement(config, cluster)


def test_two_level_cluster_compares_only_whole_node_tilings() -> None:
    # Four TP groups fit in a node: 1x4, 2x2 or 4x1 blocks of stages x replicas.
    cluster = _cluster(8, 8)
    config = _config(2, 4, 4)
    dp_heavy = optimize_placement(config, cluster, _comm_cost(config, cluster, dp_bytes=1e10, pp_bytes=1e6))
    assert (dp_heavy.method, dp_heavy.evaluations) == ("default", 3)
    pp_heavy = optimize_placement(config, cluster, _comm_cost(config, cluster, dp_bytes=1e6, pp_bytes=1e10))
    assert pp_heavy.method == "layout"
    assert pp_heavy.evaluations == 3
    assert pp_heavy.cost < pp_heavy.default_cost
    tp_nodes = cluster.node_of[comm.device_groups(config.layout, pp_heavy.placement, "tp")]
    assert np.all(tp_nodes == tp_nodes[:, :1])
    chains = cluster.node_of[comm.device_groups(config.layout, pp_heavy.placement, "pp")]
    assert np.all(chains == chains[:, :1])  # every pipeline inside one node


def test_nan_cost_counts_as_slowest() -> None:
    config = _config(2, 2, 2)
    cluster = _cluster(2, 4, [{"devices": [0, 1], "factor": 8}])
    base = _comm_cost(config, cluster)

    def cost(p: Any) -> float:
        return float("nan") if p[0] == 0 else base(p)

    result = optimize_placement(config, cluster, cost, max_evaluations=300)
    assert result.placement[0] != 0 or np.isinf(result.cost)
    assert not np.isnan(result.cost)


def test_too_many_ranks_or_no_budget_are_spec_errors() -> None:
    cluster = _cluster(1, 4)
    config = _config(2, 2, 2)
    with pytest.raises(SpecError) as e:
        default_placement(config, cluster)
    assert e.value.field == "config"
    with pytest.raises(SpecError) as e:
        optimize_placement(_config(2, 1, 2), cluster, lambda p: 1.0, max_evaluations=0)
    assert e.value.field == "max_evaluations"


@pytest.mark.parametrize("degrees", [(4, 2, 4), (2, 4, 4)])
def test_real_perf_model_step_time_is_never_worse_than_the_default(degrees: tuple[int, int, int]) -> None:
    from pipette.model import ModelSpec
    from pipette.perf import PerfModel
    from pipette.training import TrainingSpec

    config = ParallelConfig(tp=degrees[0], pp=degrees[1], dp=degrees[2], mbs=1, global_batch=64)
    perf = PerfModel(ModelSpec.preset("llama2-13b"), TrainingSpec(global_batch=64, seq_len=4096),
                     config, TWO_RACKS)
    result = optimize_placement(config, TWO_RACKS, perf.step_time, max_evaluations=500)
    assert result.method == "annealing"
    assert result.cost <= result.default_cost
    assert result.default_cost == pytest.approx(perf.step_time(default_placement(config, TWO_RACKS)))
    assert result.cost == pytest.approx(perf.step_time(result.placement))
    assert result.cost <= perf.step_time(naive_placement(config))
    _assert_placement(result.placement, config, TWO_RACKS)
