"""One contract, two trial stores (``pipette.trials.TrialStore``): the CLI's JSON-lines file and
the service's database (``SqlTrialStore``, on SQLite and on PostgreSQL) keep the same records,
lose nothing, read the old formats, and refuse a record they cannot read by saying where it is
and how to repair it."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pipette.errors import StoreError
from pipette.measurement import Measurement
from pipette.trials import JsonlTrialStore, TrialRecord, TrialStore
from service.db import Database
from service.migrations import upgrade
from service.models import Cluster, Job, Trial
from service.repositories import trials
from tests.service.conftest import BACKENDS
from tests.trial_records import FIXTURES, a_record

STORES = ("jsonl", *BACKENDS)


@dataclass
class Opened:
    """A store of one backend: ``open()`` gives it in a fresh transaction (the database) or a
    fresh object (the file); ``put_raw`` writes stored JSON as an older Pipette (or a corrupted
    disk) left it; ``where`` is how an error names the place of the n-th raw record."""

    kind: str
    open: Callable[[], AbstractContextManager[TrialStore]]
    put_raw: Callable[[list[dict[str, Any]]], None]
    where: Callable[[int], str]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opened]:
    if request.param == "jsonl":
        path = tmp_path / "trials" / "cluster.jsonl"

        @contextlib.contextmanager
        def open_file() -> Iterator[TrialStore]:
            yield JsonlTrialStore(path)

        def put_lines(raw: list[dict[str, Any]]) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(d) + "\n" for d in raw))

        yield Opened("jsonl", open_file, put_lines, lambda n: f"{path}: line {n + 1} ")
        return
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_session_url")  # one database: a job of its own keeps it apart
    db = Database(url)
    job_id = _job(db)

    @contextlib.contextmanager
    def open_db() -> Iterator[TrialStore]:
        with db.write() as session:
            yield trials.SqlTrialStore(session, job_id)

    def put_rows(raw: list[dict[str, Any]]) -> None:
        """Rows as a service before this version wrote them: a record per ended trial, its
        attempts without times of their own."""
        with db.write() as session:
            for n, d in enumerate(raw):
                session.add(Trial(job_id=job_id, number=n, state="ok", label="", config={}, steps=[], record=d,
                                  attempts=[d], runs=1, started_at=datetime(2026, 11, 26, 8, 0, n, tzinfo=UTC),
                                  ended_at=datetime(2026, 11, 26, 8, 1, n, tzinfo=UTC)))

    yield Opened(request.param, open_db, put_rows, lambda n: f"job {job_id}: the record of attempt 1 of trial {n} ")
    db.dispose()


def _job(db: Database) -> str:
    cluster_id, job_id = str(uuid.uuid4()), str(uuid.uuid4())
    with db.write() as session:
        session.add(Cluster(id=cluster_id, tenant="t", name=f"c-{cluster_id[:8]}", kind="local", address="h",
                            resource=f"local:{cluster_id}", nodes=[], devices_per_node=4))
        session.flush()
        session.add(Job(id=job_id, tenant="t", cluster_id=cluster_id, state="running", model={}, training={},
                        options={}, progress={}))
    return job_id


def _records() -> list[TrialRecord]:
    """Attempts as a job makes them: a retried crash, a re-timing trial, another stack's trial,
    a script trial timed by its mean, and a key only a newer Pipette writes."""
    crash = Measurement("failed", (), 512, (), (1.5,), "rank 1 exited with status 1:\nRuntimeError: ünïcode boom",
                        {"wall_s": 4.0, "backend": None, "phase": "build", "output_tail": "Traceback ...\nboom",
                         "not_retried": ""})
    script = Measurement("ok", (0.5, 0.7, 0.6), 512, (), (3.0, 2.5), "", {"backend": "script",
                         "peak_rss_bytes": [10, 20], "timing_source": "reporter"}, statistic="mean")
    return [
        a_record(0),
        a_record(1, measurement=crash),
        a_record(1, attempt=2),
        a_record(2, purpose="retime", stack="fsdp", job_key="another job"),
        a_record(3, measurement=script, extra={"from_a_newer_pipette": {"kept": [1, 2.5, None]}}),
    ]


def test_an_empty_store_holds_nothing(store: Opened) -> None:
    with store.open() as s:
        assert (s.records(), s.count(), s.find("tp1-pp1-dp4-mbs2-z1-rc:none-1f1b")) == ([], 0, [])


def test_what_is_appended_comes_back_whole(store: Opened) -> None:
    records = _records()
    for r in records:
        with store.open() as s:  # one transaction per attempt, as the tuner ends them
            s.append(r)
    with store.open() as s:
        back = s.records()
        assert back == records  # every field: the measurement, its extras, the times, unknown keys
        assert [r.to_dict() for r in back] == [r.to_dict() for r in records]
        assert [r.details for r in back] == [r.details for r in records]
        assert s.count() == 5
        assert s.find(records[1].label) == records[1:3]  # both attempts of the retried trial
        assert s.records(job_key="another job") == [records[3]]
        assert s.find(records[0].label, job_key="nobody") == []


def test_an_old_record_loads(store: Opened) -> None:
    raw = [json.loads(line) for line in (FIXTURES / "2026-11-21-first.jsonl").read_text().splitlines()]
    store.put_raw(raw)
    with store.open() as s:
        ok, failed = s.records()
    assert (ok.status, failed.status, ok.stack, ok.purpose, ok.perf.hfu) == ("ok", "failed", "pipette", "search", 0.0)
    assert ok.measurement == Measurement.from_dict(raw[0]["measurement"])
    if store.kind == "jsonl":
        assert ok.started_at is None  # the file never kept times
    else:  # the row's times stand for its last attempt's
        assert ok.started_at == datetime(2026, 11, 26, 8, 0, 0, tzinfo=UTC)
        assert failed.ended_at == datetime(2026, 11, 26, 8, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(("bad", "why"), [
    ({"number": 0}, "has no 'perf' key"),
    ({**a_record().to_dict(), "measurement": {"status": "exploded"}}, "status 'exploded'"),
])
def test_a_record_that_cannot_be_read_says_where_and_how_to_repair_it(
    store: Opened, bad: dict[str, Any], why: str
) -> None:
    store.put_raw([a_record().to_dict(), bad])
    with store.open() as s, pytest.raises(StoreError) as caught:
        s.records()
    text = str(caught.value)
    assert text.startswith(store.where(1)) and why in text, text
    assert caught.value.fix and ("delete or repair line 2" in caught.value.fix or "delete it" in caught.value.fix)


# ---- the database's own rules -------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_running_and_interrupted_trials_are_left_for_the_tuner_to_rerun(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = _db(backend, tmp_path, request)
    job_id = _job(db)
    first, second = a_record(0), a_record(1)
    with db.write() as session:
        store = trials.SqlTrialStore(session, job_id)
        store.append(first)
        trials.start_trial(session, job_id, 1, label=second.label, config=second.config.to_dict(),
                           predicted_step_time=0.3)
        assert store.records() == [first]
        trials.interrupt_running(session, job_id)
        assert store.records() == [first] and store.count() == 1
        store.append(replace(second, started_at=None, ended_at=None))  # a record made outside the tuner
        back = store.records()[1]
        row = trials.get_row(session, job_id, 1)
        assert row is not None and row.state == "ok" and row.measured_step_time == second.measurement.step_time
        assert back.started_at == row.started_at and back.ended_at is not None  # the row's times stand in
        assert trials.row_record(row) == back
    db.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_jobs_records_on_the_same_devices_are_typed_priors(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = _db(backend, tmp_path, request)
    job_id = _job(db)
    with db.write() as session:
        trials.SqlTrialStore(session, job_id).append(a_record(0))
        job = session.get(Job, job_id)
        assert job is not None
        resource = session.get(Cluster, job.cluster_id).resource  # type: ignore[union-attr]
        assert trials.prior_records(session, resource, exclude_job="another") == [a_record(0)]
        assert trials.prior_records(session, resource, exclude_job=job_id) == []
    db.dispose()


def _db(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_session_url")
    return Database(url)
