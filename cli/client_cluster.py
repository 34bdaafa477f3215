"""``pipette cluster add | list | show | profile | delete``: the clusters jobs run on."""

from __future__ import annotations

import argparse
import re
import statistics
import time
from typing import Any

from cli import client_output as out
from cli.client_api import EXIT_ERROR, EXIT_OK, ApiError, client

NODE = re.compile(r"^(?P<name>[^=@\s]+)=(?P<devices>\d+)(?:@(?P<address>\S+))?$")
#: A link this much slower than the median of its kind (same node / across nodes) is "slow".
SLOW_FACTOR = 0.5
#: Show the whole bandwidth matrix up to this many devices.
MATRIX_MAX = 16
GB = 1e9


def cmd_add(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "devices": args.devices}
    if args.ray:
        body.update(kind="ray", address=args.ray, nodes=[_node(n) for n in args.node or ()])
    elif args.node:
        raise ApiError("needs --ray (nodes belong to a Ray cluster)", field="--node",
                       fix="give the Ray address with --ray HOST:PORT")
    cluster = client().post("/v1/clusters", body)
    if args.json:
        out.print_json(cluster)
        return EXIT_OK
    print(f"cluster {out.bold(cluster['name'])} registered ({cluster['kind']}, {cluster['devices_per_node']} "
          f"devices per node), id {cluster['id']}")
    print(f"  measure it now: pipette cluster profile {cluster['name']} --wait  (or the first job does it)")
    return EXIT_OK


def _node(text: str) -> dict[str, Any]:
    m = NODE.match(text)
    if not m:
        raise ApiError(f"{text!r} is not NAME=DEVICES[@ADDRESS]", field="--node",
                       fix="write e.g. --node gpu0=8@10.0.0.1")
    node: dict[str, Any] = {"name": m["name"], "devices": int(m["devices"])}
    if m["address"]:
        node["address"] = m["address"]
    return node


def cmd_list(args: argparse.Namespace) -> int:
    items = client().get("/v1/clusters")["items"]
    if args.json:
        out.print_json(items)
        return EXIT_OK
    if not items:
        print("no clusters yet: pipette cluster add local --devices 2")
        return EXIT_OK
    rows = []
    for c in items:
        profile = c.get("latest_profile") or {}
        measured = (profile.get("profile") or {}).get("measured_at")
        nodes = len(c["nodes"]) or 1
        lease = c["lease"]
        busy = "busy" + (f" (job {out.short_id(lease['job_id'])})" if lease.get("job_id") else "") if lease["busy"] \
            else "free"
        rows.append([c["name"], c["kind"], c["address"], str(nodes * c["devices_per_node"]), busy,
                     out.state(profile["state"]) if profile else "never", out.age(measured) if measured else "-"])
    print(out.table(["NAME", "KIND", "ADDRESS", "DEVICES", "LEASE", "PROFILE", "MEASURED"], rows, right=(3,)))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    cluster = client().get(f"/v1/clusters/{args.name}")
    if args.json:
        out.print_json(cluster)
        return EXIT_OK
    print(cluster_text(cluster))
    return EXIT_OK


def cmd_profile(args: argparse.Namespace) -> int:
    api = client()
    profile = api.post(f"/v1/clusters/{args.name}/profile")
    if not args.wait:
        if args.json:
            out.print_json(profile)
        else:
            print(f"profile {profile['id']} {out.state(profile['state'])}; it runs when the cluster's devices are "
                  f"free (see: pipette cluster show {args.name})")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    while profile["state"] in ("queued", "running"):
        if time.monotonic() > deadline:
            raise ApiError(f"the profile is still {profile['state']} after {args.timeout:.0f} s", field="--timeout",
                           fix=f"wait longer, or look later with `pipette cluster show {args.name}`")
        time.sleep(1.0)
        profile = api.get(profile["url"])
    if args.json:
        out.print_json(profile)
    elif profile["state"] == "succeeded":
        print(cluster_text(api.get(f"/v1/clusters/{args.name}")))
    if profile["state"] == "cancelled":
        raise ApiError("the profile was cancelled before it ran", field="cluster",
                       fix=f"request another: pipette cluster profile {args.name} --wait", exit_code=EXIT_ERROR)
    if profile["state"] != "succeeded":
        err = profile.get("error") or {}
        raise ApiError(f"the profile failed: {err.get('message', '?')}", field=err.get("field") or "cluster",
                       fix=err.get("fix") or "see the service log", exit_code=EXIT_ERROR)
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    client().delete(f"/v1/clusters/{args.name}")
    print(f"cluster {out.bold(args.name)} deleted; the jobs that ran on it stay readable (pipette jobs)")
    return EXIT_OK


def cluster_text(cluster: dict[str, Any]) -> str:
    lines = [f"cluster  {out.bold(cluster['name'])}  ({cluster['kind']}, address {cluster['address']}, "
             f"{cluster['devices_per_node']} devices per node)  id {cluster['id']}"]
    lease = cluster["lease"]
    lines.append("lease    " + ("busy" + (f" with job {lease['job_id']}" if lease.get("job_id") else "")
                               if lease["busy"] else "free"))
    latest = cluster.get("latest_profile")
    if not latest:
        lines.append(f"profile  never measured (pipette cluster profile {cluster['name']} --wait)")
        return "\n".join(lines)
    profile = latest.get("profile")
    if not profile:
        lines.append(f"profile  {out.state(latest['state'])} (requested {out.age(latest['created_at'])})")
        err = latest.get("error")
        if err:
            lines.append(f"         error: {err.get('message')} (fix: {err.get('fix')})")
        return "\n".join(lines)
    lines.append(f"profile  measured {profile.get('measured_at')} ({out.age(profile.get('measured_at'))}, "
                 f"{profile.get('method')})")
    lines.append("")
    lines.append(devices_table(profile))
    lines.append("")
    lines += links_text(profile)
    return "\n".join(lines)


def devices_table(profile: dict[str, Any]) -> str:
    nodes = profile.get("nodes") or []
    rows = []
    for i, d in enumerate(profile["devices"]):
        spec = d["spec"]
        flops = spec.get("peak_flops") or {}
        node = nodes[d["node"]]["name"] if d["node"] < len(nodes) else str(d["node"])
        rows.append([str(i), node, str(d["local_index"]), spec["name"], out.size(spec["memory_bytes"]),
                     out.size(d.get("free_memory")),
                     *[f"{flops[k] / 1e12:.2f}" if k in flops else "-" for k in ("fp32", "tf32", "bf16", "fp16")]])
    return out.table(["DEVICE", "NODE", "LOCAL", "KIND", "MEMORY", "FREE", "FP32 TFLOPS", "TF32 TFLOPS",
                      "BF16 TFLOPS", "FP16 TFLOPS"], rows, right=(0, 2, 4, 5, 6, 7, 8, 9))


def slow_links(profile: dict[str, Any]) -> list[tuple[int, int, float, float]]:
    """(i, j, bandwidth, median of its kind) for links under ``SLOW_FACTOR`` x the median of
    links of the same kind (within a node, or across nodes)."""
    bw = profile["links"]["bandwidth"]
    node_of = [d["node"] for d in profile["devices"]]
    kinds: dict[bool, list[float]] = {True: [], False: []}
    n = len(bw)
    for i in range(n):
        for j in range(n):
            if i != j and bw[i][j] > 0:
                kinds[node_of[i] == node_of[j]].append(bw[i][j])
    medians = {k: statistics.median(v) for k, v in kinds.items() if v}
    found = []
    for i in range(n):
        for j in range(i + 1, n):
            median = medians.get(node_of[i] == node_of[j])
            value = min(bw[i][j], bw[j][i])
            if median and value < SLOW_FACTOR * median:
                found.append((i, j, value, median))
    return found


def links_text(profile: dict[str, Any]) -> list[str]:
    bw, lat = profile["links"]["bandwidth"], profile["links"]["latency"]
    n = len(bw)
    off = [bw[i][j] for i in range(n) for j in range(n) if i != j]
    if not off:
        return ["links    one device: no links"]
    lines = [f"links    bandwidth per direction {min(off) / GB:.2f} - {max(off) / GB:.2f} GB/s "
             f"(median {statistics.median(off) / GB:.2f}); latency "
             f"{min(lat[i][j] for i in range(n) for j in range(n) if i != j) * 1e6:.1f} - "
             f"{max(lat[i][j] for i in range(n) for j in range(n) if i != j) * 1e6:.1f} us"]
    if n <= MATRIX_MAX:
        rows = [[str(i)] + ["-" if i == j else f"{bw[i][j] / GB:.1f}" for j in range(n)] for i in range(n)]
        lines += ["", "bandwidth GB/s (row: from, column: to)",
                  out.table(["", *map(str, range(n))], rows, right=tuple(range(n + 1)))]
    slow = slow_links(profile)
    lines.append("")
    if slow:
        lines.append(out.paint(f"slow links ({len(slow)}): under {SLOW_FACTOR:.0%} of the median of their kind", "33"))
        for i, j, value, median in slow[:20]:
            lines.append(f"  {i} <-> {j}: {value / GB:.2f} GB/s (median {median / GB:.2f})")
    else:
        lines.append(f"no slow links (none under {SLOW_FACTOR:.0%} of the median of its kind)")
    return lines
