"""Read a cluster file (YAML or JSON) into a ``ClusterProfile``.

Two forms, documented with examples in docs/inputs.md and ``examples/clusters/``:

* **nodes x devices**: ``nodes``, ``devices_per_node``, ``intra_node`` and ``inter_node``
  link figures, an optional ``nvlink_domain`` (consecutive nodes sharing one NVLink switch domain:
  an NVL72 rack), and optional ``slow_links`` that degrade chosen node or device pairs;
* **measured matrix**: ``links.bandwidth`` and ``links.latency`` as full n x n matrices,
  one row per device, as the probe writes them.

Quantities take units: ``"150 GB/s"``, ``"100 Gbit/s"``, ``"5 us"``, ``"80 GiB"``. A bare
number is in base units (bytes/s, seconds, bytes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipette.cluster import ClusterProfile, Device, Node
from pipette.device import DeviceSpec
from pipette.errors import ClusterFileError, SpecError
from pipette.textfile import load_data_file

_BANDWIDTH_UNITS = {
    "b/s": 1.0, "bps": 1.0, "bytes/s": 1.0,
    "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
    "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
    "kib/s": 2**10, "mib/s": 2**20, "gib/s": 2**30,
    "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8, "tbit/s": 1e12 / 8,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SIZE_UNITS = {
    "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9].*)?$")

_TOP_KEYS = {
    "name", "device", "nodes", "devices_per_node", "intra_node", "inter_node",
    "slow_links", "links", "devices", "measured_at", "method", "host_memory", "nvlink_domain",
}


def parse_quantity(value: Any, units: Mapping[str, float], field: str, example: str) -> float:
    """A number in base units, or a string with one of ``units``."""
    if isinstance(value, bool):
        raise ClusterFileError(f"is {value!r}, not a quantity", field=field, fix=f"write e.g. {example!r}")
    if isinstance(value, int | float):
        number, unit = float(value), None
    elif isinstance(value, str) and (m := _QUANTITY.match(value)):
        number, unit = float(m.group(1)), (m.group(2) or "").strip().lower() or None
    else:
        raise ClusterFileError(f"cannot read {value!r}", field=field, fix=f"write e.g. {example!r}")
    if unit is not None:
        if unit not in units:
            raise ClusterFileError(
                f"unknown unit {unit!r}", field=field,
                fix=f"use one of {', '.join(sorted(units))}, e.g. {example!r}",
            )
        number *= units[unit]
    return number


def bandwidth(value: Any, field: str) -> float:
    bw = parse_quantity(value, _BANDWIDTH_UNITS, field, "25 GB/s")
    if not bw > 0:
        raise ClusterFileError(f"is {value!r}, not positive", field=field, fix="a bandwidth must be above zero")
    return bw


def latency(value: Any, field: str) -> float:
    lat = parse_quantity(value, _TIME_UNITS, field, "5 us")
    if lat < 0:
        raise ClusterFileError(f"is {value!r}, negative", field=field, fix="a latency must be zero or more")
    return lat


def size(value: Any, field: str) -> int:
    n = parse_quantity(value, _SIZE_UNITS, field, "80 GiB")
    if not n > 0:
        raise ClusterFileError(f"is {value!r}, not positive", field=field, fix="give a size above zero")
    return int(n)


def load_cluster(path: str | Path) -> ClusterProfile:
    """Read and validate a cluster file; every problem is a ``ClusterFileError``."""
    p = Path(path)
    if not p.exists():
        raise ClusterFileError(
            f"no such file {str(p)!r}", field="cluster", fix="give the path of a cluster file"
        )
    try:
        data = load_data_file(p, "cluster", "cluster file", "fix the syntax of the file")
    except SpecError as e:
        raise ClusterFileError(e.message, field=e.field, fix=e.fix) from None
    return cluster_from_dict(data, default_name=p.stem)


def cluster_from_dict(data: Any, default_name: str = "cluster") -> ClusterProfile:
    if not isinstance(data, dict):
        raise ClusterFileError("is not a mapping", field="cluster", fix="the file must hold a YAML/JSON object")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ClusterFileError(
            f"unknown key(s) {', '.join(unknown)}", field="cluster",
            fix=f"use only {', '.join(sorted(_TOP_KEYS))}",
        )
    name = str(data.get("name", default_name))
    if isinstance(data.get("devices"), list):
        return _from_full(data, name)
    nodes = _nodes(data)
    spec = _device_spec(data.get("device"))
    devices = tuple(
        Device(index=i, node=node, local_index=local, spec=spec)
        for i, (node, local) in enumerate(
            (node, local) for node, count in enumerate(nodes[1]) for local in range(count)
        )
    )
    n = len(devices)
    if "links" in data:
        bw, lat = _matrices(data["links"], n)
    else:
        bw, lat = _two_level(data, devices)
        _apply_nvlink_domain(data.get("nvlink_domain"), devices, bw, lat)
        _apply_slow_links(data.get("slow_links") or [], devices, len(nodes[0]), bw, lat)
    return ClusterProfile(
        name=name, nodes=nodes[0], devices=devices, bandwidth=bw, latency=lat,
        measured_at=data.get("measured_at"), method=str(data.get("method", "declared")),
    )


def _nodes(data: dict[str, Any]) -> tuple[tuple[Node, ...], list[int]]:
    raw = data.get("nodes")
    per = data.get("devices_per_node")
    if raw is None:
        raise ClusterFileError("is required", field="cluster.nodes", fix="give a node count or a list of nodes")
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 1:
            raise ClusterFileError(f"is {raw}, not positive", field="cluster.nodes", fix="give at least 1 node")
        if not isinstance(per, int) or isinstance(per, bool) or per < 1:
            raise ClusterFileError(
                f"is {per!r}", field="cluster.devices_per_node",
                fix="give a positive number of devices per node",
            )
        return tuple(Node(f"node{i}", host_memory=_host_memory(data, None, "cluster")) for i in range(raw)), [per] * raw
    if not isinstance(raw, list) or not raw:
        raise ClusterFileError("must be a count or a non-empty list", field="cluster.nodes", fix="e.g. nodes: 2")
    nodes, counts = [], []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ClusterFileError(
                f"entry {i} is not a mapping", field="cluster.nodes", fix="give {name, address, devices}"
            )
        count = item.get("devices", per)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ClusterFileError(
                f"node {i} has devices={count!r}", field=f"cluster.nodes[{i}].devices",
                fix="give a positive device count per node, or devices_per_node",
            )
        nodes.append(Node(str(item.get("name", f"node{i}")), str(item.get("address", "")),
                          _host_memory(data, item, f"cluster.nodes[{i}]")))
        counts.append(count)
    return tuple(nodes), counts


def _host_memory(data: dict[str, Any], node: dict[str, Any] | None, where: str) -> int | None:
    """A node's host memory: its own ``host_memory``, else the file's (every node's), else None."""
    if node is not None and "host_memory" in node:
        return size(node["host_memory"], f"{where}.host_memory")
    if "host_memory" in data:
        return size(data["host_memory"], "cluster.host_memory")
    return None


def _device_spec(raw: Any) -> DeviceSpec:
    if raw is None:
        raise ClusterFileError("is required", field="cluster.device", fix="name a preset such as A100-80GB")
    try:
        if isinstance(raw, str):
            return DeviceSpec.preset(raw)
        if isinstance(raw, dict):
            if "preset" in raw:
                spec = DeviceSpec.preset(str(raw["preset"]))
                if "memory" in raw:
                    spec = spec.with_memory(size(raw["memory"], "cluster.device.memory"))
                return spec
            return DeviceSpec.from_dict(raw)
    except SpecError as e:
        raise ClusterFileError(e.message, field="cluster." + (e.field or "device"), fix=e.fix) from None
    raise ClusterFileError(f"cannot read {raw!r}", field="cluster.device", fix="name a preset or give a mapping")


def _two_level(data: dict[str, Any], devices: tuple[Device, ...]) -> tuple[np.ndarray, np.ndarray]:
    figures = {}
    for key in ("intra_node", "inter_node"):
        raw = data.get(key)
        needed = key == "intra_node" or len({d.node for d in devices}) > 1
        if raw is None:
            if needed:
                raise ClusterFileError(
                    "is required", field=f"cluster.{key}",
                    fix=f"give {key}: {{bandwidth: '...GB/s', latency: '...us'}}, or a links matrix",
                )
            continue
        if not isinstance(raw, dict) or "bandwidth" not in raw:
            raise ClusterFileError(
                "needs a bandwidth", field=f"cluster.{key}", fix="e.g. {bandwidth: 25 GB/s, latency: 5 us}"
            )
        figures[key] = (
            bandwidth(raw["bandwidth"], f"cluster.{key}.bandwidth"),
            latency(raw.get("latency", 0.0), f"cluster.{key}.latency"),
        )
    node = np.array([d.node for d in devices])
    same = node[:, None] == node[None, :]
    intra = figures["intra_node"]
    inter = figures.get("inter_node", intra)
    bw = np.where(same, intra[0], inter[0]).astype(np.float64)
    lat = np.where(same, intra[1], inter[1]).astype(np.float64)
    return bw, lat


def _apply_nvlink_domain(raw: Any, devices: tuple[Device, ...], bw: np.ndarray, lat: np.ndarray) -> None:
    """``nvlink_domain: {devices: 72, bandwidth: 900 GB/s, latency: 2 us}``: consecutive nodes making up
    ``devices`` GPUs share one NVLink switch domain (a GB200/GB300 NVL72 rack: 18 trays of 4 GPUs), so
    their devices reach each other at its bandwidth, not through the inter-node network."""
    if raw is None:
        return
    where = "cluster.nvlink_domain"
    if not isinstance(raw, dict) or "devices" not in raw or "bandwidth" not in raw:
        raise ClusterFileError("needs devices and bandwidth", field=where,
                               fix="e.g. nvlink_domain: {devices: 72, bandwidth: 900 GB/s, latency: 2 us}")
    size = raw["devices"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise ClusterFileError(f"devices is {size!r}", field=f"{where}.devices",
                               fix="give the GPUs of one NVLink domain, e.g. 72 for an NVL72 rack")
    node = np.array([d.node for d in devices])
    domain = np.arange(len(devices)) // size
    split = [k for k in np.unique(node) if len(np.unique(domain[node == k])) > 1]
    if split:
        raise ClusterFileError(f"a domain of {size} devices splits node {int(split[0])}", field=f"{where}.devices",
                               fix="make the domain a whole number of nodes (devices_per_node divides it)")
    figure = (bandwidth(raw["bandwidth"], f"{where}.bandwidth"), latency(raw.get("latency", 0.0), f"{where}.latency"))
    across = (domain[:, None] == domain[None, :]) & (node[:, None] != node[None, :])
    bw[across], lat[across] = figure


def _apply_slow_links(
    rules: Any, devices: tuple[Device, ...], n_nodes: int, bw: np.ndarray, lat: np.ndarray
) -> None:
    if not isinstance(rules, list):
        raise ClusterFileError(
            "must be a list", field="cluster.slow_links", fix="give a list of {nodes|devices, bandwidth}"
        )
    n = len(devices)
    for k, rule in enumerate(rules):
        where = f"cluster.slow_links[{k}]"
        if not isinstance(rule, dict):
            raise ClusterFileError("is not a mapping", field=where, fix="give {nodes: [a, b], bandwidth: ...}")
        if ("nodes" in rule) == ("devices" in rule):
            raise ClusterFileError("needs exactly one of nodes or devices", field=where, fix="e.g. nodes: [0, 2]")
        kind = "nodes" if "nodes" in rule else "devices"
        pair = rule[kind]
        limit = n_nodes if kind == "nodes" else n
        if (
            not isinstance(pair, list) or len(pair) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < limit for x in pair)
            or pair[0] == pair[1]
        ):
            raise ClusterFileError(
                f"{kind}={pair!r} is not a pair of two different indices below {limit}",
                field=f"{where}.{kind}", fix=f"give two {kind} numbers, e.g. [0, 1]",
            )
        if kind == "nodes":
            a = [d.index for d in devices if d.node == pair[0]]
            b = [d.index for d in devices if d.node == pair[1]]
        else:
            a, b = [pair[0]], [pair[1]]
        ix = np.ix_(a, b)
        ixt = np.ix_(b, a)
        if "bandwidth" in rule:
            value = bandwidth(rule["bandwidth"], f"{where}.bandwidth")
            bw[ix] = value
            bw[ixt] = value
        elif "factor" in rule:
            factor = float(rule["factor"])
            if not factor >= 1:
                raise ClusterFileError(
                    f"factor {factor} is below 1", field=f"{where}.factor",
                    fix="a slow link has factor >= 1 (2 = half speed)",
                )
            bw[ix] /= factor
            bw[ixt] /= factor
        else:
            raise ClusterFileError("needs bandwidth or factor", field=where, fix="e.g. bandwidth: 8 GB/s, or factor: 3")
        if "latency" in rule:
            value = latency(rule["latency"], f"{where}.latency")
            lat[ix] = value
            lat[ixt] = value


def _matrices(raw: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(raw, dict) or "bandwidth" not in raw:
        raise ClusterFileError(
            "needs a bandwidth matrix", field="cluster.links",
            fix="give links: {bandwidth: [[...]], latency: [[...]]}",
        )
    bw_scale = _unit_scale(raw.get("bandwidth_unit"), _BANDWIDTH_UNITS, "cluster.links.bandwidth_unit", "GB/s")
    lat_scale = _unit_scale(raw.get("latency_unit"), _TIME_UNITS, "cluster.links.latency_unit", "us")
    bw = _matrix(raw["bandwidth"], n, "cluster.links.bandwidth") * bw_scale
    lat = (
        _matrix(raw["latency"], n, "cluster.links.latency") * lat_scale
        if "latency" in raw else np.zeros((n, n))
    )
    return bw, lat


def _unit_scale(unit: Any, units: Mapping[str, float], field: str, example: str) -> float:
    if unit is None:
        return 1.0
    key = str(unit).strip().lower()
    if key not in units:
        raise ClusterFileError(f"unknown unit {unit!r}", field=field, fix=f"use e.g. {example!r}")
    return units[key]


def _matrix(raw: Any, n: int, field: str) -> np.ndarray:
    if not isinstance(raw, list) or not all(isinstance(r, list) for r in raw):
        raise ClusterFileError("is not a list of rows", field=field, fix=f"give {n} rows of {n} numbers")
    lengths = {len(r) for r in raw}
    if len(raw) != n or lengths != {n}:
        shape = f"{len(raw)} rows of {'/'.join(map(str, sorted(lengths))) or 0}"
        raise ClusterFileError(
            f"is {shape} numbers, but the cluster has {n} devices (not square n x n)",
            field=field, fix=f"give a square {n}x{n} matrix, one row and column per device",
        )
    try:
        arr = np.array(raw, dtype=np.float64)
    except (TypeError, ValueError):
        raise ClusterFileError(
            "holds something that is not a number", field=field, fix="use plain numbers with a *_unit key"
        ) from None
    return arr


def _index(value: Any, field: str, limit: int | None) -> int:
    """A non-negative integer index (below ``limit`` when given)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0 \
            or (limit is not None and value >= limit):
        allowed = f"from 0 to {limit - 1}" if limit is not None else "of 0 or more"
        raise ClusterFileError(f"is {value!r}", field=field, fix=f"give a whole number {allowed}")
    return int(value)


def _from_full(data: dict[str, Any], name: str) -> ClusterProfile:
    """The probe's form: explicit devices with specs, matrices in base units."""
    raw_nodes = data.get("nodes") or []
    if not isinstance(raw_nodes, list):
        raise ClusterFileError(
            "must be a list with explicit devices", field="cluster.nodes", fix="list {name, address}"
        )
    for i, x in enumerate(raw_nodes):
        if not isinstance(x, dict):
            raise ClusterFileError("is not a mapping", field=f"cluster.nodes[{i}]", fix="give {name, address}")
    nodes = tuple(Node(str(x.get("name", f"node{i}")), str(x.get("address", "")),
                       _host_memory(data, x, f"cluster.nodes[{i}]")) for i, x in enumerate(raw_nodes))
    devices = []
    for i, d in enumerate(data["devices"]):
        where = f"cluster.devices[{i}]"
        if not isinstance(d, dict):
            raise ClusterFileError("is not a mapping", field=where, fix="give {node, spec}")
        spec = _device_spec(d.get("spec", data.get("device")))
        free = d.get("free_memory")
        devices.append(
            Device(
                index=i, node=_index(d.get("node", 0), f"{where}.node", len(nodes) or None),
                local_index=_index(d.get("local_index", i), f"{where}.local_index", None),
                spec=spec, free_memory=None if free is None else size(free, f"{where}.free_memory"),
            )
        )
    if "links" not in data:
        raise ClusterFileError(
            "is required with explicit devices", field="cluster.links", fix="give the measured matrices"
        )
    bw, lat = _matrices(data["links"], len(devices))
    # The probe writes 0 on the diagonal; ClusterProfile sets it to "infinitely fast".
    np.fill_diagonal(bw, 1.0)
    return ClusterProfile(
        name=name, nodes=nodes, devices=tuple(devices), bandwidth=bw, latency=lat,
        measured_at=data.get("measured_at"), method=str(data.get("method", "measured")),
    )


def homogeneous_cluster(
    device: DeviceSpec | str,
    nodes: int,
    devices_per_node: int,
    intra_bandwidth: float,
    inter_bandwidth: float,
    intra_latency: float = 5e-6,
    inter_latency: float = 10e-6,
    name: str = "cluster",
) -> ClusterProfile:
    """A nodes x devices cluster from numbers in base units (for code and tests)."""
    spec = DeviceSpec.preset(device) if isinstance(device, str) else device
    return cluster_from_dict(
        {
            "name": name,
            "device": spec.to_dict(),
            "nodes": nodes,
            "devices_per_node": devices_per_node,
            "intra_node": {"bandwidth": intra_bandwidth, "latency": intra_latency},
            "inter_node": {"bandwidth": inter_bandwidth, "latency": inter_latency},
        }
    )
