"""Ray: connect to ``RAY_ADDRESS`` or start a small local instance, and find the Ray node of
each node of a ``ClusterProfile``."""

from __future__ import annotations

import os
from typing import Any

import ray

from pipette.cluster import ClusterProfile
from pipette.errors import PipetteError


def ensure_ray(num_cpus: int | None = None) -> None:
    """Connect once per process. Locally, Ray picks free ports (6379 may be another service's)
    and gets a small object store, so it starts in seconds."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return
    ray.init(
        address="local",
        num_cpus=num_cpus or max(8, os.cpu_count() or 1),
        object_store_memory=200 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
    )


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's live nodes, the head first, then by address."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    head = "node:__internal_head__"
    return sorted(nodes, key=lambda n: (not n.get("Resources", {}).get(head), n["NodeManagerAddress"]))


def ray_node_ips(cluster: ClusterProfile) -> list[str]:
    """The Ray node address of each cluster node: by address or name when Ray has it, else in order."""
    nodes = alive_nodes()
    by_ip = {n["NodeManagerAddress"]: n for n in nodes}
    by_name = {n.get("NodeName", ""): n for n in nodes}
    out: list[str] = []
    spare = [n["NodeManagerAddress"] for n in nodes]
    for node in cluster.nodes:
        hit = by_ip.get(node.address) or by_ip.get(node.name) or by_name.get(node.name)
        out.append(hit["NodeManagerAddress"] if hit else "")
    for i, ip in enumerate(out):
        if ip:
            continue
        unused = [s for s in spare if s not in out]
        if not unused:
            raise PipetteError(
                f"the cluster has {len(cluster.nodes)} nodes but Ray sees {len(nodes)}",
                field="cluster.nodes", fix="start Ray on every node of the cluster (RAY_ADDRESS)",
            )
        out[i] = unused[0]
    return out
