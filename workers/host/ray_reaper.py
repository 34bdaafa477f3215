"""The local Ray's reaper: ends what a driver's local Ray left when the driver died without
stopping it (SIGKILL, a crash).

The GCS and the raylet die with their driver (``PR_SET_PDEATHSIG``), but the raylet's agents
then try for 60 s to report the raylet's death to the dead GCS: after a SIGKILL of ``serve``
two agents lived ~65 s with parent 1 (issue 43, item 12). So a driver that starts a local Ray
first starts this small process, in a session of its own, holding the only writing end of a
pipe to its standard input, and marks its own environment (``MARK``), which every process Ray
then starts inherits. When the pipe ends (the driver is gone however it ended, or it stopped
Ray: ``stop``), the reaper SIGKILLs every live process that carries the mark.

    python -m workers.host.ray_reaper TOKEN      (started by ``start``)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

#: the environment variable Ray's processes inherit from the driver that started them
MARK = "PIPETTE_RAY_OWNER"
#: rounds of killing (a process that was being started while one round ran is caught by the next)
ROUNDS = 5


def start() -> subprocess.Popen[bytes]:
    """Start the reaper and mark this process's environment for the Ray it is about to start."""
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if k != MARK}  # the reaper must not reap itself
    reaper = subprocess.Popen([sys.executable, "-m", "workers.host.ray_reaper", token], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                              start_new_session=True, cwd=str(Path(__file__).resolve().parents[2]))
    os.environ[MARK] = token
    return reaper


def stop(reaper: subprocess.Popen[bytes], wait_s: float = 5.0) -> None:
    """After the driver stopped its Ray: let the reaper end whatever is left, and reap it."""
    if os.environ.get(MARK, "").startswith(f"{os.getpid()}-"):
        del os.environ[MARK]
    if reaper.stdin is not None:
        reaper.stdin.close()
    try:
        reaper.wait(wait_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def marked(token: str) -> list[int]:
    """Live processes (of this user, whose environment is readable) that carry ``token``."""
    mark = f"{MARK}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue  # gone, or another user's
    return found


def reap(token: str) -> int:
    """SIGKILL every process marked with ``token``; returns how many were signalled."""
    killed = 0
    for _ in range(ROUNDS):
        pids = marked(token)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.1)
    return killed


def main() -> int:
    token = sys.argv[1]
    sys.stdin.buffer.read()  # until the driver's end of the pipe closes
    reap(token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
