"""One tenant cannot starve the others (issue 17, item 12): a cluster's queued profile answers
every further profile request (they coalesce), a tenant's queued work is capped
(``PIPETTE_MAX_QUEUED_PER_TENANT``, 429), a queued profile can be cancelled, and the shared
devices serve the tenants in turn (the least recently served first), not in submission order.

On SQLite and the real PostgreSQL; the scheduler is off, so the tests claim work themselves
(as a scheduler does) and finish it by hand.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipette.errors import SpecError
from service.models import Cluster, Job, Profile, utcnow
from service.repositories import clusters, jobs, leases
from service.settings import Settings
from tests.service.conftest import BACKENDS, JOB_BODY, Api, make_api

LIMIT = 3


@pytest.fixture(params=BACKENDS)
def limited_api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Api]:
    """Like ``api``, with a queue of LIMIT per tenant."""
    from service.migrations import upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'api.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_session_url")
    yield from make_api(url, request.param, tmp_path, max_queued_per_tenant=LIMIT)


def _resource(cluster: dict[str, Any]) -> str:
    return f"local:{cluster['address']}"


def _claim_all(api: Api, resource: str) -> list[tuple[str, str]]:
    """Claim, finish and release the devices' work until none is left, as one scheduler would:
    (kind, id) in the order it was served."""
    served: list[tuple[str, str]] = []
    for _ in range(50):
        with api.db.write() as s:
            work = leases.claim(s, resource, "scheduler", ttl_s=60)
        if work is None:
            return served
        served.append((work.kind, work.id))
        with api.db.write() as s:  # what the scheduler and the job's driver write when they start and end
            if work.kind == "profile":
                profile = s.get(Profile, work.id)
                assert profile is not None
                profile.state, profile.started_at = "running", profile.started_at or utcnow()
                profile.state, profile.finished_at = "succeeded", utcnow()
            else:
                job = s.get(Job, work.id)
                assert job is not None
                job.started_at = job.started_at or utcnow()
                jobs.set_state(s, job, "succeeded")
            leases.release(s, resource, "scheduler")
    raise AssertionError(f"the queue never emptied: {served}")


# ---- 1. identical queued profiles coalesce ------------------------------------------

def test_a_profile_request_while_one_is_queued_answers_that_one(isolated_api: Api) -> None:
    api, c = isolated_api, isolated_api.client
    h = api.token()
    cluster = api.local_cluster(h)
    other = api.local_cluster(h, name="other")
    first = c.post(f"/v1/clusters/{cluster['id']}/profile", headers=h)
    assert first.status_code == 202, first.text
    for ref in (cluster["id"], cluster["name"]):
        again = c.post(f"/v1/clusters/{ref}/profile", headers=h)
        assert again.status_code == 202, again.text
        assert again.json()["id"] == first.json()["id"] and again.headers["location"] == first.json()["url"]
    # another cluster's request is its own profile (the devices are the same, the nodes may not be)
    theirs = c.post(f"/v1/clusters/{other['id']}/profile", headers=h).json()
    assert theirs["id"] != first.json()["id"] and theirs["cluster_id"] == other["id"]
    with api.db.read() as s:
        assert s.query(Profile).filter(Profile.cluster_id == cluster["id"]).count() == 1
    # once it is being measured, a request is a new measurement (the devices may have changed)
    with api.db.write() as s:
        work = leases.claim(s, _resource(cluster), "scheduler", ttl_s=60)
    assert work is not None and work.id == first.json()["id"]
    later = c.post(f"/v1/clusters/{cluster['id']}/profile", headers=h).json()
    assert later["id"] != first.json()["id"] and later["state"] == "queued"
    assert c.post(f"/v1/clusters/{cluster['id']}/profile", headers=h).json()["id"] == later["id"]


def test_profile_requests_at_once_queue_one_profile(isolated_api: Api) -> None:
    api = isolated_api
    h = api.token()
    cluster_id = api.local_cluster(h)["id"]
    got: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def request() -> None:
        try:
            barrier.wait()
            with api.db.write() as s:
                cluster = s.get(Cluster, cluster_id)
                assert cluster is not None
                got.append(clusters.request_profile(s, cluster).id)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=request) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(got) == 6 and len(set(got)) == 1, got


# ---- 2. a tenant's queue is capped ---------------------------------------------------

def test_a_tenant_beyond_its_queue_limit_gets_429(limited_api: Api) -> None:
    api, c = limited_api, limited_api.client
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    h = api.token(tenant)
    local = api.local_cluster(h)
    other = api.local_cluster(h, name="other")
    queued = [c.post("/v1/jobs", json=JOB_BODY, headers=h).json()["id"] for _ in range(LIMIT - 1)]
    profile = c.post(f"/v1/clusters/{local['id']}/profile", headers=h)
    assert profile.status_code == 202, profile.text

    full = c.post("/v1/jobs", json=JOB_BODY, headers=h)
    assert full.status_code == 429, full.text
    error = full.json()["error"]
    assert error["message"] == (f"tenant {tenant} has {LIMIT} queued jobs and profiles, "
                                f"the limit (PIPETTE_MAX_QUEUED_PER_TENANT) is {LIMIT}"), error
    assert "POST /v1/jobs/{id}/cancel" in error["fix"] and "/profiles/{profile_id}/cancel" in error["fix"], error
    assert int(full.headers["retry-after"]) > 0
    refused = c.post(f"/v1/clusters/{other['id']}/profile", headers=h)
    assert refused.status_code == 429 and "PIPETTE_MAX_QUEUED_PER_TENANT" in refused.json()["error"]["message"]
    assert "retry-after" in refused.headers
    # asking again for the queued profile adds no work: it answers it
    same = c.post(f"/v1/clusters/{local['id']}/profile", headers=h)
    assert same.status_code == 202 and same.json()["id"] == profile.json()["id"]
    with api.db.read() as s:
        assert s.query(Job).filter(Job.tenant == tenant).count() == LIMIT - 1  # the refused job was not stored

    # another tenant's queue is its own
    bob = api.token()
    api.local_cluster(bob)
    assert c.post("/v1/jobs", json=JOB_BODY, headers=bob).status_code == 202

    # cancelling queued work makes room: a job, then a profile
    assert c.post(f"/v1/jobs/{queued[0]}/cancel", headers=h).status_code == 202
    assert c.post("/v1/jobs", json=JOB_BODY, headers=h).status_code == 202
    assert c.post("/v1/jobs", json=JOB_BODY, headers=h).status_code == 429
    assert c.post(f"{profile.json()['url']}/cancel", headers=h).status_code == 202
    assert c.post(f"/v1/clusters/{other['id']}/profile", headers=h).status_code == 202


def test_submissions_at_once_never_pass_the_limit(limited_api: Api) -> None:
    api = limited_api
    h = api.token()
    api.local_cluster(h)
    statuses: list[int] = []
    barrier = threading.Barrier(2 * LIMIT)

    def submit() -> None:
        barrier.wait()
        statuses.append(api.client.post("/v1/jobs", json=JOB_BODY, headers=h).status_code)

    threads = [threading.Thread(target=submit) for _ in range(2 * LIMIT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(statuses) == [202] * LIMIT + [429] * LIMIT, statuses


def test_the_queue_limit_is_a_setting() -> None:
    home = {"PIPETTE_HOME": "/tmp/x"}
    assert Settings.from_env(home).max_queued_per_tenant == 20
    assert Settings.from_env({**home, "PIPETTE_MAX_QUEUED_PER_TENANT": "5"}).max_queued_per_tenant == 5
    for bad in ("0", "lots"):
        with pytest.raises(SpecError) as e:
            Settings.from_env({**home, "PIPETTE_MAX_QUEUED_PER_TENANT": bad})
        assert e.value.field == "PIPETTE_MAX_QUEUED_PER_TENANT"


# ---- 3. a queued profile can be cancelled --------------------------------------------

def test_cancel_a_profile(isolated_api: Api) -> None:
    api, c = isolated_api, isolated_api.client
    h = api.token()
    cluster = api.local_cluster(h)
    profile = c.post(f"/v1/clusters/{cluster['id']}/profile", headers=h).json()
    cancelled = c.post(f"{profile['url']}/cancel", headers=h)
    assert cancelled.status_code == 202, cancelled.text
    body = cancelled.json()
    assert body["id"] == profile["id"] and body["state"] == "cancelled" and body["finished_at"] is not None
    assert c.get(profile["url"], headers=h).json()["state"] == "cancelled"
    again = c.post(f"{profile['url']}/cancel", headers=h)
    assert again.status_code == 409 and again.json()["error"]["field"] == "profile_id"
    assert "cancelled already" in again.json()["error"]["message"]
    # the devices never measure it
    with api.db.write() as s:
        assert leases.claim(s, _resource(cluster), "scheduler", ttl_s=60) is None
    # nor does it answer the next request: that is a new profile
    fresh = c.post(f"/v1/clusters/{cluster['id']}/profile", headers=h).json()
    assert fresh["id"] != profile["id"] and fresh["state"] == "queued"

    # one being measured finishes by itself
    with api.db.write() as s:
        work = leases.claim(s, _resource(cluster), "scheduler", ttl_s=60)
    assert work is not None and work.id == fresh["id"]
    running = c.post(f"{fresh['url']}/cancel", headers=h)
    assert running.status_code == 409 and running.json()["error"]["field"] == "profile_id", running.text
    assert "being measured" in running.json()["error"]["message"]
    assert c.get(fresh["url"], headers=h).json()["state"] == "running"
    with api.db.write() as s:
        clusters.get_profile(s, cluster["id"], fresh["id"]).state = "succeeded"
        leases.release(s, _resource(cluster), "scheduler")
    done = c.post(f"{fresh['url']}/cancel", headers=h)
    assert done.status_code == 409 and "succeeded already" in done.json()["error"]["message"]


def test_another_tenants_profile_cannot_be_cancelled(api: Api) -> None:
    c = api.client
    alice, bob = api.token(), api.token()
    cluster = api.local_cluster(alice, name="shared")
    bobs = api.local_cluster(bob, name="shared")
    profile = c.post(f"/v1/clusters/{cluster['id']}/profile", headers=alice).json()
    missing = "00000000-0000-0000-0000-000000000000"
    theirs = c.post(f"/v1/clusters/{cluster['id']}/profiles/{profile['id']}/cancel", headers=bob)
    nobodys = c.post(f"/v1/clusters/{missing}/profiles/{profile['id']}/cancel", headers=bob)
    assert theirs.status_code == nobodys.status_code == 404
    assert theirs.text.replace(cluster["id"], missing) == nobodys.text  # word for word the same answer
    # through bob's own cluster of the same name: not his cluster's profile
    by_name = c.post(f"/v1/clusters/shared/profiles/{profile['id']}/cancel", headers=bob)
    assert by_name.status_code == 404 and by_name.json()["error"]["field"] == "profile_id"
    by_id = c.post(f"/v1/clusters/{bobs['id']}/profiles/{profile['id']}/cancel", headers=bob)
    assert by_id.status_code == 404
    assert c.get(profile["url"], headers=alice).json()["state"] == "queued"  # bob cancelled nothing


# ---- 4. the shared devices serve the tenants in turn ---------------------------------

def test_a_tenants_long_queue_delays_another_by_one_piece_of_work(isolated_api: Api) -> None:
    api, c = isolated_api, isolated_api.client
    alice, bob = api.token(), api.token()
    profiles = []
    for i in range(5):  # 5 clusters on the same local devices, a profile of each
        cluster = api.local_cluster(alice, name=f"a{i}")
        profiles.append(c.post(f"/v1/clusters/{cluster['id']}/profile", headers=alice).json()["id"])
    api.local_cluster(bob)
    job = c.post("/v1/jobs", json=JOB_BODY, headers=bob).json()["id"]
    served = _claim_all(api, _resource(cluster))
    assert served == [("profile", profiles[0]), ("job", job)] + [("profile", p) for p in profiles[1:]]


def test_tenants_take_turns_and_each_keeps_its_own_order(isolated_api: Api) -> None:
    api, c = isolated_api, isolated_api.client
    alice, bob = api.token(), api.token()
    a = api.local_cluster(alice)
    b = api.local_cluster(bob)
    a_jobs = [c.post("/v1/jobs", json=JOB_BODY, headers=alice).json()["id"] for _ in range(3)]
    b_jobs = [c.post("/v1/jobs", json=JOB_BODY, headers=bob).json()["id"] for _ in range(2)]
    b_profile = c.post(f"/v1/clusters/{b['id']}/profile", headers=bob).json()["id"]
    served = _claim_all(api, _resource(a))
    assert served == [("job", a_jobs[0]), ("job", b_jobs[0]), ("job", a_jobs[1]), ("job", b_jobs[1]),
                      ("job", a_jobs[2]), ("profile", b_profile)]


def test_a_tenant_never_served_goes_before_one_served_before(isolated_api: Api) -> None:
    api, c = isolated_api, isolated_api.client
    alice, bob = api.token(), api.token()
    cluster = api.local_cluster(alice)
    api.local_cluster(bob)
    first = c.post("/v1/jobs", json=JOB_BODY, headers=alice).json()["id"]
    assert _claim_all(api, _resource(cluster)) == [("job", first)]
    # alice's next job is older than bob's first, but alice was served and bob never was
    older = c.post("/v1/jobs", json=JOB_BODY, headers=alice).json()["id"]
    bobs = c.post("/v1/jobs", json=JOB_BODY, headers=bob).json()["id"]
    assert _claim_all(api, _resource(cluster)) == [("job", bobs), ("job", older)]


def test_a_dead_holders_job_still_resumes_before_any_tenants_turn(isolated_api: Api) -> None:
    api, c = isolated_api, isolated_api.client
    alice, bob = api.token(), api.token()
    cluster = api.local_cluster(alice)
    api.local_cluster(bob)
    mine = c.post("/v1/jobs", json=JOB_BODY, headers=alice).json()["id"]
    c.post("/v1/jobs", json=JOB_BODY, headers=bob)
    with api.db.write() as s:
        work = leases.claim(s, _resource(cluster), "dead", ttl_s=0.01)
        assert work is not None and work.id == mine
        jobs.set_state(s, s.get(Job, mine), "running")  # type: ignore[arg-type]
    import time

    time.sleep(0.05)  # "dead" never renews: alice's job resumes, though bob was never served
    with api.db.write() as s:
        work = leases.claim(s, _resource(cluster), "alive", ttl_s=60)
    assert work is not None and (work.id, work.resumed) == (mine, True)


# ---- the API documents it ------------------------------------------------------------

def test_openapi_documents_profile_cancel_and_429(api: Api) -> None:
    paths = api.client.get("/openapi.json").json()["paths"]
    cancel = paths["/v1/clusters/{cluster_id}/profiles/{profile_id}/cancel"]["post"]["responses"]
    assert {"202", "404", "409"} <= set(cancel)
    assert "cancelled" in str(api.client.get("/openapi.json").json()["components"]["schemas"]["ProfileOut"])
    for path in ("/v1/jobs", "/v1/clusters/{cluster_id}/profile"):
        too_many = paths[path]["post"]["responses"]["429"]
        assert too_many["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")
