"""Measure a cluster: its devices (NVML, or CPU worker processes without a GPU), the link
matrix between every pair of devices, and each device's matmul throughput. The result is a
``ClusterProfile`` with ``method="measured"`` and when it was measured.

Inventory runs as one Ray task per node (NVML: name, memory, free memory, PCIe topology and
NVLink peers of every GPU); the link and compute probe as one fresh process per device
(``workers.rank.probe``), placed like trial ranks: on GPU nodes each holds one Ray ``GPU``
and measures with NCCL on it, on CPU nodes with gloo on the host. The profile records which
backend and device measured each figure (``extra["measured_by"]``) and what joins each pair
of devices (``extra["link_kind"]``: ``nvlink``, a PCIe path, ``network`` across nodes).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipette.cluster import ClusterProfile, Device, Node
from pipette.contract import PROBE_ENTRY
from pipette.device import DeviceSpec
from pipette.errors import PipetteError
from pipette.model import ModelSpec
from workers.host.monitor import Finished, run_ranks
from workers.host.outcome import Outcome
from workers.host.ray_cluster import alive_nodes, ensure_ray, node_gpus
from workers.host.ray_transport import RayTransport
from workers.host.transport import Launch, Transport
from workers.probe_plan import SIZES, probe_shapes

log = logging.getLogger("pipette.workers")


def inventory(cpu_devices: int) -> dict[str, Any]:
    """This node's devices: GPUs through NVML, else ``cpu_devices`` workers sharing the RAM.

    No NVML library (``NVMLError_LibraryNotFound``: no GPU driver installed) or no loaded
    driver means no GPU, so the node's CPU is profiled instead, and ``nvml`` says why. Any
    other NVML error is a GPU node that cannot be read, which is an error, not a CPU node."""
    import socket

    host = {"name": socket.gethostname(), "address": ray.util.get_node_ip_address()}
    try:
        import pynvml
    except ImportError as e:
        return host | {"kind": "cpu", "devices": _cpu_devices(cpu_devices), "nvml": f"ImportError: {e}"}
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as e:
        return host | {"kind": "cpu", "devices": _cpu_devices(cpu_devices), "nvml": type(e).__name__}
    except pynvml.NVMLError as e:
        raise PipetteError(
            f"NVML failed on {host['name']}: {type(e).__name__} ({e})", field="cluster",
            fix="check the GPU driver on that node (nvidia-smi)",
        ) from None
    try:
        devices = []
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return host | {"kind": "cpu", "devices": _cpu_devices(cpu_devices), "nvml": "no GPU (device count 0)"}
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for i, h in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            topo = [int(pynvml.nvmlDeviceGetTopologyCommonAncestor(h, o)) if o is not h else 0 for o in handles]
            name = pynvml.nvmlDeviceGetName(h)
            devices.append({"local_index": i, "name": name if isinstance(name, str) else name.decode(),
                            "memory": int(mem.total), "free": int(mem.free), "topology": topo,
                            "bus_id": _bus_id(pynvml.nvmlDeviceGetPciInfo(h)), **_nvlinks(pynvml, h)})
        return host | {"kind": "gpu", "devices": devices}
    finally:
        pynvml.nvmlShutdown()


def _bus_id(pci: Any) -> str:
    bus = pci.busId
    return (bus if isinstance(bus, str) else bus.decode()).lower()


def _nvlinks(pynvml: Any, handle: Any) -> dict[str, Any]:
    """The GPU's active NVLinks: the bus ids of the GPUs they reach, and whether they go to an
    NVSwitch (then every GPU on the fabric is one NVLink hop away). A GPU without NVLink, or
    a driver that cannot say, has none."""
    peers: set[str] = set()
    switch = False
    for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except pynvml.NVMLError:
            continue
        try:
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            switch = switch or kind == getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        except (pynvml.NVMLError, AttributeError):
            pass
        peers.add(_bus_id(remote))
    return {"nvlink_peers": sorted(peers), "nvswitch": switch}


def _cpu_devices(n: int) -> list[dict[str, Any]]:
    page = os.sysconf("SC_PAGE_SIZE")
    total, free = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    return [{"local_index": i, "name": "cpu", "memory": total // n, "free": free // n} for i in range(n)]


def probe_cluster(
    name: str = "measured",
    cpu_devices_per_node: int = 4,
    model: ModelSpec | None = None,
    seq_len: int = 512,
    timeout_s: float = 120.0,
) -> ClusterProfile:
    """Measure every node Ray sees (``RAY_ADDRESS``, or a local Ray)."""
    started = time.monotonic()
    ensure_ray()
    nodes = alive_nodes()
    inventory_task = ray.remote(num_cpus=0)(inventory)
    found = ray.get([
        inventory_task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(cpu_devices_per_node)
        for n in nodes
    ], timeout=timeout_s)
    found, without_gpus = training_nodes(found)
    slots = [(i, d) for i, node in enumerate(found) for d in node["devices"]]
    device_kind = "gpu" if found and found[0]["kind"] == "gpu" else "cpu"
    options = {"shapes": probe_shapes(device_kind, model, seq_len), "device_kind": device_kind}
    ranks = _run_probe(found, slots, options, timeout_s)
    profile = _profile(name, found, slots, ranks, time.monotonic() - started)
    if without_gpus:
        profile.extra["nodes_without_gpus"] = [f"{f['name']} ({f['address']})" for f in without_gpus]
    return profile


def training_nodes(found: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The nodes whose devices train, and the others: on a cluster with GPUs, only the GPU
    nodes (a CPU-only Ray head, as KubeRay and most clusters run it, is no training device);
    on a CPU-only cluster, every node."""
    if any(f["kind"] == "gpu" for f in found):
        return [f for f in found if f["kind"] == "gpu"], [f for f in found if f["kind"] != "gpu"]
    return found, []


#: The rendezvous port is picked free on rank 0's node and bound by rank 0 a moment later: another
#: process on the node can take it in between (seen with two test workers starting ranks at once).
#: The probe is one run with no retry around it, so it starts again on a new port.
PORT_TAKEN = "Address already in use"
PORT_RACE_ATTEMPTS = 3


def _run_probe(
    found: list[dict[str, Any]], slots: list[tuple[int, dict[str, Any]]], options: dict[str, Any], timeout_s: float
) -> list[dict[str, Any]]:
    gpu = options.get("device_kind") == "gpu"
    for node in found:
        have = node_gpus(node["address"])
        if gpu and have < len(node["devices"]):
            raise PipetteError(
                f"NVML shows {len(node['devices'])} GPU(s) on {node['name']} ({node['address']}), Ray has {have}",
                field="cluster", fix="start Ray on that node with its GPUs (ray start --num-gpus N)",
            )
    for attempt in range(1, PORT_RACE_ATTEMPTS + 1):
        transport = RayTransport([(n, int(d["local_index"])) for n, d in slots], [f["address"] for f in found],
                                 "gpu" if gpu else "cpu", zygote=False)
        kind = ProbeRun(len(slots), options)
        try:
            watched = run_ranks(transport, kind, timeout_s)
        finally:
            transport.close()
        if not (watched.outcome.status != "ok" and PORT_TAKEN in watched.outcome.error):
            break
        log.info("the probe's rendezvous port was taken before rank 0 bound it (attempt %d of %d): again on "
                 "a new port", attempt, PORT_RACE_ATTEMPTS)
    if watched.outcome.status == "timeout":
        raise PipetteError(f"the probe ran past {timeout_s:g} s", fix="raise the timeout or check the network")
    if watched.outcome.status != "ok" or kind.ranks is None:
        raise PipetteError(f"the probe failed: {watched.outcome.error[-2000:]}", field="cluster",
                           fix="look at the probe rank's output above; rerun with PIPETTE_LOG=debug")
    return kind.ranks


class ProbeRun:
    """The probe as a kind of run (``workers.host.monitor``): every rank measures its device and
    links, rank 0 reports them all (``done``) and the run is over."""

    def __init__(self, world: int, options: dict[str, Any]) -> None:
        self.world, self.options = world, options
        self.ranks: list[dict[str, Any]] | None = None

    def launch(self, transport: Transport) -> Launch:
        return Launch({}, [sys.executable, "-m", PROBE_ENTRY], {"PIPETTE_PROBE": json.dumps(self.options)})

    def take(self, rank: int, event: dict[str, Any]) -> dict[str, Any] | None:
        if rank == 0 and event.get("event") == "done":
            self.ranks = list(event["ranks"])
        return None

    def failure(self) -> Outcome | None:
        return None

    def ended(self, rank: int) -> bool:
        return False

    def finished(self, codes: dict[int, int]) -> Finished:
        return "yes" if self.ranks is not None else "no"

    def exit_failure(self, head: str, tail: str) -> Outcome | None:
        return None

    def all_exited(self) -> Outcome:
        return Outcome("failed", "the probe's ranks exited without reporting what they measured")

    def timed_out(self, timeout_s: float, behind: str | None, last_step: int | None,
                  tail: Callable[[], str]) -> Outcome:
        return Outcome("timeout", f"the probe ran past {timeout_s:g} s")


def _profile(
    name: str, found: list[dict[str, Any]], slots: list[tuple[int, dict[str, Any]]],
    ranks: list[dict[str, Any]], elapsed: float,
) -> ClusterProfile:
    n = len(slots)
    bandwidth, latency = np.zeros((n, n)), np.zeros((n, n))
    (s1, s2) = ranks[0].get("message_sizes", SIZES)
    for r in ranks:
        for peer, (t1, t2) in r["links"].items():
            j = int(peer)
            # t(S) = alpha + S / beta, from the two sizes (Hockney's model).
            # When noise makes the large message no slower than the small one (busy cores), the
            # slope is meaningless: fall back to the bound S2 / t2 for beta and t1 for alpha.
            beta = (s2 - s1) / (t2 - t1) if t2 > 1.05 * t1 else s2 / t2
            alpha = max(t1 - s1 / beta, 0.0) if t2 > 1.05 * t1 else t1
            for a, b in ((r["rank"], j), (j, r["rank"])):
                bandwidth[a, b], latency[a, b] = beta, alpha
    devices = []
    for index, ((node, dev), r) in enumerate(zip(slots, sorted(ranks, key=lambda x: x["rank"]), strict=True)):
        peaks = {dtype: max(p[3] for p in points) for dtype, points in r["matmul"].items()}
        gpu = found[node]["kind"] == "gpu"
        # The curve of the dtype the device trains in: bf16 tensor cores on a GPU, fp32 on a CPU.
        curve = "bf16" if gpu and "bf16" in peaks else "fp32"
        efficiency = tuple((2.0 * m * k * nn, f / peaks[curve]) for m, k, nn, f in r["matmul"][curve])
        spec = DeviceSpec(
            name=dev["name"], memory_bytes=int(dev["memory"]), peak_flops=peaks,
            memory_bandwidth=float(r["copy_bandwidth"]), kind="gpu" if gpu else "cpu",
            efficiency=efficiency,
        )
        devices.append(Device(index=index, node=node, local_index=int(dev["local_index"]), spec=spec,
                              free_memory=int(dev["free"])))
    return ClusterProfile(
        name=name,
        nodes=tuple(Node(name=f["name"], address=f["address"]) for f in found),
        devices=tuple(devices),
        bandwidth=bandwidth,
        latency=latency,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        method="measured",
        extra={"probe_s": elapsed, "matmul": [r["matmul"] for r in ranks], "message_sizes": [s1, s2],
               "nvml": [f.get("nvml") for f in found],
               # which backend and which device measured the figures, rank by rank
               "measured_by": [{"rank": r["rank"], "backend": r.get("backend"), "device": r.get("device"),
                                "device_name": r.get("device_name", dev["name"])}
                               for r, (_, dev) in zip(sorted(ranks, key=lambda x: x["rank"]), slots, strict=True)],
               "link_kind": link_kinds(found, slots)},
    )


def link_kinds(found: list[dict[str, Any]], slots: list[tuple[int, dict[str, Any]]]) -> list[list[str]]:
    """What joins each pair of devices: ``network`` across nodes; inside a GPU node ``nvlink``
    (NVML saw an NVLink between the two, or both on one NVSwitch fabric) or the PCIe path NVML
    reports (``pcie-switch``, ``pcie-host-bridge``, ``pcie-numa``, ``pcie-system``); ``host``
    between CPU devices of one node; ``self`` on the diagonal."""
    n = len(slots)
    out = [["self"] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            (na, da), (nb, db) = slots[a], slots[b]
            if na != nb:
                out[a][b] = "network"
            elif found[na]["kind"] != "gpu":
                out[a][b] = "host"
            else:
                out[a][b] = gpu_link(da, db)
    return out


#: NVML topology levels (nvmlGpuTopologyLevel_t) -> the PCIe path they name
_PCIE_LEVELS = {0: "same-board", 10: "pcie-switch", 20: "pcie-switch", 30: "pcie-host-bridge", 40: "pcie-numa",
                50: "pcie-system"}


def gpu_link(a: dict[str, Any], b: dict[str, Any]) -> str:
    if a.get("nvswitch") and b.get("nvswitch"):
        return "nvlink"
    if b.get("bus_id") and b["bus_id"] in (a.get("nvlink_peers") or ()):
        return "nvlink"
    topology = a.get("topology") or []
    level = topology[int(b["local_index"])] if int(b["local_index"]) < len(topology) else None
    return _PCIE_LEVELS.get(int(level), "pcie") if level is not None else "pcie"
