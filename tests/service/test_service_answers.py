"""The polled reads' answer cache (``service.answers``, issue 32 item 22): after any write the
reads answer the new rows, byte for byte what the models would serialize; and no tenant is
ever answered another's job, whatever the cache holds. SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.models import utcnow
from service.repositories import jobs as job_repo
from service.repositories.trials import get_row, start_trial
from service.schemas import JobList, TrialList
from service.views import Answers, job_out, trial_out
from tests.service.conftest import Api


def _answers(api: Api) -> Answers:
    answers: Answers = api.client.app.state.pipette.answers  # type: ignore[attr-defined]
    return answers


def _hits(api: Api) -> int:
    """Answers served from the row cache (``service.answers``) or the request cache (``service.changes``)."""
    reads = api.client.app.state.pipette.reads  # type: ignore[attr-defined]
    return _answers(api).jobs.hits + int(reads.hits)


def _expected(api: Api, tenant: str, job_id: str) -> tuple[bytes, bytes]:
    """The list and trials answers as the models serialize them, from ORM rows (no cache)."""
    from sqlalchemy import select

    from service.models import Job, Trial

    with api.db.read() as session:
        jobs = session.execute(select(Job).where(Job.tenant == tenant)
                               .order_by(Job.created_at.desc(), Job.id.desc())).scalars().all()
        trials = session.execute(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)).scalars().all()
        return (JobList(items=[job_out(j) for j in jobs], next_cursor=None).model_dump_json().encode(),
                TrialList(items=[trial_out(t) for t in trials]).model_dump_json().encode())


def test_cached_reads_answer_every_write(api: Api, job_body: Callable[..., dict[str, Any]]) -> None:
    """Writes that leave ``updated_at`` alone (the driver's progress, a trial's end, a new
    trial) show in the next read, though the same reads were just answered from the cache."""
    tenant = "answers-a"
    headers = api.token(tenant)
    api.local_cluster(headers)
    job_id = api.client.post("/v1/jobs", json=job_body(), headers=headers).json()["id"]
    with api.db.write() as session:
        start_trial(session, job_id, 0, label="tp1-pp1-dp2", config={"tp": 1}, predicted_step_time=1.0)

    def reads() -> tuple[bytes, bytes, dict[str, Any]]:
        listed = api.client.get("/v1/jobs", headers=headers)
        trials = api.client.get(f"/v1/jobs/{job_id}/trials", headers=headers)
        one = api.client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert listed.status_code == trials.status_code == one.status_code == 200
        return listed.content, trials.content, one.json()

    first = reads()
    assert first[:2] == _expected(api, tenant, job_id)
    hits = _hits(api)
    assert reads() == first and _hits(api) > hits  # answered from a cache (by row; by request on PostgreSQL)
    with api.db.write() as session:
        job = job_repo.get_job(session, tenant, job_id)
        updated = job.updated_at
        job.progress = {**job.progress, "trials_done": 1, "running_trial": 0}
        job.attempts = 3
        trial = get_row(session, job_id, 0)
        assert trial is not None
        trial.state, trial.measured_step_time, trial.ended_at = "ok", 0.9, utcnow()  # as the driver ends one
        start_trial(session, job_id, 1, label="tp2-pp1-dp1", config={"tp": 2}, predicted_step_time=2.0)
    with api.db.read() as session:
        assert job_repo.get_job(session, tenant, job_id).updated_at == updated  # the key is not updated_at
    after = reads()
    assert after[:2] == _expected(api, tenant, job_id)
    assert after[2]["progress"]["trials_done"] == 1 and after[2]["attempts"] == 3
    assert after[2]["notice"] is not None  # a queued job nothing serves: the notice is added per read
    assert [(t["number"], t["state"]) for t in api.client.get(f"/v1/jobs/{job_id}/trials", headers=headers)
            .json()["items"]] == [(0, "ok"), (1, "running")]


def test_cached_reads_never_answer_another_tenant(api: Api, job_body: Callable[..., dict[str, Any]]) -> None:
    """Tenant A's reads fill the cache; tenant B, with the same cluster name and job body,
    reads only its own job, and A's job id answers B as a missing job."""
    a, b = api.token("answers-one"), api.token("answers-two")
    api.local_cluster(a)
    api.local_cluster(b)
    job_a = api.client.post("/v1/jobs", json=job_body(), headers=a).json()["id"]
    job_b = api.client.post("/v1/jobs", json=job_body(), headers=b).json()["id"]
    with api.db.write() as session:
        start_trial(session, job_a, 0, label="tp1-pp1-dp2", config={"tp": 1}, predicted_step_time=1.0)
    for path in ("/v1/jobs", f"/v1/jobs/{job_a}", f"/v1/jobs/{job_a}/trials"):
        assert api.client.get(path, headers=a).status_code == 200
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=b).json()["items"]] == [job_b]
    assert api.client.get(f"/v1/jobs/{job_a}", headers=b).status_code == 404
    assert api.client.get(f"/v1/jobs/{job_a}/trials", headers=b).status_code == 404
    assert api.client.get(f"/v1/jobs/{job_b}/trials", headers=b).json()["items"] == []
    assert api.client.get(f"/v1/jobs/{job_b}", headers=b).json()["id"] == job_b


def test_a_job_read_is_one_statement_queued_or_running(isolated_api: Api,
                                                      job_body: Callable[..., dict[str, Any]]) -> None:
    """``GET /v1/jobs/{id}`` reads the job, its cluster and the lease (a queued job's notice) in
    one statement, and on PostgreSQL none while nothing changed (``service.changes``); the
    lease's columns are not part of the row cache's key, so a scheduler's poll (``served_at``)
    changes the notice without rebuilding the answer. (A database of its own: it writes the
    devices' lease, which every test's local cluster shares.)"""
    from datetime import timedelta

    from sqlalchemy import event

    from service.models import Cluster, Job, Lease
    from tests.service.test_service_changes import _wait_live

    api = isolated_api
    if api.backend == "postgresql":
        _wait_live(api)
    tenant = "answers-one-query"
    headers = api.token(tenant)
    api.local_cluster(headers)
    job_id = api.client.post("/v1/jobs", json=job_body(), headers=headers).json()["id"]
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # not SQLite's BEGIN, nor the token's lookup (its cache lasts 0.5 s here)
        if statement.lstrip().upper().startswith("SELECT") and "FROM tokens" not in statement:
            statements.append(statement)

    def read() -> tuple[dict[str, Any], int]:
        statements.clear()
        answer = api.client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert answer.status_code == 200 and len(statements) <= 1, statements
        body: dict[str, Any] = answer.json()
        return body, len(statements)

    event.listen(api.db.engine, "before_cursor_execute", count)
    try:
        first, queries = read()
        assert "no scheduler serves" in first["notice"] and queries == 1
        again, queries = read()
        assert again == first and queries == (0 if api.backend == "postgresql" else 1)
        with api.db.write() as session:
            job = session.get(Job, job_id)
            assert job is not None and job.state == "queued"
            resource = session.get(Cluster, job.cluster_id).resource  # type: ignore[union-attr]
            lease = session.get(Lease, resource) or Lease(resource=resource)
            lease.served_at = utcnow() - timedelta(seconds=1)  # a scheduler polled these devices
            session.add(lease)
        misses = _answers(api).jobs.misses
        served, queries = read()
        assert served["notice"] is None and queries == 1
        assert _answers(api).jobs.misses == misses  # the job's own row did not change: its answer is kept
        with api.db.write() as session:
            job_repo.set_state(session, session.get(Job, job_id), "running")  # type: ignore[arg-type]
        running, queries = read()
        assert running["state"] == "running" and running["notice"] is None and queries == 1
    finally:
        event.remove(api.db.engine, "before_cursor_execute", count)
