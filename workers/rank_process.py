"""``RankProcess``: a Ray actor that owns one rank's fresh subprocess.

The rank runs in its own process (and session), so an OOM, a crash or a hang takes
nothing else with it, and a kill ends it and its children. The subprocess also dies
with the actor (``PR_SET_PDEATHSIG``), so nothing is left running if the driver goes.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import ray

EVENT_PREFIX = "@@pipette "  # the same as workers.trial.EVENT_PREFIX, without importing torch
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@ray.remote(num_cpus=1, max_restarts=0)
class RankProcess:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.events: list[str] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.lock = threading.Lock()
        self.workdir = tempfile.mkdtemp(prefix="pipette-rank-")

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (for the rendezvous store)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def start(self, files: dict[str, str], argv: list[str], env: dict[str, str]) -> int:
        for name, text in files.items():
            Path(self.workdir, name).write_text(text)
        self.proc = subprocess.Popen(
            argv, cwd=self.workdir, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True, preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.lock:
                if line.startswith(EVENT_PREFIX):
                    self.events.append(line[len(EVENT_PREFIX):])
                else:
                    self.tail.append(line.rstrip("\n"))

    def poll(self) -> tuple[list[str], int | None]:
        """Event lines since the last poll, and the exit status (None while running)."""
        code = self.proc.poll() if self.proc else None
        with self.lock:
            events, self.events = self.events, []
        return events, code

    def output_tail(self) -> str:
        with self.lock:
            return "\n".join(self.tail)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
