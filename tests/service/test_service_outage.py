"""The database going down while the service runs (issue 32, item 17): requests answered 500
with two tracebacks each and the scheduler logged ``claim failed`` every second. Now 503 with
Retry-After and the error body, one log line for the outage, and a scheduler that backs off.
The real PostgreSQL is reached through a TCP relay the test stops and starts again."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.auth import create_token
from service.db import Database
from service.migrations import upgrade
from service.scheduler import MAX_BACKOFF_S, Scheduler
from service.settings import Settings
from tests.service.conftest import JOB_BODY, remember_profile, seed_profile, throwaway_pg_database
from tests.service.processes import ServiceProcess, admin_token, wait_for


class Relay:
    """Forwards a local port to PostgreSQL; ``stop`` drops the port and every connection."""

    def __init__(self, port: int = 0) -> None:
        self.server = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.port = int(self.server.getsockname()[1])
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", 5432))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        except OSError:
            pass
        self.server.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.fixture
def relayed(tmp_path: Path) -> Iterator[tuple[str, Relay]]:
    with throwaway_pg_database("pipette_outage") as url:
        upgrade(url)
        relay = Relay()
        head, _, name = url.rpartition("/")
        yield head.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}") + "/" + name, relay
        relay.stop()


def test_a_database_outage_answers_503_logs_once_and_recovers(
        relayed: tuple[str, Relay], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url, relay = relayed
    db = Database(url)
    with db.write() as session:
        _, secret = create_token(session, "outage")
    h = {"Authorization": f"Bearer {secret}"}
    app = create_app(Settings(database_url=url, home=tmp_path, scheduler=False, token_cache_s=0.0), database=db)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v1/jobs", headers=h).status_code == 200
        relay.stop()
        caplog.clear()
        for _ in range(5):
            r = client.get("/v1/jobs", headers=h)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "5" and r.json()["error"]["fix"], r.text
        unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(unreachable) == 1, [r.getMessage() for r in caplog.records]
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"

        scheduler = Scheduler(db, Settings(database_url=url, home=tmp_path, poll_s=0.5))
        waits = []
        for _ in range(8):
            assert scheduler.run_once() is None
            waits.append(scheduler.wait_s())
        assert waits[0] == 1.0 and waits == sorted(waits) and waits[-1] == MAX_BACKOFF_S, waits
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1

        back = Relay(relay.port)
        try:
            deadline = time.monotonic() + 20
            while (status := client.get("/v1/jobs", headers=h).status_code) != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert status == 200
            assert scheduler.run_once() is None and scheduler.wait_s() == 0.5  # no work; no back-off
            assert any("reachable again" in r.getMessage() for r in caplog.records)
        finally:
            back.stop()
    db.dispose()
    logging.getLogger("pipette.service").handlers.clear()


def _events(c: httpx.Client, url: str) -> list[dict[str, Any]]:
    r = c.get(f"{url}/events", params={"follow": "false"})
    if r.status_code != 200:  # 503 while the database is away
        return []
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_database_lost_mid_trial_under_serve_is_said_in_one_line(
        relayed: tuple[str, Relay], tmp_path: Path, deepspeed_ready: None) -> None:
    """Issue 43, item 7: a real ``pipette-admin serve`` loses its database in the middle of a
    trial. Its log has the INFO lines (``reachable again``; only ``worker`` set up logging) and no
    traceback, and the rerun trial's event says the database was unreachable, not that the
    service stopped."""
    url, relay = relayed
    headers = admin_token(url, tmp_path, "outage-serve")
    service = ServiceProcess(url, tmp_path, PIPETTE_LEASE_TTL_S="3")
    try:
        service.start()
        c = httpx.Client(base_url=service.base, headers=headers, timeout=30)
        cluster = c.post("/v1/clusters", json={"name": "local", "devices": 2}).json()
        db = Database(url)
        seed_profile(db, cluster["id"])
        body = {**JOB_BODY, "training": {**JOB_BODY["training"], "global_batch": 8, "seq_len": 256},
                "budget": {"max_trials": 1, "steps": 8, "stop_probability": 0, "prune": False, "retries": 0,
                           "trial_timeout_s": 480}}
        job = c.post("/v1/jobs", json=body).json()
        wait_for(lambda: (r := c.get(f"{job['url']}/trials/0")).status_code == 200 and r.json()["steps"], 900,
                 "trial 0 to be mid-run", service, every_s=0.1)
        relay.stop()
        time.sleep(8)  # past the lease's 3 s: the scheduler lets the job go
        back = Relay(relay.port)
        try:
            reasons = wait_for(lambda: [e["data"]["reason"] for e in _events(c, job["url"])
                                        if e["kind"] == "trial_interrupted"], 300,
                               "the resumed job's trial_interrupted event", service)
            db.dispose()  # this test's own pooled connections died with the relay
            remember_profile(db, cluster["id"])
            db.dispose()
        finally:
            back.stop()
    finally:
        service.stop()
    log = service.log.read_text(errors="replace")
    assert "the database is reachable again" in log, service.tail()
    assert "Traceback" not in log, service.tail(120)
    assert len(reasons) == 1 and reasons[0].startswith("the database was unreachable"), reasons
    assert "service stopped" not in reasons[0]
