"""Ray: connect to ``RAY_ADDRESS`` or start a small local instance, and find the Ray node of
each node of a ``ClusterProfile``."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray

from pipette.cluster import ClusterProfile
from pipette.errors import PipetteError

log = logging.getLogger("pipette.workers")


def ensure_ray(num_cpus: int | None = None) -> None:
    """Connect once per process. Locally, Ray picks free ports (6379 may be another service's)
    and gets a small object store, so it starts in seconds; see ``start_local_ray``."""
    if ray.is_initialized():
        return
    _no_failure_signal_handler()
    if os.environ.get("RAY_ADDRESS"):
        _connect(os.environ["RAY_ADDRESS"])
        return
    start_local_ray(num_cpus)


def _no_failure_signal_handler() -> None:
    """Keep Ray's C++ failure-signal handler out of this process (the driver: the CLI or the
    service). Ray installs absl's handler for SIGTERM among others when a driver connects: it
    printed a stack dump on every SIGTERM, as if the service had crashed, and the service's
    ``ray.shutdown`` at a SIGTERM then aborted the process (status 134) instead of exiting 0
    (issue 17 items 22 and 25; ``tests/service/test_service_shutdown.py``). Ray reads
    ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` when it is imported, so the constant is set too."""
    from ray._private import ray_constants

    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] == "1"


#: Set in this process once it started a local Ray (``stop_local_ray`` stops only that one).
_STARTED_LOCAL = False


def start_local_ray(num_cpus: int | None = None) -> None:
    """Start the embedded single-host Ray: every port on loopback, token authentication on.

    Ray (2.60) binds its servers to the node's address and refuses to use loopback as one
    (``services.resolve_ip_for_localhost``), except in its single-host mode for macOS and
    Windows (``ray_constants.ENABLE_RAY_CLUSTER`` false: ``get_node_ip_address`` answers
    loopback). That mode is what an embedded Ray is, so it is switched on for the start: the
    GCS, the raylet, the agents and the workers then listen on 127.0.0.1 only (checked by
    ``tests/integration/test_ray_local.py``), where they listened on every interface.
    Token authentication is Ray's default for a new local cluster (2.60: every connection needs
    the token it keeps in ``~/.ray/auth_token``; the test checks a wrong token is refused). It
    cannot be switched on from here: Ray reads ``RAY_AUTH_MODE`` when it is imported, and a
    value set later makes the driver and its GCS disagree."""
    global _STARTED_LOCAL, _PARENT
    if threading.current_thread() is threading.main_thread():
        _init_local(num_cpus)
    else:
        _PARENT = RayParent(lambda: _init_local(num_cpus))
    _STARTED_LOCAL = True


def _init_local(num_cpus: int | None) -> None:
    global _REAPER
    from workers.host import ray_reaper

    _REAPER = _REAPER or ray_reaper.start()  # ends this Ray if the driver dies unstopped (SIGKILL)
    with _single_host_mode(), _quiet_start_notices(), _out_of_the_callers_group():
        ray.init(
            address="local",
            num_cpus=num_cpus or max(8, os.cpu_count() or 1),
            object_store_memory=200 * 1024**2,
            include_dashboard=False,
            log_to_driver=False,
        )


class RayParent:
    """A thread that starts the local Ray and lives until ``stop_local_ray``.

    Ray starts its GCS, raylet and monitors with ``PR_SET_PDEATHSIG`` (SIGKILL), which the
    kernel fires when the *thread* that started them exits, not the process (prctl(2)). The
    service starts Ray on its scheduler thread, so at a SIGTERM that thread's exit killed the
    GCS and the raylet under the driver: ``ray.shutdown`` then found its raylet dead and exited
    the whole process on the spot, before the service's own shutdown ran, and the raylet's
    agents, which no longer had a parent to end them, lived on for about 60 s (issue 32 item
    21). Started from this thread, Ray lives as long as the process or until it is stopped."""

    def __init__(self, init: Callable[[], None]) -> None:
        self._init = init
        self._error: Exception | None = None
        self._started = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipette-ray-parent", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            self._init()
        except Exception as e:  # handed to the caller of __init__, which raises it
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._release.wait()

    def release(self) -> None:
        """Let the thread end (its Ray processes are gone by now)."""
        self._release.set()
        self._thread.join(5)


#: The thread that started the local Ray, when a thread other than the main one asked for it.
_PARENT: RayParent | None = None
#: The local Ray's reaper (``workers.host.ray_reaper``) while this process has one running.
_REAPER: subprocess.Popen[bytes] | None = None


#: What the embedded Ray says at every start that a user cannot act on, by Ray's logger: the token
#: notice ("... Set RAY_AUTH_MODE=disabled to opt out": the token is what Pipette wants) and
#: "Started a local Ray instance." (the embedded Ray is Pipette's own business, not the user's)
_START_NOTICES = {
    "ray._private.authentication.authentication_token_setup": "Token authentication is enabled for this Ray cluster",
    "ray._private.worker": "Started a local Ray instance",
}


class _DropNotice(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self._start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self._start)


@contextlib.contextmanager
def _quiet_start_notices() -> Iterator[None]:
    """Drop Ray's start notices (``_START_NOTICES``) while the embedded Ray starts: printed at every
    tune, they were noise the user could not act on (issue 43 item 24). Ray's other messages pass,
    and the same loggers speak again after the start."""
    filters = [(logging.getLogger(name), _DropNotice(start)) for name, start in _START_NOTICES.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


@contextlib.contextmanager
def _out_of_the_callers_group() -> Iterator[None]:
    """Start the Ray processes ``ray.init`` starts inside (GCS, raylet, monitors; the raylet's
    agents and workers follow their raylet) each in a session of its own. ``timeout``, systemd and
    Slurm send SIGTERM to the whole process group: in the caller's group, the GCS and raylet died
    with it while the tuner was still stopping its trial, which then waited 60 s for the GCS and
    died without its result (issue 43 item 13). They still end with the driver: Ray starts them with
    ``PR_SET_PDEATHSIG`` (see ``RayParent``), and ``stop_local_ray`` ends them."""
    from ray._private import services

    popen = services.ConsolePopen

    class SessionPopen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = SessionPopen  # type: ignore[misc]
    try:
        yield
    finally:
        services.ConsolePopen = popen  # type: ignore[misc]


@contextlib.contextmanager
def _single_host_mode() -> Iterator[None]:
    """Ray's single-host mode (``ENABLE_RAY_CLUSTER`` false) for the ``ray.init`` inside: the
    node's address is loopback, and a loopback address is not rewritten to the host's own."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _is_loopback(address: str) -> bool:
    """Whether ``address`` (``HOST:PORT``, not ``ray://``) names this host's loopback."""
    if "://" in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def stop_local_ray(grace_s: float = 1.0) -> None:
    """Stop the local Ray this process started (its GCS, raylet, agents and workers, and what
    they started: the zygote, ranks); a Ray cluster it only connected to is left running.

    ``ray.shutdown`` ends Ray's own processes one after the other, a second or more each, and
    the raylet's agents and workers notice only later (issue 32 item 21; the agents ignore a
    SIGTERM for seconds). So once the driver has disconnected, the whole tree under Ray's
    processes is sent SIGTERM at once, and SIGKILL after ``grace_s`` (Ray's own wait for each
    of its processes); Ray's loop then only reaps them. This needs the GCS and the raylet alive
    until then: see ``RayParent`` for what ended them early under ``serve``."""
    global _STARTED_LOCAL, _PARENT, _REAPER
    if _STARTED_LOCAL and ray.is_initialized():
        tree = _ray_process_tree()
        node = getattr(ray._private.worker, "_global_node", None)
        if node is not None:
            ray_kill = node.kill_all_processes

            def kill_all_processes(*args: Any, **kwargs: Any) -> None:
                end_processes(list({*tree, *_ray_process_tree()}), grace_s)
                ray_kill(*args, **kwargs)

            node.kill_all_processes = kill_all_processes
        ray.shutdown()
        end_processes(tree, grace_s)  # a worker that was between parents meanwhile
    if _PARENT is not None:
        _PARENT.release()
        _PARENT = None
    if _REAPER is not None:
        from workers.host import ray_reaper

        ray_reaper.stop(_REAPER)
        _REAPER = None
    _STARTED_LOCAL = False


#: a process as (pid, start time in clock ticks since boot): a pid alone may be reused
Process = tuple[int, int]


def _ray_process_tree() -> list[Process]:
    """The processes of the local Ray (those its node started) and all their descendants."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return []
    roots = {info.process.pid for infos in node.all_processes.values() for info in infos if info.process is not None}
    return descendants(roots, include_roots=True)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid`` from /proc, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), int(fields[19])


def descendants(roots: set[int], include_roots: bool = False) -> list[Process]:
    """Every process below ``roots`` in the process tree (by parent pid), with the roots."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents.setdefault(stat[0], []).append(int(entry.name))
            starts[int(entry.name)] = stat[1]
    found: list[Process] = []
    todo = [pid for pid in roots if pid in starts]
    seen = set(todo)
    while todo:
        pid = todo.pop()
        if include_roots or pid not in roots:
            found.append((pid, starts[pid]))
        for child in parents.get(pid, []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return found


def alive(processes: list[Process]) -> list[Process]:
    """Those of ``processes`` still running (same pid, same start: not a reused pid)."""
    out = []
    for pid, start in processes:
        stat = _stat(pid)
        if stat is not None and stat[1] == start and not _zombie(pid):
            out.append((pid, start))
    return out


def _zombie(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2:].startswith("Z")


def end_processes(processes: list[Process], grace_s: float) -> None:
    """SIGTERM what is left of ``processes``; SIGKILL what still runs ``grace_s`` later."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        left = alive([p for p in processes if p[0] != os.getpid()])
        for pid, _ in left:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = alive(left)
        if not left:
            return


#: seconds to wait before each further attempt to connect to a Ray cluster
CONNECT_BACKOFF_S = (2.0, 5.0, 10.0)


def _connect(address: str) -> None:
    """Connect to the cluster at ``address``. A connection the head aborted is retried: Ray
    Client's per-driver server died as it started once in CI on the shaped cluster
    ("Initialization failure from server"), and each attempt gets a new one. (The fault did not
    recur in the later runs, so no retry has been seen to succeed.)"""
    for attempt, wait in enumerate((*CONNECT_BACKOFF_S, None), start=1):
        try:
            if _is_loopback(address):
                _use_local_token()
                # A Ray on loopback (``start_local_ray``, e.g. another Pipette process's): Ray
                # would rewrite 127.0.0.1 to this host's own address, where nothing listens,
                # and wait for minutes (CI, 2026-11-24: every `pipette tune` under a
                # RAY_ADDRESS of 127.0.0.1 failed so).
                with _single_host_mode():
                    ray.init(address=address, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
            return
        except ConnectionError as e:
            if ray.is_initialized():
                ray.shutdown()
            # an unreachable head (a timeout, refused) is not retried: it took Ray 30 s to say
            if wait is None or not isinstance(e, ConnectionAbortedError):
                raise PipetteError(
                    f"cannot connect to the Ray cluster at {address} ({attempt} attempts): {type(e).__name__}: {e}",
                    field="RAY_ADDRESS", fix=_connect_fix(e),
                ) from e
            log.warning("connecting to Ray at %s failed (attempt %d): %s; retrying in %.0f s", address, attempt,
                        str(e).splitlines()[0] if str(e) else type(e).__name__, wait)
            time.sleep(wait)


def _use_local_token() -> None:
    """Send this host's Ray token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``) to a Ray on this host. Ray does so only for a cluster it finds
    itself; given an address it connects without one unless ``RAY_AUTH_MODE=token``, and a
    local Ray of 2.60 (token authentication on by default) then refuses it. A remote cluster is
    not sent the token unasked: there ``RAY_AUTH_MODE`` says."""
    from ray._private.authentication import authentication_token_setup as setup
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # Cython, no stub

    if os.environ.get(setup.AUTH_MODE_ENV_VAR) is None and \
            AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        setup._enable_token_auth()


def _connect_fix(error: Exception) -> str:
    cause = f"{error} {error.__cause__ or ''}"
    if "InvalidAuthToken" in cause or "AuthenticationError" in type(error.__cause__).__name__:
        return ("the cluster wants Ray's token: set RAY_AUTH_MODE=token and the cluster's token in "
                "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH; `ray get-auth-token` prints it on the head)")
    return ("check that the Ray head runs and is reachable from here "
            "(ray://HEAD:10001 through Ray Client, HEAD:PORT from a Ray node)")


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's live nodes, the head first, then by address."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    head = "node:__internal_head__"
    return sorted(nodes, key=lambda n: (not n.get("Resources", {}).get(head), n["NodeManagerAddress"]))


def _match(cluster: ClusterProfile, nodes: list[dict[str, Any]]) -> list[str]:
    """The Ray node address of each cluster node ("" where none is left): by address or name
    when Ray has it, else the live nodes no cluster node named, in order."""
    by_ip = {n["NodeManagerAddress"]: n for n in nodes}
    by_name = {n.get("NodeName", ""): n for n in nodes}
    out: list[str] = []
    for node in cluster.nodes:
        hit = by_ip.get(node.address) or by_ip.get(node.name) or by_name.get(node.name)
        out.append(hit["NodeManagerAddress"] if hit else "")
    unused = [n["NodeManagerAddress"] for n in nodes if n["NodeManagerAddress"] not in out]
    return [ip or (unused.pop(0) if unused else "") for ip in out]


def ray_node_ips(cluster: ClusterProfile) -> list[str]:
    """The Ray node address of each cluster node: by address or name when Ray has it, else in order."""
    nodes = alive_nodes()
    out = _match(cluster, nodes)
    if "" in out:
        missing = ", ".join(f"{n.name} ({n.address})" for n, ip in zip(cluster.nodes, out, strict=True) if not ip)
        raise PipetteError(
            f"the cluster has {len(cluster.nodes)} nodes but Ray sees {len(nodes)} alive; missing: {missing}",
            field="cluster.nodes", fix="start Ray on every node of the cluster (ray start --address=HEAD:PORT)",
        )
    return out


def missing_nodes(cluster: ClusterProfile, suspects: frozenset[str] = frozenset()) -> list[str]:
    """The addresses (or names) of the cluster's nodes that have no live Ray node now, counting
    the Ray nodes whose ids are in ``suspects`` as dead (Ray takes a while to notice a lost node)."""
    out = _match(cluster, [n for n in alive_nodes() if n["NodeID"] not in suspects])
    return [n.address or n.name for n, ip in zip(cluster.nodes, out, strict=True) if not ip]


def node_gpus(ip: str) -> int:
    """How many GPUs Ray has on the live node at ``ip`` (its ``GPU`` resource)."""
    for n in alive_nodes():
        if n["NodeManagerAddress"] == ip:
            return int(n.get("Resources", {}).get("GPU", 0))
    return 0


def check_devices(cluster: ClusterProfile, ips: list[str] | None = None) -> None:
    """Refuse, in one line, a cluster whose devices are not the Ray nodes' devices: GPUs in
    the cluster file where Ray has none (trials would wait for GPUs that never come), or CPU
    devices on Ray nodes with GPUs (trials would time the host while the GPUs idle)."""
    where = os.environ.get("RAY_ADDRESS") or "a local Ray started by this process"
    kind = cluster.device_spec.kind
    nodes = alive_nodes()
    gpus = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes)
    if kind == "gpu" and gpus < cluster.world:
        raise PipetteError(
            f"the cluster {cluster.name!r} has {cluster.world} GPU(s) ({cluster.device_spec.name}) on "
            f"{len(cluster.nodes)} node(s), but Ray ({where}) has {gpus} GPU(s) on {len(nodes)} node(s)",
            field="cluster",
            fix="point RAY_ADDRESS at the Ray cluster that holds those GPUs (ray start --head on a GPU node), "
                "or leave out --cluster to measure and use this machine's own devices",
        )
    ips = ips if ips is not None else ray_node_ips(cluster)
    for index, (node, ip) in enumerate(zip(cluster.nodes, ips, strict=True)):
        want = len(cluster.devices_on(index))
        have = node_gpus(ip)
        if kind == "gpu" and have < want:
            raise PipetteError(
                f"the cluster {cluster.name!r} says node {node.name} has {want} GPU(s) "
                f"({cluster.device_spec.name}), but Ray ({where}) has {have} GPU(s) on {ip}",
                field="cluster",
                fix="point RAY_ADDRESS at the Ray cluster that holds those GPUs (ray start --head on a GPU node), "
                    "or leave out --cluster to measure and use this machine's own devices",
            )
        if kind == "cpu" and have > 0:
            raise PipetteError(
                f"the cluster {cluster.name!r} says node {node.name} has CPU devices, but Ray has {have} GPU(s) "
                f"on {ip}: trials would time the host while the GPUs idle",
                field="cluster",
                fix="profile the GPU cluster (pipette cluster profile NAME, or pipette tune without --cluster) "
                    "and use that profile",
            )


def assign_gpus(nodes: list[int], planned: list[int], held: list[list[str]]) -> tuple[list[str], bool]:
    """The GPU each rank uses (a ``CUDA_VISIBLE_DEVICES`` entry), and whether that is the
    placement's own device for every rank.

    ``nodes[r]`` and ``planned[r]`` are rank r's node and planned local GPU index; ``held[r]``
    the GPU ids Ray gave rank r's actor (one each). Ray decides which GPUs of a node a
    placement group gets; when the trial holds every GPU the placement names on a node (the
    usual case: a trial using the whole node), each rank gets its planned GPU, swapped among
    the trial's own actors, so Ray's accounting stays true. When Ray gave other GPUs, the
    ranks of that node take Ray's, in the placement's order."""
    out = [""] * len(planned)
    honoured = True
    for node in sorted(set(nodes)):
        ranks = [r for r, n in enumerate(nodes) if n == node]
        pool = sorted({g for r in ranks for g in held[r]}, key=_gpu_order)
        if len(pool) < len(ranks):
            raise PipetteError(f"Ray gave the {len(ranks)} ranks on node {node} only {len(pool)} GPU(s): {pool}",
                               field="cluster", fix="check the nodes' GPU resources (ray status)")
        if all(str(planned[r]) in pool for r in ranks):
            for r in ranks:
                out[r] = str(planned[r])
            continue
        honoured = False
        for r, gpu in zip(sorted(ranks, key=lambda r: planned[r]), pool, strict=False):
            out[r] = gpu
    return out, honoured


def _gpu_order(gpu: str) -> tuple[bool, int, str]:
    """Numeric ids in numeric order (10 after 9), then any others (UUIDs) by name."""
    return (not gpu.isdigit(), int(gpu) if gpu.isdigit() else 0, gpu)


def store_host(rank0_node: str, hosts: list[str]) -> str:
    """Where the ranks' rendezvous store listens (``MASTER_ADDR``; ``workers.rank.store``): loopback
    when every rank is on one node, else rank 0's node address on the cluster's network."""
    return "127.0.0.1" if len(set(hosts)) == 1 else rank0_node


def rank_bundle(ip: str, gpu: bool) -> dict[str, float]:
    """One rank's placement-group bundle: a CPU, its GPU on a GPU node (so Ray never gives
    that GPU to another rank or job), pinned to its node."""
    bundle = {"CPU": 1.0, f"node:{ip}": 0.001}
    if gpu:
        bundle["GPU"] = 1.0
    return bundle
