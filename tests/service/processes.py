"""Real service processes for the end-to-end tests: ``pipette-admin serve`` / ``worker`` as
subprocesses on a real database, driven over HTTP, killed for real."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """``python -m service.admin serve`` (or ``worker``) with its own environment and log."""

    def __init__(self, url: str, home: Path, *, command: str = "serve", log_name: str = "service",
                 args: tuple[str, ...] = (), nofile: int | None = None, **env: str) -> None:
        self.url = url
        self.nofile = nofile  # the process's file-descriptor limit (soft and hard), when given
        self.home = home
        self.command = command
        self.args = args
        self.port = free_port() if command == "serve" else 0
        self.log = home / f"{log_name}.log"
        self.env = {**os.environ, "PIPETTE_DATABASE_URL": url, "PIPETTE_HOME": str(home),
                    "PYTHONPATH": str(ROOT), "PIPETTE_POLL_S": "0.5", **env}
        self.env.pop("RAY_ADDRESS", None)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_s: float = 180.0) -> ServiceProcess:
        args = [sys.executable, "-m", "service.admin", self.command]
        if self.command == "serve":
            args += ["--port", str(self.port)]
        args += list(self.args)
        with open(self.log, "ab") as log:
            # Its own session, so the teardown can end whatever it started (Ray included).
            self.proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=ROOT, preexec_fn=self._limits)
        if self.command == "serve":
            wait_for(lambda: _healthy(self.base), wait_s, f"the service on {self.base} to answer", self)
        return self

    def _limits(self) -> None:
        if self.nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def kill(self) -> None:
        """SIGKILL the service process itself (its children die with it or on their own)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """End the process and everything in its session (teardown)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str,
             service: ServiceProcess | None = None, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if service is not None and service.proc is not None and service.proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({service.proc.returncode})\n{service.tail()}")
        time.sleep(every_s)
    tail = f"\n{service.tail()}" if service is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{tail}")


def admin_token(url: str, home: Path, tenant: str) -> dict[str, str]:
    env = {**os.environ, "PIPETTE_DATABASE_URL": url, "PIPETTE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "service.admin", "token", "create", "--tenant", tenant, "--json"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return {"Authorization": f"Bearer {json.loads(out.stdout)['token']}"}


def ray_processes_of(pid: int) -> list[str]:
    """Command lines of the Ray processes a driver with ``pid`` started (its session folder
    ends with the driver's pid)."""
    pattern = re.compile(rf"session_[0-9_-]+_{pid}\b")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern.search(cmd):
            found.append(f"{entry.name}: {cmd[:200]}")
    return found


def session_processes(pid: int) -> list[str]:
    """Command lines of the live processes in the session of ``pid`` (a ``ServiceProcess`` is
    started in its own session), other than ``pid`` itself: Ray's GCS and raylet, its agents and
    workers (their command lines, set by Ray, no longer name the session folder); the ranks
    start their own sessions."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == pid:
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == pid and fields[0] != "Z":
            found.append(f"{entry.name}: {cmd[:200]}")
    return found


def commands(processes: list[tuple[int, int]]) -> list[str]:
    """``PID: command line`` of each of ``processes`` (from ``workers.host.ray_cluster.descendants``)."""
    out = []
    for pid, _ in processes:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append(f"{pid}: {cmd[:200]}")
    return out
