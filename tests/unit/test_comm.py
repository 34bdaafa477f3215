"""Channel-aware group bandwidth (pipette.comm.channel_links)."""

from __future__ import annotations

import numpy as np
import pytest

from pipette import comm
from pipette.cluster import ClusterProfile
from pipette.clusterfile import homogeneous_cluster

GB = 1e9
INTRA, INTER = 450 * GB, 50 * GB


def two_nodes() -> ClusterProfile:
    return homogeneous_cluster("H100-80GB", 2, 8, INTRA, INTER)


def slowed(c: ClusterProfile, i: int, j: int, bw: float) -> ClusterProfile:
    m = np.array(c.bandwidth, dtype=float)
    m[i, j] = m[j, i] = bw
    return ClusterProfile(c.name, c.nodes, c.devices, m, np.array(c.latency))


def test_group_inside_a_node_is_its_slowest_pair() -> None:
    bw, lat = comm.channel_links(two_nodes(), np.array([[0, 1, 2, 3]]))
    assert bw[0] == pytest.approx(INTRA)
    assert lat[0] >= 0


def test_spanning_group_crosses_the_cut_on_one_channel_per_member() -> None:
    c = two_nodes()
    # k members per node: k x the NIC bandwidth, capped by the intra-node links.
    assert comm.channel_links(c, np.array([[0, 8]]))[0][0] == pytest.approx(INTER)
    assert comm.channel_links(c, np.array([[0, 1, 8, 9]]))[0][0] == pytest.approx(2 * INTER)
    full = np.arange(16)[None, :]
    assert comm.channel_links(c, full)[0][0] == pytest.approx(min(8 * INTER, INTRA))
    assert comm.channel_links(c, full, 0.5)[0][0] == pytest.approx(4 * INTER)
    # Uneven split: the node with fewer members is the cut's bottleneck.
    assert comm.channel_links(c, np.array([[0, 1, 2, 8]]))[0][0] == pytest.approx(INTER)


def test_a_slow_link_still_drags_its_group_down() -> None:
    c = two_nodes()
    group = np.array([[0, 1, 8, 9]])
    base = comm.channel_links(c, group)[0][0]
    assert comm.channel_links(slowed(c, 1, 8, 5 * GB), group)[0][0] == pytest.approx(2 * 5 * GB)
    assert comm.channel_links(slowed(c, 0, 1, 20 * GB), group)[0][0] == pytest.approx(20 * GB)
    assert comm.channel_links(slowed(c, 1, 8, 5 * GB), group)[0][0] < base


def test_single_member_groups_are_free() -> None:
    bw, lat = comm.channel_links(two_nodes(), np.array([[3], [9]]))
    assert np.all(np.isinf(bw)) and np.all(lat == 0)
