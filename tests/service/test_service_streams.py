"""Event streams are bounded (issue 32, item 12): 600 idle streams of one tenant were
accepted, 300 took ~0.9 of a core and slowed every other tenant's reads, and a revoked token's
open stream delivered 42 more events (the job was busy). Now: a cap per tenant and one in all (429 with
Retry-After), idle streams end, a revoked token's streams end within seconds. Against a real
``pipette-admin serve`` (scheduler off: the jobs stay queued, their streams stay open)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from service.auth import revoke_token
from service.db import Database
from service.migrations import upgrade
from service.models import Token
from service.repositories.events import add_event
from tests.service.conftest import JOB_BODY
from tests.service.processes import ServiceProcess, admin_token


def _job_url(client: httpx.Client, headers: dict[str, str]) -> str:
    assert client.post("/v1/clusters", json={"name": "local", "devices": 2}, headers=headers).status_code == 201
    r = client.post("/v1/jobs", json=JOB_BODY, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["url"])


@contextlib.contextmanager
def _served(tmp_path: Path, **env: str) -> Iterator[tuple[ServiceProcess, httpx.Client]]:
    url = f"sqlite:///{tmp_path / f'streams-{uuid.uuid4().hex[:6]}.db'}"
    upgrade(url)
    service = ServiceProcess(url, tmp_path, PIPETTE_SCHEDULER="0", PIPETTE_TOKEN_CACHE_S="0.5", **env)
    try:
        service.start()
        with httpx.Client(base_url=service.base, timeout=20) as client:
            yield service, client
    finally:
        service.stop()


def _open(client: httpx.Client, stack: contextlib.ExitStack, url: str, headers: dict[str, str]) -> Any:
    return stack.enter_context(client.stream("GET", f"{url}/events", headers=headers))


def _ends_within(response: Any, seconds: float) -> float:
    """Read the stream to its end; how long that took (fails past ``seconds``)."""
    start = time.monotonic()
    for _ in response.iter_lines():
        assert time.monotonic() - start < seconds, "the stream is still open"
    return time.monotonic() - start


def test_streams_are_capped_per_tenant_and_in_all_and_end_when_revoked(tmp_path: Path) -> None:
    with _served(tmp_path, PIPETTE_MAX_STREAMS_PER_TENANT="2", PIPETTE_MAX_STREAMS="3") as (service, client):
        a, b, c = (admin_token(service.url, tmp_path, f"tenant-{name}") for name in "abc")
        urls = {name: _job_url(client, h) for name, h in (("a", a), ("b", b), ("c", c))}
        with contextlib.ExitStack() as stack:
            first = [_open(client, stack, urls["a"], a) for _ in range(2)]
            assert all(r.status_code == 200 for r in first)
            over = _open(client, stack, urls["a"], a)
            over.read()
            assert over.status_code == 429 and over.headers["retry-after"] == "10", over.text
            assert "PIPETTE_MAX_STREAMS_PER_TENANT" in over.json()["error"]["message"]
            other = _open(client, stack, urls["b"], b)
            assert other.status_code == 200  # another tenant is not held back by a's share
            full = _open(client, stack, urls["c"], c)
            full.read()
            assert full.status_code == 429 and "PIPETTE_MAX_STREAMS" in full.json()["error"]["message"], full.text
            assert client.get("/v1/jobs", headers=c).status_code == 200  # only streams are capped

            db = Database(service.url)
            busy = threading.Event()

            def add_events() -> None:  # a busy job: the stream has rows at every poll
                job_id = urls["b"].rsplit("/", 1)[1]
                while not busy.is_set():
                    with db.write() as session:
                        add_event(session, job_id, "progress", {"step": 1})
                    time.sleep(0.1)

            adder = threading.Thread(target=add_events, daemon=True)
            adder.start()
            with db.write() as session:
                token = session.query(Token).filter(Token.tenant == "tenant-b").one()
                revoke_token(session, token.id)
            try:
                assert _ends_within(other, 10.0) < 10.0
            finally:
                busy.set()
                adder.join()
                db.dispose()
        # the closed streams gave their slots back
        deadline = time.monotonic() + 10
        while True:
            with client.stream("GET", f"{urls['c']}/events", headers=c, params={"follow": "false"}) as again:
                again.read()
                if again.status_code == 200 or time.monotonic() > deadline:
                    break
            time.sleep(0.5)
        assert again.status_code == 200, again.text
    assert "Traceback" not in service.log.read_text()


def test_an_idle_stream_ends(tmp_path: Path) -> None:
    with _served(tmp_path, PIPETTE_STREAM_IDLE_S="2") as (service, client):
        h = admin_token(service.url, tmp_path, "idle")
        url = _job_url(client, h)
        with client.stream("GET", f"{url}/events", headers=h) as stream:
            assert stream.status_code == 200
            assert 1.5 < _ends_within(stream, 8.0) < 8.0

