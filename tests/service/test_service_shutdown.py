"""SIGTERM while someone watches a job, for real (issue 17, items 10 and 22): a service process
on SQLite runs a job of real trials with an event-stream client open; SIGTERM mid-trial must
stop the scheduler at once (no trial starts after the signal), end the stream, free the lease,
exit cleanly (no abort, no stack dump), and leave none of its local Ray's processes (agents
included) running. Before the fix, the process aborted (status 134) in its shutdown after Ray's
failure handler printed a stack dump; the issue also saw the scheduler start the next trial
~1 s after the signal, and Ray's dashboard and runtime-env agents outlive the service."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.db import Database
from service.migrations import upgrade
from service.models import Job, Lease, Trial
from tests.service.conftest import JOB_BODY, seed_profile
from tests.service.processes import ServiceProcess, admin_token, ray_processes_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_sigterm_with_a_watcher_stops_at_once_and_leaves_nothing(tmp_path: Path, deepspeed_ready: None) -> None:
    url = f"sqlite:///{tmp_path / 'pipette.db'}"
    upgrade(url)
    headers = admin_token(url, tmp_path, "shutdown-test")
    db = Database(url)
    service = ServiceProcess(url, tmp_path, PYTHONFAULTHANDLER="1")
    try:
        service.start()
        c = httpx.Client(base_url=service.base, headers=headers, timeout=30)
        cluster = c.post("/v1/clusters", json={"name": "local", "devices": 2}).json()
        seed_profile(db, cluster["id"])
        body = {**JOB_BODY, "training": {**JOB_BODY["training"], "global_batch": 8, "seq_len": 256},
                "budget": {"max_trials": 4, "steps": 8, "stop_probability": 0, "prune": False,
                           "retries": 0, "trial_timeout_s": 480}}
        job = c.post("/v1/jobs", json=body).json()

        # the watcher: an event stream held open until the server ends it
        seen: list[str] = []
        ended = threading.Event()

        def watch() -> None:
            try:
                with httpx.Client(base_url=service.base, headers=headers, timeout=None) as w, \
                        w.stream("GET", f"{job['url']}/events") as stream:
                    for line in stream.iter_lines():
                        if line.startswith("data: "):
                            seen.append(json.loads(line[6:])["kind"])
            except httpx.HTTPError:
                pass
            ended.set()

        threading.Thread(target=watch, daemon=True).start()
        wait_for(lambda: "trial_step" in seen, 600, "the first trial to step", service, every_s=0.1)
        assert service.proc is not None
        pid = service.proc.pid
        assert ray_processes_of(pid), "the service started no local Ray"
        started_before = seen.count("trial_started")
        signalled = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        code = service.proc.wait(120)
        took = time.monotonic() - signalled
        assert ended.wait(10), "the event stream stayed open after the service stopped"
        log = service.tail(200)
        # uvicorn ends a signalled shutdown by re-raising the signal: -15 is its clean exit
        assert code in (0, -signal.SIGTERM), log
        assert "SIGTERM received" not in log, "Ray's failure handler printed a stack dump"
        assert took < 60, f"the service took {took:.0f} s to stop\n{log}"
        assert seen.count("trial_started") == started_before, f"a trial started after SIGTERM: {seen}\n{log}"
        with db.read() as session:
            lease = session.query(Lease).one()
            assert lease.holder is None, "the lease was left held"
            assert session.get(Job, job["id"]).state == "running"  # type: ignore[union-attr]  # resumes on restart
            assert session.query(Trial).filter_by(job_id=job["id"]).count() == started_before
        left = wait_for(lambda: not ray_processes_of(pid) or None, 30, "the service's Ray processes to end")
        assert left
    finally:
        service.stop()
        db.dispose()
