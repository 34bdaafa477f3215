"""A shaped multi-host Ray cluster on one machine: network namespaces, veth pairs, a bridge,
``tc`` per destination, and one Ray node per namespace.

Why: Pipette exists because a real cluster's links are not equally fast. This builds such a
cluster where the test can see it: ``hosts`` network namespaces (``<prefix>-h0`` ...), each
with its own address (``10.77.0.1`` ...) on an ``eth0`` that is one end of a veth pair whose
other end sits on a bridge in a switch namespace (``<prefix>-sw``), so nothing touches the
machine's own network. Each host shapes its egress per destination with an HTB class and a
u32 filter on the destination address, so the pair ``a <-> b`` runs at ``links[a, b]`` in both
directions. (The kernel here has no netem: latency is the veth's own.)

Ray: a head in host 0 (port 6380 by default, never 6379) and a worker in every other host,
each offering ``num_cpus`` CPUs; ``GLOO_SOCKET_IFNAME=eth0`` so torch.distributed binds the
shaped interface (the hostname resolves to the machine's address, which no namespace has).

Tear-down kills exactly the processes inside the cluster's namespaces (``ip netns pids``),
then deletes the namespaces, which removes the veths and the bridge with them. ``ray stop``
is never used: it matches processes by name across the whole machine, so it would also stop
other people's Ray.

Only the standard library: this module is a tool, usable without Pipette
(``scripts/shaped-cluster up|down|status|exec``).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MBIT = 1e6 / 8  # bytes/s in one Mbit/s
#: the rate of traffic no filter matches (ARP, anything not to a host)
UNSHAPED_MBIT = 10_000


class ClusterError(RuntimeError):
    """A step of building or using the shaped cluster failed; the message says which and why."""


def default_links(hosts: int = 4) -> dict[tuple[int, int], float]:
    """Mbit/s per host pair: fast pairs {0,1} and {2,3} at 1000, across the pairs 100,
    and the link 1 <-> 3 degraded to 30."""
    if hosts != 4:
        return {(a, b): 100.0 for a in range(hosts) for b in range(a + 1, hosts)}
    links = {(a, b): 100.0 for a in range(4) for b in range(a + 1, 4)}
    links[(0, 1)] = links[(2, 3)] = 1000.0
    links[(1, 3)] = 30.0
    return links


@dataclass
class ShapedCluster:
    hosts: int = 4
    links: dict[tuple[int, int], float] = field(default_factory=default_links)
    prefix: str = "pcl"
    subnet: str = "10.77.0"
    ray_port: int = 6380
    #: Ray Client's port on the head (``ray://10.77.0.1:10001``: a driver that is not a Ray node)
    client_port: int = 10001
    num_cpus: int = 1
    object_store_mb: int = 100
    #: Ray's temp folder (default /tmp/PREFIX-ray): a second cluster with another prefix is separate
    temp_root: Path | None = None
    python: Path = Path(sys.executable)
    #: extra environment of every Ray node (and so of every task, actor and rank it starts)
    env: dict[str, str] = field(default_factory=dict)
    ray: bool = True

    def __post_init__(self) -> None:
        if not 2 <= self.hosts <= 200:
            raise ClusterError(f"hosts is {self.hosts}; give 2 to 200")
        if self.ray_port == 6379:
            raise ClusterError("ray_port 6379 belongs to Redis on this machine; use another (6380)")
        for (a, b), mbit in self.links.items():
            if not (0 <= a < self.hosts and 0 <= b < self.hosts and a != b) or mbit <= 0:
                raise ClusterError(f"link {(a, b)}: {mbit} Mbit/s is not a link between two of {self.hosts} hosts")

    # ---- names ------------------------------------------------------------------------
    @property
    def temp_dir(self) -> Path:
        return self.temp_root or Path(f"/tmp/{self.prefix}-ray")

    def ns(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    @property
    def ray_address(self) -> str:
        return f"{self.address(0)}:{self.ray_port}"

    def mbit(self, a: int, b: int) -> float:
        """The shaped rate of the pair, in Mbit/s."""
        return self.links.get((min(a, b), max(a, b)), UNSHAPED_MBIT)

    def bandwidth_matrix(self) -> list[list[float]]:
        """The set bandwidth per host pair in bytes/s (0 on the diagonal)."""
        return [[0.0 if a == b else self.mbit(a, b) * MBIT for b in range(self.hosts)] for a in range(self.hosts)]

    # ---- life cycle -------------------------------------------------------------------
    def up(self) -> ShapedCluster:
        """Build everything; on any failure, remove what was built and raise."""
        check_permitted()
        self.down()
        atexit.register(self.down)
        try:
            self._network()
            for h in range(self.hosts):
                self._shape(h)
            if self.ray:
                for path in [self.temp_dir, *(self.host_tmp(h) for h in range(self.hosts))]:
                    shutil.rmtree(path, ignore_errors=True)
                self.token_path.write_text(secrets.token_hex(32))
                self.token_path.chmod(0o600)
                for h in range(self.hosts):
                    self.start_ray(h)
                self.wait_for_nodes(self.hosts)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every process in the cluster's namespaces and delete them. Idempotent."""
        names = [n for n in list_namespaces() if n.startswith(f"{self.prefix}-")]
        kill_namespaces(names)
        for name in names:
            _run(["ip", "netns", "del", name], check=False)
        for h in range(self.hosts):  # veths left in the root namespace by a failed build
            for end in (f"{self.prefix}-h{h}", f"{self.prefix}-h{h}b"):
                if Path("/sys/class/net", end).exists():
                    _run(["ip", "link", "del", end], check=False)
        self.token_path.unlink(missing_ok=True)
        for h in range(self.hosts):  # per-host state (zygote sockets); Ray's logs stay until the next `up`
            shutil.rmtree(self.host_tmp(h), ignore_errors=True)

    def __enter__(self) -> ShapedCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- network ----------------------------------------------------------------------
    def _network(self) -> None:
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in range(self.hosts):
            ns, host_end, switch_end = self.ns(h), f"{self.prefix}-h{h}", f"{self.prefix}-h{h}b"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end])
            _run(["ip", "link", "set", host_end, "netns", ns])
            _run(["ip", "link", "set", switch_end, "netns", sw])
            _run(["ip", "-n", sw, "link", "set", switch_end, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", switch_end, "up"])
            _run(["ip", "-n", ns, "link", "set", host_end, "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _shape(self, host: int) -> None:
        """HTB on the host's egress: one class per destination host, matched by u32 on the
        destination address; everything else (ARP) in an unshaped default class."""
        tc = ["ip", "netns", "exec", self.ns(host), "tc"]
        default = 1000 + self.hosts
        _run([*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", str(default)])
        _run([*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{default}",
              *_htb_rate(UNSHAPED_MBIT)])
        for peer in range(self.hosts):
            if peer == host:
                continue
            classid = f"1:{10 + peer}"
            _run([*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", classid,
                  *_htb_rate(self.mbit(host, peer))])
            _run([*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                  "match", "ip", "dst", f"{self.address(peer)}/32", "flowid", classid])

    # ---- Ray --------------------------------------------------------------------------
    @property
    def token_path(self) -> Path:
        """The cluster's own Ray auth token (Ray >= 2.5x enables token auth on a head that
        finds ~/.ray/auth_token, but workers only with RAY_AUTH_MODE=token): every node and
        driver gets the mode and this file explicitly, so ~/.ray does not matter."""
        return self.temp_dir.with_name(self.temp_dir.name + ".token")

    def node_env(self) -> dict[str, str]:
        """The environment of every Ray node and driver: the repository importable (a
        worktree's code, not the venv's editable install), gloo on the shaped interface,
        the cluster's auth token."""
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "eth0", "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path), **self.env}

    def host_tmp(self, host: int) -> Path:
        """The host's own temporary folder (``TMPDIR``): the hosts share one file system, but
        per-node state under /tmp (the CPU ranks' zygote socket of ``workers.host.zygote``, the
        ranks' work folders) must stay per host, or one host's rank would be forked in
        another host's network namespace."""
        return self.temp_dir.with_name(f"{self.temp_dir.name}-h{host}")

    def host_env(self, host: int) -> dict[str, str]:
        return {**self.node_env(), "TMPDIR": str(self.host_tmp(host))}

    def start_ray(self, host: int) -> None:
        ray = str(self.python.with_name("ray"))
        if not Path(ray).exists():
            raise ClusterError(f"no `ray` next to {self.python}; run this with the Python of a venv that has Ray "
                               "(e.g. .venv/bin/python scripts/shaped-cluster up)")
        common = [f"--node-ip-address={self.address(host)}", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
                  f"--object-store-memory={self.object_store_mb * 1024 * 1024}", f"--temp-dir={self.temp_dir}",
                  "--disable-usage-stats", f"--resources={json.dumps({f'host{host}': 1})}",
                  # no log monitor: no driver here reads workers' logs (Pipette's drivers connect with
                  # log_to_driver=False), and each monitor polled its logs 10 times a second
                  "--include-log-monitor=false"]
        if host == 0:
            argv = [ray, "start", "--head", f"--port={self.ray_port}", "--include-dashboard=false",
                    f"--ray-client-server-port={self.client_port}", *common]
        else:
            argv = [ray, "start", f"--address={self.ray_address}", *common]
        self.host_tmp(host).mkdir(parents=True, exist_ok=True)
        out = self.run(host, argv, timeout=180, check=False)
        if out.returncode != 0:
            raise ClusterError(f"ray start on host {host} failed ({out.returncode}):\n{out.stdout[-3000:]}")

    def stop_host(self, host: int) -> list[int]:
        """Lose a host: SIGKILL every process in its namespace (its Ray node and whatever it
        runs). Returns the pids killed."""
        return kill_namespace(self.ns(host), grace_s=0.0)

    def restart_host(self, host: int) -> None:
        """Bring a lost host's Ray node back (the network and shaping stayed)."""
        kill_namespace(self.ns(host), grace_s=0.0)
        self.start_ray(host)
        self.wait_for_nodes(self.hosts)

    def ray_nodes(self) -> list[dict[str, object]]:
        """Ray's view of the nodes (address, alive), asked from host 0."""
        code = ("import json, ray; ray.init(log_to_driver=False); "
                "print(json.dumps([{'address': n['NodeManagerAddress'], 'alive': n['Alive']} for n in ray.nodes()]))")
        out = self.run(0, [str(self.python), "-c", code], timeout=120, check=False,
                       env={"RAY_ADDRESS": self.ray_address})
        if out.returncode != 0:
            raise ClusterError(f"asking Ray for its nodes failed:\n{out.stdout[-3000:]}")
        # Ray may print warnings (lagging heartbeats...) around the one JSON line.
        lines = [x for x in out.stdout.splitlines() if x.startswith("[")]
        if not lines:
            raise ClusterError(f"Ray printed no node list:\n{out.stdout[-3000:]}")
        return list(json.loads(lines[-1]))

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        alive: list[str] = []
        while time.monotonic() < deadline:
            alive = sorted(str(n["address"]) for n in self.ray_nodes() if n["alive"])
            if len(alive) >= count:
                return
            time.sleep(2)
        raise ClusterError(f"Ray sees {len(alive)} live nodes ({alive}) after {timeout_s:g} s, expected {count}")

    # ---- running things in a host -----------------------------------------------------
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def run(self, host: int, argv: Sequence[str], *, timeout: float, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``host`` with the nodes' environment; stdout and stderr together."""
        return subprocess.run(self.command(host, argv), env={**self.host_env(host), **(env or {})}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              check=check)

    def popen(self, host: int, argv: Sequence[str], *, env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        proc: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
            self.command(host, argv), env={**self.host_env(host), **(env or {})}, cwd=REPO, text=True, **kwargs)
        return proc

    def describe(self) -> dict[str, object]:
        return {
            "hosts": [{"namespace": self.ns(h), "address": self.address(h)} for h in range(self.hosts)],
            "ray_address": self.ray_address if self.ray else None,
            "links_mbit": {f"{a}-{b}": self.mbit(a, b) for a in range(self.hosts) for b in range(a + 1, self.hosts)},
        }


# ---- helpers --------------------------------------------------------------------------


def _htb_rate(mbit: float) -> list[str]:
    """``rate``/``ceil`` and a quantum inside HTB's sane range (one MTU to 200 kB), so the
    kernel does not warn and small rates still interleave fairly."""
    rate = f"{mbit:g}mbit"
    quantum = int(min(max(mbit * MBIT / 1000, 1514), 200_000))
    # A burst of ~1 ms at the rate (at least 64 kB: one GSO segment) keeps a fast class at its
    # rate with timer granularity; a small one would cap 1 Gbit/s well below itself.
    burst = int(max(mbit * MBIT / 1000, 64 * 1024))
    return ["htb", "rate", rate, "ceil", rate, "quantum", str(quantum), "burst", str(burst), "cburst", str(burst)]


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    if check and out.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed ({out.returncode}): {out.stdout.strip()}")
    return out


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    out = _run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def namespace_of(pid: int) -> str:
    """The network namespace (of those ``ip netns`` names) process ``pid`` runs in; "" if none."""
    return _run(["ip", "netns", "identify", str(pid)], check=False).stdout.strip()


def kill_namespace(name: str, grace_s: float = 5.0) -> list[int]:
    """SIGTERM then SIGKILL every process inside namespace ``name`` (and only those)."""
    return kill_namespaces([name], grace_s)


def kill_namespaces(names: list[str], grace_s: float = 5.0) -> list[int]:
    """``kill_namespace`` of several at once: one grace period for all of them, not one each."""
    def alive() -> list[int]:
        return [pid for name in names for pid in namespace_pids(name)]

    pids = alive()
    if grace_s > 0:
        _signal(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and alive():
            time.sleep(0.2)
    _signal(alive(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive():
        time.sleep(0.1)
    return pids


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def check_permitted() -> None:
    """Raise ``ClusterError`` saying why when network namespaces cannot be made here."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise ClusterError("the `ip` and `tc` commands are missing (apt-get install iproute2)")
    if os.geteuid() != 0:
        raise ClusterError("network namespaces need root (run as root, or in a privileged container)")
    probe = f"pcl-check-{os.getpid()}"
    out = _run(["ip", "netns", "add", probe], check=False)
    if out.returncode != 0:
        raise ClusterError(f"`ip netns add` is not permitted here: {out.stdout.strip()}")
    _run(["ip", "netns", "del", probe], check=False)


# ---- command line ---------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="shaped-cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default="pcl", help="namespace name prefix (default pcl)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build the 4-host shaped cluster and start Ray in it")
    up.add_argument("--no-ray", action="store_true", help="network and shaping only")
    up.add_argument("--num-cpus", type=int, default=1)
    up.add_argument("--port", type=int, default=6380, help="the Ray head's port (not 6379)")
    up.add_argument("--link", action="append", default=[], metavar="A-B=MBIT",
                    help="override a pair's rate, e.g. 1-3=30 (repeatable)")
    sub.add_parser("down", help="stop everything in the namespaces and remove them")
    sub.add_parser("status", help="namespaces, addresses, shaping and Ray nodes")
    ex = sub.add_parser("exec", help="run a command in a host: exec 0 -- python -c ...")
    ex.add_argument("host", type=int)
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            links = default_links()
            for item in args.link:
                pair, _, rate = item.partition("=")
                a, _, b = pair.partition("-")
                links[(min(int(a), int(b)), max(int(a), int(b)))] = float(rate)
            cluster = ShapedCluster(links=links, prefix=args.prefix, num_cpus=args.num_cpus, ray_port=args.port,
                                    ray=not args.no_ray)
            cluster.up()
            atexit.unregister(cluster.down)  # `up` from the command line leaves it running
            print(json.dumps(cluster.describe(), indent=2))
            print(f"export RAY_ADDRESS={cluster.ray_address}  # from inside host 0: shaped-cluster exec 0 -- ...")
        elif args.cmd == "down":
            ShapedCluster(prefix=args.prefix).down()
        elif args.cmd == "status":
            cluster = ShapedCluster(prefix=args.prefix)
            names = [n for n in list_namespaces() if n.startswith(f"{args.prefix}-")]
            print(json.dumps({"namespaces": {n: len(namespace_pids(n)) for n in names}}, indent=2))
            if cluster.ns(0) in names:
                shown = _run(cluster.command(0, ["tc", "-s", "class", "show", "dev", "eth0"]), check=False)
                print(shown.stdout)
                print(json.dumps(cluster.ray_nodes(), indent=2))
        else:
            argv_ = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            cluster = ShapedCluster(prefix=args.prefix)
            return subprocess.call(cluster.command(args.host, argv_),
                                   env={**cluster.host_env(args.host), "RAY_ADDRESS": cluster.ray_address}, cwd=REPO)
    except ClusterError as e:
        print(f"shaped-cluster: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
