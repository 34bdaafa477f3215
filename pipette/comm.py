"""Collective and point-to-point costs on the measured link matrix (alpha-beta model).

Ring algorithms (Thakur, Rabenseifner and Gropp 2005; Patarasuk and Yuan 2009), with
``S`` the full buffer in bytes, ``n`` the group size, ``B`` the bottleneck bandwidth and
``a`` the per-hop latency:

* all-reduce      ``2 (n-1)/n * S/B + 2 (n-1) a``
* reduce-scatter  ``(n-1)/n * S/B + (n-1) a``   (and all-gather, its mirror)
* send/recv       ``a + S/B``

A ring moves at the pace of its slowest hop, so each group is reduced to one bottleneck
bandwidth and one worst latency taken from the cluster's matrices under the placement.

Groups that span nodes (``channel_links``): NCCL splits a collective over several
channels, rings (or trees) run in parallel, each crossing a node boundary through a
different device's NIC (NCCL's rail-aligned channels: NCCL environment-variable docs,
NCCL_CROSS_NIC and NCCL_MIN_NCHANNELS; bus bandwidth as in nccl-tests doc/PERFORMANCE.md;
Jeaugey, NCCL, GTC 2019). A group with ``k`` members on a node therefore moves data across that node's cut at
``k`` times its members' inter-node bandwidth, not at one link's speed:

    B_group = min( min over intra-node pairs b_ij,
                   min over nodes N of  k_N * min_{i in N, j not in N} b_ij )

The slowest member of a node sets its node's rate (``k_N`` channels each as slow as it),
so a slow link still slows every group that uses it. Nodes joined by links as fast as their own
(an NVLink switch domain across nodes: ``ClusterProfile.link_domain_of``) count as one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pipette.cluster import ClusterProfile
from pipette.layout import Layout

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def allreduce_time(
    nbytes: float | FloatArray, n: int, bw: float | FloatArray, lat: float | FloatArray
) -> FloatArray:
    if n <= 1:
        return np.zeros_like(np.asarray(bw, dtype=np.float64))
    return np.asarray(2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * lat, dtype=np.float64)


def reduce_scatter_time(
    nbytes: float | FloatArray, n: int, bw: float | FloatArray, lat: float | FloatArray
) -> FloatArray:
    if n <= 1:
        return np.zeros_like(np.asarray(bw, dtype=np.float64))
    return np.asarray((n - 1) / n * nbytes / bw + (n - 1) * lat, dtype=np.float64)


allgather_time = reduce_scatter_time


def p2p_time(nbytes: float | FloatArray, bw: float | FloatArray, lat: float | FloatArray) -> FloatArray:
    return np.asarray(lat + nbytes / bw, dtype=np.float64)


def ring_links(cluster: ClusterProfile, groups: IntArray) -> tuple[FloatArray, FloatArray]:
    """Bottleneck bandwidth and worst latency of each ring.

    ``groups`` is ``(g, n)``: g groups of n devices, each row in ring order. Hop ``i`` goes
    from ``row[i]`` to ``row[(i + 1) % n]``. Groups of one device get infinite bandwidth.
    """
    groups = np.asarray(groups, dtype=np.int64)
    if groups.shape[1] <= 1:
        g = groups.shape[0]
        return np.full(g, np.inf), np.zeros(g)
    nxt = np.roll(groups, -1, axis=1)
    bw = cluster.bandwidth[groups, nxt].min(axis=1)
    lat = cluster.latency[groups, nxt].max(axis=1)
    return bw, lat


def clique_links(cluster: ClusterProfile, groups: IntArray) -> tuple[FloatArray, FloatArray]:
    """Slowest link and worst latency among every pair of each group.

    Used for tensor-parallel groups, whose collectives the library may route over any
    pair: the group is as fast as its slowest link (DESIGN.md, rules of the models).
    """
    groups = np.asarray(groups, dtype=np.int64)
    g, n = groups.shape
    if n <= 1:
        return np.full(g, np.inf), np.zeros(g)
    sub_bw = cluster.bandwidth[groups[:, :, None], groups[:, None, :]]
    sub_lat = cluster.latency[groups[:, :, None], groups[:, None, :]]
    return sub_bw.min(axis=(1, 2)), sub_lat.max(axis=(1, 2))


def channel_links(
    cluster: ClusterProfile, groups: IntArray, cut_fraction: float = 1.0
) -> tuple[FloatArray, FloatArray]:
    """Bottleneck bandwidth of each group with one channel per member across node cuts.

    ``groups`` is ``(g, n)``. The bandwidth is the rule of the module docstring: the
    slowest intra-node pair, and per node ``k_N`` times the slowest inter-node link of its
    members, times ``cut_fraction`` (the achieved share of the summed NIC bandwidth, a
    calibration of the caller). The latency is the worst pair's. Groups of one device get
    infinite bandwidth.
    """
    groups = np.asarray(groups, dtype=np.int64)
    g, n = groups.shape
    if n <= 1:
        return np.full(g, np.inf), np.zeros(g)
    sub_bw = cluster.bandwidth[groups[:, :, None], groups[:, None, :]]  # (g, n, n)
    sub_lat = cluster.latency[groups[:, :, None], groups[:, None, :]]
    # an NVLink domain spanning nodes (NVL72) is crossed on its switch links, not through NICs
    node = cluster.link_domain_of[groups]  # (g, n)
    same = node[:, :, None] == node[:, None, :]  # diagonal included: b_ii is inf
    intra = np.where(same, sub_bw, np.inf).min(axis=(1, 2))
    # Each member's slowest link off its node, then the slowest member of each node.
    off = np.where(same, np.inf, sub_bw).min(axis=2)  # (g, n)
    node_min = np.where(same, off[:, None, :], np.inf).min(axis=2)  # (g, n), per member's node
    k = same.sum(axis=2)  # members on each member's node
    cut = (k * node_min).min(axis=1) * cut_fraction
    return np.minimum(intra, cut), sub_lat.max(axis=(1, 2))


def pair_links(cluster: ClusterProfile, src: IntArray, dst: IntArray) -> tuple[FloatArray, FloatArray]:
    """Bandwidth and latency of each (src, dst) device pair."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    return cluster.bandwidth[src, dst], cluster.latency[src, dst]


def device_groups(layout: Layout, devices: Sequence[int] | IntArray, *names: str) -> IntArray:
    """``(g, n)``: the devices of each group along the named mesh dimensions (``Layout.group_array``:
    a ``tp`` row is one tensor-parallel group, a ``dp`` row one data-parallel ring in rank order, a
    ``pp`` row one pipeline, stage 0 first); ``devices[rank]`` runs ``rank``."""
    return np.asarray(devices, dtype=np.int64)[layout.group_array(*names)]
