"""DeepSpeed's JIT-built ops: built once per node before the first trial, outside any trial's
timeout, under a lock that knows whether its holder is alive.

A CPU rank's DeepSpeed builds its shared-memory communication op on first use (1-4 minutes on
a small machine), guarded by PyTorch's ``FileBaton``: a ``lock`` file that whoever creates it
must delete. Built inside a trial, the build ate the trial's timeout (issue 32, item 1: seven
180 s trials of a fresh environment timed out in it, and a user's script trials were charged
for it). So:

- ``build_ops`` runs the build in a process of its own (``python -m workers.ops``), before the
  first trial of a job (``workers.host.runner.RayTrialRunner.prepare``), with no trial's clock on it;
- every builder (that process, and each rank through ``ensure_ops``) takes an ``flock`` on the
  extensions folder, which the kernel releases when its holder dies, however it dies;
- holding it, a ``lock`` file is removed only when no live process builds in the op's folder
  (ninja's compilers run there, in process groups of their own, and outlive a killed rank:
  they are waited for, so a build never runs twice beside itself);
- a killed rank or builder takes its whole session with it (``kill_session``), compilers
  included.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipette.contract import build_environment
from pipette.errors import PipetteError

#: the folder (under TORCH_EXTENSIONS_DIR) of each op a CPU rank builds
CPU_OPS = ("deepspeed_shm_comm",)
#: how long a build may take (a fresh build is 1-4 min on a 2-core machine; with busy neighbours more)
BUILD_TIMEOUT_S = 1800.0
#: how long a builder waits for a live build beside it (orphaned compilers, a launch's ranks) to end
LIVE_BUILD_WAIT_S = 1800.0
#: how often a build's process is looked at (seconds): how soon a cancel reaches it
WAIT_POLL_S = 0.2
#: the line ``python -m workers.ops`` prints its result on
RESULT_PREFIX = "@@pipette-ops "
#: what the build is, in the lines users read
WHAT = "DeepSpeed's CPU communication op"


class OpsBuildError(PipetteError):
    """The environment could not build DeepSpeed's op: no candidate's fault."""


def extensions_dir() -> Path:
    """Where this process's DeepSpeed builds its ops (``workers.rank.train.build_environment``)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or build_environment()["TORCH_EXTENSIONS_DIR"])


def ops_built(cache: Path) -> bool:
    """Every op has a built library in ``cache`` (PyTorch may still rebuild one whose sources
    or flags changed: that is ``ensure_ops``'s to find)."""
    return all((cache / name / f"{name}.so").exists() for name in CPU_OPS)


def ensure_ops(device_kind: str, report: Callable[[dict[str, Any]], None] | None = None) -> float:
    """Build (or load) the ops a rank of ``device_kind`` needs; returns the seconds it took."""
    if device_kind != "cpu":
        return 0.0  # GPU ranks use ops that were built ahead (DS_BUILD_OPS) or none
    cache = extensions_dir()
    cache.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(cache / "pipette-build.flock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        removed = remove_stale_locks(cache, report)
        if report is not None and (removed or not ops_built(cache)):
            report({"event": "building", "what": WHAT, "stale_locks_removed": removed})
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
    return time.monotonic() - start


def remove_stale_locks(cache: Path, report: Callable[[dict[str, Any]], None] | None = None,
                       wait_s: float = LIVE_BUILD_WAIT_S) -> list[str]:
    """Remove the ``lock`` files of dead builds (only call with the folder's flock held). A build
    whose processes still live (compilers a killed rank left, a builder that is not Pipette's)
    is waited for, up to ``wait_s``, and its lock then removed only if it is gone."""
    removed = []
    for name in CPU_OPS:
        folder, lock = cache / name, cache / name / "lock"
        deadline = time.monotonic() + wait_s
        live = live_builders(folder)
        if live and report is not None:
            report({"event": "waiting", "what": f"a live build of {name} (processes {live[:5]})"})
        while live and time.monotonic() < deadline:
            time.sleep(0.5)
            live = live_builders(folder)
        if live:
            raise OpsBuildError(f"a build of {name} in {folder} has run for over {wait_s:.0f} s (processes {live[:5]})",
                                field="TORCH_EXTENSIONS_DIR", fix="let it finish, or end those processes")
        if lock.exists():
            lock.unlink()
            removed.append(str(lock))
    return removed


def live_builders(folder: Path) -> list[int]:
    """Processes that build in ``folder``: run there (ninja and its compilers) or hold its
    ``lock`` open (PyTorch's ``FileBaton`` keeps it open while it builds). Not this one."""
    target = str(folder.resolve()) if folder.exists() else str(folder)
    lock = os.path.join(target, "lock")
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if cwd == target or cwd.startswith(target + os.sep):
                found.append(pid)
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == lock:
                    found.append(pid)
                    break
            except OSError:
                continue
    return found


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def session_of(pid: int) -> int | None:
    """The session id of ``pid`` (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses
    return int(stat[stat.rindex(")") + 2:].split()[3])


def kill_session(sid: int) -> int:
    """SIGKILL every process of session ``sid`` (a rank started with its own session: its
    process group, and the groups ninja gives each compiler, which ``killpg`` misses);
    returns how many were signalled."""
    killed = 0
    if sid <= 1 or sid == os.getsid(0):
        return 0  # never this process's own session (nor init's)
    for _ in range(3):  # a process forked while signalling is caught on the next round
        members = [p for p in _pids() if session_of(p) == sid]
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def build_ops(device_kind: str, env: dict[str, str] | None = None,
              timeout_s: float = BUILD_TIMEOUT_S) -> dict[str, Any]:
    """Build the ops here in a process of its own, waiting for a live build instead of starting
    another; returns ``{"seconds": s, "built": compiled now, "cache": folder}``. Raises
    ``OpsBuildError`` (with the build's last lines) when it fails or runs past ``timeout_s``."""
    if device_kind != "cpu":
        return {"seconds": 0.0, "built": False, "cache": None}
    # the ranks' ninja and cache (a caller's TORCH_EXTENSIONS_DIR in ``env`` wins)
    full = {**os.environ, **build_environment(), **(env or {}), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "workers.ops"], env=full, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            timed_out = not _wait(proc, timeout_s)
        finally:
            kill_session(proc.pid)  # nothing of the build outlives it (nor a cancel: KeyboardInterrupt)
            proc.wait()
        log.seek(0)
        out = log.read()
    if timed_out:
        raise OpsBuildError(f"building {WHAT} ran past {timeout_s:.0f} s:\n{_tail(out)}", field="environment",
                            fix="run it alone once (python -m workers.ops) and look at its output")
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        raise OpsBuildError(f"building {WHAT} failed (exit status {proc.returncode}):\n{_tail(out)}",
                            field="environment", fix="install a C++ compiler and ninja (the build's output "
                                                     "above says what is missing), then run again")
    return {**results[-1], "wall_s": time.monotonic() - start}


def _wait(proc: subprocess.Popen[str], timeout_s: float) -> bool:
    """Whether ``proc`` ended within ``timeout_s``. Polls rather than blocks, so that a cancel
    of the Ray task that builds (``ray.cancel``: a KeyboardInterrupt here) ends it at once."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(WAIT_POLL_S)
    return True


def _built_at(cache: Path) -> list[float | None]:
    """When each op's library was last written (None: not built)."""
    out: list[float | None] = []
    for name in CPU_OPS:
        try:
            out.append((cache / name / f"{name}.so").stat().st_mtime)
        except OSError:
            out.append(None)
    return out


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def main() -> int:
    """Build (or load) the CPU ops and print how long it took (``build_ops`` runs this)."""
    cache = extensions_dir()
    before = _built_at(cache)

    def say(event: dict[str, Any]) -> None:
        print(f"workers.ops: {event['event']} {event['what']}", flush=True)

    seconds = ensure_ops("cpu", say)
    print(RESULT_PREFIX + json.dumps({"seconds": seconds, "built": _built_at(cache) != before,
                                              "cache": str(cache)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
