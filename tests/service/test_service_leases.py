"""Leases on the real databases: one holder at a time per set of devices, queued work in
submission order, a dead holder's lease expiring and its job resumed first, and racing
schedulers (PostgreSQL: FOR UPDATE SKIP LOCKED; SQLite: the single writer) never both winning.
The end-to-end lease test with real trials is in test_service_jobs.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from service.leasekeeper import LeaseKeeper
from service.models import Job, Profile, utcnow
from service.repositories import clusters, jobs, leases
from tests.service.conftest import JOB_BODY, Api

RESOURCE_OF = "local:{address}"


def _setup(api: Api, n_jobs: int = 2) -> tuple[str, list[str]]:
    h = api.token()
    cluster = api.local_cluster(h)
    ids = [api.client.post("/v1/jobs", json=JOB_BODY, headers=h).json()["id"] for _ in range(n_jobs)]
    return RESOURCE_OF.format(address=cluster["address"]), ids


def test_one_holder_at_a_time_in_submission_order(isolated_api: Api) -> None:
    api = isolated_api
    resource, (first, second) = _setup(api)
    with api.db.write() as s:
        work = leases.claim(s, resource, "a", ttl_s=60)
    assert work is not None and (work.kind, work.id, work.resumed) == ("job", first, False)
    with api.db.write() as s:
        assert leases.claim(s, resource, "b", ttl_s=60) is None  # held: b waits its turn
        assert leases.renew(s, resource, "a", ttl_s=60) is True
        assert leases.renew(s, resource, "b", ttl_s=60) is False  # b never held it
        leases.release(s, resource, "b")  # not b's to release: nothing happens
    with api.db.read() as s:
        assert leases.get_lease(s, resource).holder == "a"  # type: ignore[union-attr]
    with api.db.write() as s:
        jobs.set_state(s, s.get(Job, first), "succeeded")  # type: ignore[arg-type]
        leases.release(s, resource, "a")
    with api.db.write() as s:
        work = leases.claim(s, resource, "b", ttl_s=60)
    assert work is not None and work.id == second


def test_a_dead_holders_lease_expires_and_its_job_resumes_first(isolated_api: Api) -> None:
    api = isolated_api
    resource, (first, _) = _setup(api)
    with api.db.write() as s:
        assert leases.claim(s, resource, "dead", ttl_s=0.3) is not None
        jobs.set_state(s, s.get(Job, first), "running")  # type: ignore[arg-type]
    with api.db.write() as s:
        assert leases.claim(s, resource, "alive", ttl_s=60) is None
    time.sleep(0.4)  # "dead" never renews
    with api.db.write() as s:
        work = leases.claim(s, resource, "alive", ttl_s=60)
    assert work is not None and (work.id, work.resumed) == (first, True)
    with api.db.write() as s:
        assert leases.renew(s, resource, "dead", ttl_s=60) is False  # a revenant finds it taken
    keeper = LeaseKeeper(api.db, resource, "dead", ttl_s=0.3)
    keeper.start()
    assert keeper.lost.wait(5), "a holder whose lease was taken must learn it"
    keeper.stop()


def test_profiles_and_jobs_share_the_queue(isolated_api: Api) -> None:
    api = isolated_api
    h = api.token()
    cluster = api.local_cluster(h)
    resource = RESOURCE_OF.format(address=cluster["address"])
    profile = api.client.post(f"/v1/clusters/{cluster['id']}/profile", headers=h).json()
    job = api.client.post("/v1/jobs", json=JOB_BODY, headers=h).json()
    with api.db.write() as s:
        work = leases.claim(s, resource, "a", ttl_s=60)
        assert work is not None and (work.kind, work.id) == ("profile", profile["id"])
        s.get(Profile, profile["id"]).state = "running"  # type: ignore[union-attr]
    # The holder dies mid-measurement: the profile is failed (not re-measured), the job goes next.
    with api.db.write() as s:
        work = leases.claim(s, resource, "b", ttl_s=60, now=utcnow() + timedelta(seconds=61))
    assert work is not None and (work.kind, work.id) == ("job", job["id"])
    with api.db.read() as s:
        dead = clusters.get_profile(s, cluster["id"], profile["id"])
        assert dead.state == "failed" and "interrupted" in (dead.error or {})["message"]


def test_racing_schedulers_never_both_win(isolated_api: Api) -> None:
    api = isolated_api
    resource, ids = _setup(api, n_jobs=3)
    won: list[str] = []
    barrier = threading.Barrier(6)

    def scheduler(name: str) -> None:
        barrier.wait()
        with api.db.write() as s:
            work = leases.claim(s, resource, name, ttl_s=60)
        if work is not None:
            won.append(name)

    threads = [threading.Thread(target=scheduler, args=(f"s{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1, won
    with api.db.read() as s:
        lease = leases.get_lease(s, resource)
        assert lease is not None and lease.holder == won[0] and lease.job_id == ids[0]


def test_a_queued_job_says_when_no_scheduler_serves_its_devices(isolated_api: Api) -> None:
    api = isolated_api
    resource, (first, second) = _setup(api)
    # no scheduler has ever polled these devices (this app runs none)
    notice = api.client.get(f"/v1/jobs/{first}", headers=_owner(api, first)).json()["notice"]
    assert notice and "no scheduler serves" in notice and resource in notice and "pipette serve" in notice
    # a scheduler polls them: the notice goes; it holds them for the first job: the second waits its turn
    with api.db.write() as s:
        work = leases.claim(s, resource, "a", ttl_s=60)
    assert work is not None and work.id == first
    assert api.client.get(f"/v1/jobs/{second}", headers=_owner(api, second)).json()["notice"] is None
    with api.db.read() as s:
        served = leases.get_lease(s, resource).served_at  # type: ignore[union-attr]
    assert served is not None
    # the holder dies and nobody polls for longer than UNSERVED_AFTER_S: the notice is back
    with api.db.write() as s:
        lease = leases.get_lease(s, resource)
        assert lease is not None
        lease.expires_at = lease.served_at = utcnow() - timedelta(seconds=leases.UNSERVED_AFTER_S + 1)
    assert "not in the last" in api.client.get(f"/v1/jobs/{second}", headers=_owner(api, second)).json()["notice"]
    # running and finished jobs never carry it
    with api.db.write() as s:
        jobs.set_state(s, s.get(Job, first), "running")  # type: ignore[arg-type]
    assert api.client.get(f"/v1/jobs/{first}", headers=_owner(api, first)).json()["notice"] is None


def _owner(api: Api, job_id: str) -> dict[str, str]:
    """Headers of a token of the job's tenant."""
    with api.db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        tenant = job.tenant
    return api.token(tenant)
