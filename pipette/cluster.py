"""``ClusterProfile``: nodes, devices and the measured link matrix between every pair.

``bandwidth[i, j]`` is bytes/s and ``latency[i, j]`` seconds for a transfer from device
``i`` to device ``j``. Collectives are priced from these (``pipette.comm``): a group runs
at the speed of its slowest link, so one slow link shows up wherever it is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from pipette.device import DeviceSpec
from pipette.errors import ClusterFileError

Matrix = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Node:
    name: str
    address: str = ""
    #: the node's host memory in bytes, where FSDP2's CPU offload keeps the ranks' sharded states
    #: (``MemoryEstimate.host_bytes``); None: not known (a cluster file's ``host_memory``)
    host_memory: int | None = None


@dataclass(frozen=True)
class Device:
    """One device of the cluster. ``index`` is its row in the link matrix."""

    index: int
    node: int
    local_index: int
    spec: DeviceSpec
    free_memory: int | None = None

    @property
    def usable_memory(self) -> int:
        """What a trial may use: the measured free memory when known, else the capacity."""
        return self.free_memory if self.free_memory is not None else self.spec.memory_bytes


@dataclass(frozen=True, eq=False)
class ClusterProfile:
    name: str
    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]
    bandwidth: Matrix
    latency: Matrix
    measured_at: str | None = None
    method: str = "declared"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.devices)
        if n == 0:
            raise ClusterFileError("has no devices", field="cluster", fix="declare at least one device")
        for i, d in enumerate(self.devices):
            if d.index != i:
                raise ClusterFileError(
                    f"device {i} has index {d.index}", field="cluster.devices",
                    fix="number devices 0..n-1 in order",
                )
            if not 0 <= d.node < len(self.nodes):
                raise ClusterFileError(
                    f"device {i} is on node {d.node}, which does not exist",
                    field="cluster.devices", fix=f"use node numbers 0..{len(self.nodes) - 1}",
                )
        for label, m in (("bandwidth", self.bandwidth), ("latency", self.latency)):
            arr = np.asarray(m, dtype=np.float64)
            if arr.shape != (n, n):
                raise ClusterFileError(
                    f"is {'x'.join(map(str, arr.shape))}, but there are {n} devices",
                    field=f"cluster.links.{label}",
                    fix=f"give a square {n}x{n} matrix, one row and column per device",
                )
            off = arr[~np.eye(n, dtype=bool)]
            if not np.all(np.isfinite(off)):
                raise ClusterFileError(
                    "has a missing or infinite entry", field=f"cluster.links.{label}",
                    fix="give a finite number for every pair of devices",
                )
            if label == "bandwidth" and np.any(off <= 0):
                i, j = _first_off_diagonal(arr, lambda x: x <= 0)
                raise ClusterFileError(
                    f"bandwidth between devices {i} and {j} is {arr[i, j]:g}, not positive",
                    field="cluster.links.bandwidth", fix="every bandwidth must be above zero",
                )
            if label == "latency" and np.any(off < 0):
                i, j = _first_off_diagonal(arr, lambda x: x < 0)
                raise ClusterFileError(
                    f"latency between devices {i} and {j} is {arr[i, j]:g}, negative",
                    field="cluster.links.latency", fix="latencies must be zero or more",
                )
            arr = arr.copy()
            # The diagonal is a device talking to itself: free and instant.
            np.fill_diagonal(arr, np.inf if label == "bandwidth" else 0.0)
            arr.setflags(write=False)
            object.__setattr__(self, label, arr)

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def node_of(self) -> npt.NDArray[np.int64]:
        return np.array([d.node for d in self.devices], dtype=np.int64)

    @cached_property
    def link_domain_of(self) -> npt.NDArray[np.int64]:
        """Each device's link domain: its node, with nodes merged whose every cross link is as fast as
        the slower of the two nodes' slowest link inside (an NVLink switch domain spanning nodes, as
        the 72 GPUs of a GB200/GB300 NVL72 rack in 18 trays of 4). Collectives inside a domain run on
        its links, not through NICs (``pipette.comm.channel_links``)."""
        node = self.node_of
        count = len(self.nodes)
        inside = np.full(count, np.inf)
        for k in range(count):
            members = np.flatnonzero(node == k)
            if members.size > 1:
                sub = self.bandwidth[np.ix_(members, members)]
                inside[k] = sub[~np.eye(members.size, dtype=bool)].min()
        parent = list(range(count))

        def root(k: int) -> int:
            while parent[k] != k:
                k = parent[k]
            return k

        for a in range(count):
            for b in range(a + 1, count):
                floor = min(inside[a], inside[b])
                if not np.isfinite(floor):
                    continue
                cross = self.bandwidth[np.ix_(node == a, node == b)].min()
                if cross >= floor:
                    parent[root(b)] = root(a)
        return np.array([root(int(k)) for k in node], dtype=np.int64)

    def devices_on(self, node: int) -> list[int]:
        return [d.index for d in self.devices if d.node == node]

    @property
    def device_spec(self) -> DeviceSpec:
        """The spec of the smallest device: a candidate must fit on all of them."""
        return min((d.spec for d in self.devices), key=lambda s: s.memory_bytes)

    @property
    def min_usable_memory(self) -> int:
        return min(d.usable_memory for d in self.devices)

    @property
    def is_homogeneous_links(self) -> bool:
        n = self.world
        off = self.bandwidth[~np.eye(n, dtype=bool)]
        return bool(n < 2 or np.allclose(off, off[0]))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the full link matrix), readable back by ``pipette.clusterfile``."""
        bw = np.where(np.isinf(self.bandwidth), 0.0, self.bandwidth)
        return {
            "name": self.name,
            "measured_at": self.measured_at,
            "method": self.method,
            "nodes": [{"name": n.name, "address": n.address,
                       **({"host_memory": n.host_memory} if n.host_memory is not None else {})} for n in self.nodes],
            "devices": [
                {
                    "node": d.node,
                    "local_index": d.local_index,
                    "spec": d.spec.to_dict(),
                    "free_memory": d.free_memory,
                }
                for d in self.devices
            ],
            "links": {"bandwidth": bw.tolist(), "latency": self.latency.tolist()},
        }


def _first_off_diagonal(arr: Matrix, bad: Any) -> tuple[int, int]:
    n = arr.shape[0]
    for i in range(n):
        for j in range(n):
            if i != j and bad(arr[i, j]):
                return i, j
    return 0, 0
