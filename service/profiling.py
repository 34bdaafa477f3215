"""Measure a registered cluster (``workers.host.probe``) and keep the nodes and devices it may use.

The probe measures every node Ray sees and, on GPU nodes, every GPU; a cluster registered
with a list of nodes or fewer devices per node gets the matching part of that profile: the
sub-matrix of links between the kept devices, renumbered from 0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from pipette.cluster import ClusterProfile, Device
from pipette.errors import SpecError
from service.models import Cluster


def measure(cluster: Cluster) -> ClusterProfile:
    from workers.host.probe import probe_cluster

    profile = probe_cluster(name=cluster.name, cpu_devices_per_node=cluster.devices_per_node)
    return restrict(profile, cluster.nodes or [], cluster.devices_per_node)


def restrict(profile: ClusterProfile, nodes: list[dict[str, Any]], devices_per_node: int) -> ClusterProfile:
    """The part of ``profile`` on ``nodes`` (all when empty), at most ``devices`` each."""
    wanted: list[tuple[int, int]] = []  # (node index in profile, devices to keep)
    if nodes:
        for i, node in enumerate(nodes):
            found = [k for k, n in enumerate(profile.nodes)
                     if (node.get("address") and node["address"] in (n.address, n.name)) or node["name"] == n.name]
            if not found:
                seen = ", ".join(f"{n.name} ({n.address})" for n in profile.nodes)
                raise SpecError(f"node {node['name']!r} is not in the Ray cluster (it has: {seen})",
                                field=f"nodes[{i}]", fix="register the cluster with the nodes Ray reports")
            wanted.append((found[0], int(node["devices"])))
    else:
        wanted = [(k, devices_per_node) for k in range(len(profile.nodes))]
    keep: list[int] = []
    node_map: dict[int, int] = {}
    for k, count in wanted:
        on_node = profile.devices_on(k)
        if len(on_node) < count:
            raise SpecError(f"node {profile.nodes[k].name!r} has {len(on_node)} devices, {count} were asked for",
                            field="devices", fix=f"use at most {len(on_node)} devices on it")
        node_map[k] = len(node_map)
        keep.extend(on_node[:count])
    if keep == list(range(profile.world)):
        return profile
    devices = tuple(
        Device(index=i, node=node_map[profile.devices[d].node], local_index=profile.devices[d].local_index,
               spec=profile.devices[d].spec, free_memory=profile.devices[d].free_memory)
        for i, d in enumerate(keep)
    )
    index = np.array(keep)
    bandwidth = np.where(np.isinf(profile.bandwidth), 0.0, profile.bandwidth)[np.ix_(index, index)]
    return replace(
        profile, nodes=tuple(profile.nodes[k] for k in node_map), devices=devices,
        bandwidth=bandwidth, latency=profile.latency[np.ix_(index, index)],
    )
