"""A fork server for CPU ranks: import torch, DeepSpeed and transformers once per node, then
fork every rank of every trial from that warm process.

Why: on the 2-core development machine a rank spends ~8 CPU-seconds importing its stack
before it runs one step (measured: ``python -c "import torch, deepspeed, transformers,
peft"``, 7.7 s user), so a 4-rank trial paid ~15-30 s of wall time in imports alone. A
forked child is still a fresh process per rank and per trial (its own memory, its own
crash), which is what the executor promises; it just starts warm.

Only CPU ranks use it: a GPU rank must not inherit a process that touched CUDA, and GPU
machines have the cores to import in parallel anyway.

Protocol (one Unix stream socket per Ray node and per code version, in this user's private
runtime folder, ``workers.runtime``):
the client sends one JSON line ``{"module", "argv", "env", "cwd", "log", "owner"}``; the
server forks, answers ``{"pid": N}``, and later ``{"exit": code}`` (negative: killed by that
signal) when the child ends. The child runs ``python -m module argv...`` semantics with the
given environment, in its own session (so a kill of its process group ends it and its
children), output to ``log``, and ends itself if ``owner`` (the rank's actor) dies. The
server exits after ``IDLE_S`` without requests or children.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipette.errors import PipetteError
from workers.runtime import open_private, read_private, runtime_dir, write_private

#: What the warm process imports (the rank's whole stack; CUDA is never touched).
#: ``deepspeed.runtime.zero.muon.muon_optimizer``: DeepSpeed 0.19 imports it inside every
#: ``deepspeed.initialize`` (``is_zero_supported_optimizer``), and it runs ``torch.compile`` at
#: import, which imports TorchInductor: most of the time a CPU rank spent in ``deepspeed.initialize``
#: (docs/results.md, "Trial builds and overhead"). It starts no thread or process, so it forks safely.
PRELOAD = ("torch", "torch.distributed", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "transformers",
           "peft", "scipy.stats", "workers.rank.trial")
#: The environment the preloaded modules read at import time, fixed for every CPU rank.
IMPORT_ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
IDLE_S = 900.0


def socket_path(extra_env: dict[str, str]) -> str:
    """One server per interpreter, code version, import environment and Ray node.

    The Ray node is part of it because the server dies with its node's host actor: two Rays on
    one machine (two test workers, two users' jobs) sharing one server had the ranks of one killed
    (their exit status lost) when the other Ray stopped. Outside Ray: the node-less name."""
    node = _ray_node()
    return str(runtime_dir() / f"zygote-{_code_hash(extra_env)}{f'-{node[:12]}' if node else ''}.sock")


def lock_path(extra_env: dict[str, str]) -> str:
    """The lock that serialises server starts: one for every Ray on the machine (a start is
    rare and short), under the node-less name, so it is known before any Ray runs."""
    return str(runtime_dir() / f"zygote-{_code_hash(extra_env)}.sock.lock")


def _code_hash(extra_env: dict[str, str]) -> str:
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256(sys.executable.encode())
    for package in ("workers", "pipette"):
        for f in sorted((root / package).rglob("*.py")):
            h.update(f"{f}:{f.stat().st_mtime_ns}".encode())
    h.update(json.dumps(sorted({**IMPORT_ENV, **extra_env}.items())).encode())
    return h.hexdigest()[:12]


def _ray_node() -> str:
    """This process's Ray node id, '' outside Ray (Ray is not imported for it)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().get_node_id())


# ---- client (the rank's actor) ------------------------------------------------------------

class ZygoteChild:
    """A rank forked by the node's zygote: its pid, output lines and exit status."""

    def __init__(self, module: str, argv: list[str], env: dict[str, str], cwd: str, extra_env: dict[str, str]):
        path = socket_path(extra_env)
        self.log = str(Path(cwd) / "rank.log")
        Path(self.log).touch()
        self.sock = _connect(path, extra_env)
        self.sock.settimeout(60.0)
        request = {"module": module, "argv": argv, "env": env, "cwd": cwd, "log": self.log, "owner": os.getpid()}
        self.sock.sendall((json.dumps(request) + "\n").encode())
        self._file = self.sock.makefile("r")
        answer = json.loads(self._file.readline() or "{}")
        if "pid" not in answer:
            raise RuntimeError(f"the zygote at {path} did not start the rank: {answer}")
        self.pid = int(answer["pid"])
        self.sock.settimeout(None)  # the exit status comes when the rank ends, however long
        self.returncode: int | None = None
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        line = self._file.readline()
        try:
            self.returncode = int(json.loads(line)["exit"]) if line else -int(signal.SIGKILL)
        except (ValueError, KeyError):
            self.returncode = -int(signal.SIGKILL)

    def poll(self) -> int | None:
        return self.returncode

    def lines(self) -> Iterator[str]:
        """Yield the child's output lines as they are written, until it has ended."""
        with open(self.log) as f:
            buf = ""
            while True:
                chunk = f.readline()
                if chunk:
                    buf += chunk
                    if buf.endswith("\n"):
                        yield buf
                        buf = ""
                    continue
                if self.returncode is not None:
                    rest = f.read()
                    yield from (buf + rest).splitlines(keepends=True)
                    return
                time.sleep(0.05)

    def kill(self) -> None:
        from workers.ops import kill_session

        # The rank's session (it called setsid): its group and the groups an op build's
        # compilers run in, which outlive the rank otherwise.
        kill_session(self.pid)
        deadline = time.monotonic() + 10
        while self.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)


def ensure_zygote(extra_env: dict[str, str]) -> None:
    """Start this node's zygote for ``extra_env`` unless it is up."""
    path = socket_path(extra_env)
    if not _alive(path):
        _ensure_server(path, extra_env)


def _connect(path: str, extra_env: dict[str, str]) -> socket.socket:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s
    except (FileNotFoundError, ConnectionRefusedError):
        s.close()
    _ensure_server(path, extra_env)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def _ensure_server(path: str, extra_env: dict[str, str]) -> None:
    """Have the node's long-lived host actor start the zygote. Not this process: Ray kills
    every descendant of a worker when it exits, and a rank's actor lives for one trial."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    host = ZygoteHost.options(  # type: ignore[attr-defined]
        name=f"pipette-zygote-{node}", namespace="pipette", lifetime="detached", get_if_exists=True,
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote()
    ray.get(host.ensure.remote(path, extra_env), timeout=330)


def _ray_actor(cls: Any) -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1)(cls)


@_ray_actor
class ZygoteHost:
    """One per node, detached: the parent of the node's zygote servers."""

    def ensure(self, path: str, extra_env: dict[str, str]) -> None:
        _start_server(path, extra_env)


def _start_server(path: str, extra_env: dict[str, str]) -> None:
    """Start the node's zygote (once: a lock file serialises racing ranks) and wait for it."""
    import fcntl

    with os.fdopen(open_private(lock_path(extra_env), os.O_WRONLY | os.O_CREAT), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _alive(path):
            return
        _kill_stale(path)
        _sweep_ended(Path(path).parent)
        env = {**os.environ, **IMPORT_ENV, **extra_env, "PYTHONUNBUFFERED": "1"}
        # The zygote ends with its host actor (PR_SET_PDEATHSIG): when the Ray that a job
        # started for itself stops, nothing of it stays behind (it outlived `pipette tune`).
        with os.fdopen(open_private(path + ".err", os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a") as err:
            server = subprocess.Popen([sys.executable, "-m", "workers.host.zygote", path], env=env,
                                      start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=err, cwd=str(Path(__file__).resolve().parents[2]),
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 300
        while not _alive(path):
            if server.poll() is not None:  # it failed (its error is in .err): no wait for the deadline
                raise RuntimeError(f"the zygote exited with status {server.returncode} before it served: "
                                   f"{read_private(path + '.err')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not start in 300 s: {read_private(path + '.err')[-2000:]}")
            time.sleep(0.1)


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill_stale(path: str) -> None:
    """Remove a server that does not answer (its pid is in ``path.pid``): signalled only if that
    pid is still our zygote of this socket (a pid is reused, and a file can lie)."""
    try:
        pid = int(read_private(path + ".pid"))
    except (OSError, ValueError):
        pid = 0
    if pid > 0 and is_our_zygote(pid, path):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for leftover in (path, path + ".pid"):
        if os.path.exists(leftover):
            os.unlink(leftover)


def _sweep_ended(folder: Path) -> None:
    """Remove the files of servers that ended without cleaning up. A stopped Ray SIGKILLs its
    zygote (no handler runs), and the names are per Ray node, so each local Ray left a socket, a
    pid file and an empty log behind. A set goes when its pid file names no zygote of its socket;
    a non-empty log stays (it says why a server failed); a socket with no pid file is left alone
    (a server writes its pid before it publishes the socket, so such a set is being removed)."""
    for pid_file in folder.glob("zygote-*.sock.pid"):
        path = str(pid_file)[: -len(".pid")]
        try:
            pid = int(read_private(str(pid_file)))
        except (OSError, ValueError, PipetteError):
            continue  # being written, or a link (not ours to judge)
        if is_our_zygote(pid, path):
            continue
        _remove(path)


def is_our_zygote(pid: int, path: str) -> bool:
    """Whether process ``pid`` is this user's ``python -m workers.host.zygote path``."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[1:4] == [b"-m", b"workers.host.zygote", os.fsencode(path)]


def _alive(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)  # a stopped or wedged server must not hang the rank
            s.connect(path)
            s.sendall(b'{"ping": true}\n')
            return s.makefile("r").readline().strip() == '{"pong": true}'
    except OSError:
        return False


# ---- server ---------------------------------------------------------------------------

def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each ended child's client its exit status."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn = children.pop(pid)
            try:
                conn.sendall((json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            except OSError:
                pass  # the actor is gone
            conn.close()


def serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    tmp = f"{path}.{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(tmp)
    server.listen(64)
    write_private(path + ".pid", str(os.getpid()))
    os.rename(tmp, path)  # atomic: a client sees a bound, listening socket or none
    children: dict[int, socket.socket] = {}
    last = time.monotonic()
    parent = os.getppid()

    def stop(signum: int, frame: Any) -> None:  # its host died (PDEATHSIG), or someone asked
        _remove(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        if os.getppid() != parent:  # the host actor is gone (a PDEATHSIG set too late to fire)
            _remove(path)
            return
        ready, _, _ = select.select([server], [], [], 0.05)
        if ready:
            conn, _ = server.accept()
            last = time.monotonic()
            try:
                request = json.loads(conn.makefile("r").readline() or "{}")
                if request.get("ping"):
                    conn.sendall(b'{"pong": true}\n')
                    conn.close()
                    continue
            except (OSError, ValueError) as e:
                print(f"zygote: bad request: {e!r}", file=sys.stderr, flush=True)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                for c in children.values():
                    c.close()
                _child(request, conn)
            children[pid] = conn
            try:
                conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
            except OSError:
                os.kill(pid, signal.SIGKILL)  # its actor is gone already
        _reap(children)
        if not children and time.monotonic() - last > IDLE_S:
            _remove(path)
            return


def _remove(path: str) -> None:
    """An ending server's files (one set per Ray node, so they would pile up otherwise); its
    error log only if empty."""
    for leftover in (path, path + ".pid"):
        with contextlib.suppress(OSError):
            os.unlink(leftover)
    with contextlib.suppress(OSError):
        if os.path.getsize(path + ".err") == 0:
            os.unlink(path + ".err")


def _child(request: dict[str, Any], conn: socket.socket) -> None:
    """In the forked child: become ``python -m module argv`` and never return."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's handler is not the rank's
        conn.close()
        os.setsid()
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        owner = int(request["owner"])
        threading.Thread(target=_end_with, args=(owner,), daemon=True).start()
        import runpy

        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        sys.argv = [request["module"], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _end_with(owner: int) -> None:
    """End this rank when the actor that asked for it is gone (like PR_SET_PDEATHSIG)."""
    while True:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os._exit(137)
        except PermissionError:
            pass
        time.sleep(1.0)


if __name__ == "__main__":
    serve(sys.argv[1])
