"""Request limits as a real ``pipette-admin serve`` answers them over a socket (issue 32,
item 19): a header block over 64 KiB answers 431 with the error body (a 200 KB one got a
plain-text 400, a 5 MB one a connection reset), and a body over the limit a 413 the client
reads (a 1.5 MiB upload got a reset: "cannot reach the service")."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.migrations import upgrade
from tests.service.processes import ServiceProcess


def _answer(port: int, request: bytes) -> tuple[int, dict[str, object]]:
    """Send ``request`` whole and read the answer to its end: (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer before the request is all sent; the answer counts
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    home = tmp_path_factory.mktemp("limits")
    url = f"sqlite:///{home / 'limits.db'}"
    upgrade(url)
    service = ServiceProcess(url, home, PIPETTE_SCHEDULER="0").start()
    yield service
    service.stop()


@pytest.mark.parametrize("size", [100_000, 200_000, 1_000_000, 5_000_000])
def test_oversized_headers_answer_431_with_the_error_body(served: ServiceProcess, size: int) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
    status, body = _answer(served.port, request)
    assert status == 431, (status, body)
    error = body["error"]
    assert isinstance(error, dict) and error["field"] == "headers" and error["fix"], error


def test_small_headers_still_pass(served: ServiceProcess) -> None:
    status, body = _answer(served.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Ok: " + b"a" * 8000
                           + b"\r\nConnection: close\r\n\r\n")
    assert (status, body) == (200, {"status": "ok"})


def test_a_body_over_the_limit_answers_413_the_client_reads(served: ServiceProcess) -> None:
    body = json.dumps({"model": {"pad": "x" * (3 * 1024 * 1024 // 2)}}).encode()
    request = urllib.request.Request(f"{served.base}/v1/plan", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer x"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 413
    assert json.loads(e.value.read())["error"]["field"] == "body"


def test_log_has_no_traceback(served: ServiceProcess) -> None:
    assert "Traceback" not in Path(served.log).read_text()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_serve_with_two_workers_answers_from_both(tmp_path: Path) -> None:
    """Issue 32, item 22: ``serve --workers 2`` (API processes only: PIPETTE_SCHEDULER=0 and a
    separate ``worker``) runs two processes on one port, each answering with the limits above."""
    url = f"sqlite:///{tmp_path / 'workers.db'}"
    upgrade(url)
    service = ServiceProcess(url, tmp_path, args=("--workers", "2"), PIPETTE_SCHEDULER="0").start()
    try:
        assert service.proc is not None
        workers: list[int] = []
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = [p for p in _children(service.proc.pid) if "spawn_main" in _cmdline(p)]
            time.sleep(0.5)
        assert len(workers) == 2, [_cmdline(p) for p in _children(service.proc.pid)]
        for _ in range(20):
            with urllib.request.urlopen(f"{service.base}/readyz", timeout=10) as r:
                assert r.status == 200
        status, body = _answer(service.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000
                               + b"\r\n\r\n")
        assert status == 431, body
    finally:
        service.stop()
    assert "Traceback" not in Path(service.log).read_text()


def test_several_workers_need_the_scheduler_elsewhere(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**os.environ, "PIPETTE_DATABASE_URL": f"sqlite:///{tmp_path / 'w.db'}", "PIPETTE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "service.admin", "serve", "--workers", "2"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode != 0 and "PIPETTE_SCHEDULER=0" in out.stderr and "Traceback" not in out.stderr, out


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
