"""Deleting a cluster (issue 43, item 10): refused while its work is queued or runs, then its
name and its place under the tenant's cap are free, and its finished jobs stay readable."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.migrations import upgrade
from service.models import Job, Trial, utcnow
from tests.service.conftest import BACKENDS, JOB_BODY, Api, fresh_database, make_api


def _set_state(api: Api, job_id: str, state: str) -> None:
    """What a scheduler would do (the test app runs none)."""
    with api.db.write() as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.state = state


def test_delete_refuses_unfinished_work_and_keeps_finished_jobs_readable(api: Api) -> None:
    h, c = api.token(), api.client
    cluster = api.local_cluster(h, name="doomed")
    job_id = c.post("/v1/jobs", json={**JOB_BODY, "cluster": "doomed"}, headers=h).json()["id"]
    for state in ("queued", "running"):
        _set_state(api, job_id, state)
        r = c.delete("/v1/clusters/doomed", headers=h)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert f"{job_id} ({state})" in error["message"] and "cancel" in error["fix"]
    _set_state(api, job_id, "succeeded")
    with api.db.write() as session:
        session.add(Trial(job_id=job_id, number=0, state="ok", label="tp1 pp1 dp2", config={}, steps=[],
                          attempts=[], runs=1, started_at=utcnow(), ended_at=utcnow()))
    profile = c.post("/v1/clusters/doomed/profile", headers=h).json()
    r = c.delete(f"/v1/clusters/{cluster['id']}", headers=h)
    assert r.status_code == 409 and profile["id"] in r.json()["error"]["message"]
    assert c.post(f"{profile['url']}/cancel", headers=h).status_code == 202

    r = c.delete(f"/v1/clusters/{cluster['id']}", headers=h)
    assert r.status_code == 204, r.text
    assert c.get("/v1/clusters/doomed", headers=h).status_code == 404
    assert c.get("/v1/clusters", headers=h).json()["items"] == []
    assert c.delete("/v1/clusters/doomed", headers=h).status_code == 404
    submitted = c.post("/v1/jobs", json={**JOB_BODY, "cluster": cluster["id"]}, headers=h)
    assert submitted.status_code == 404 and submitted.json()["error"]["field"] == "cluster"
    # The finished job, its trials and its events are still there.
    job = c.get(f"/v1/jobs/{job_id}", headers=h)
    assert job.status_code == 200 and job.json()["cluster_id"] == cluster["id"]
    assert [j["id"] for j in c.get("/v1/jobs", headers=h).json()["items"]] == [job_id]
    assert [t["number"] for t in c.get(f"/v1/jobs/{job_id}/trials", headers=h).json()["items"]] == [0]
    # The name is free again, for a new cluster with a new id.
    again = api.local_cluster(h, name="doomed")
    assert again["id"] != cluster["id"]


def test_another_tenant_cannot_delete_a_cluster(api: Api) -> None:
    alice, bob = api.token(), api.token()
    mine = api.local_cluster(alice, name="mine")
    assert api.client.delete(f"/v1/clusters/{mine['id']}", headers=bob).status_code == 404
    assert api.client.get(f"/v1/clusters/{mine['id']}", headers=alice).status_code == 200


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_deleted_cluster_frees_its_place_under_the_cap(backend: str, tmp_path: Path) -> None:
    with fresh_database(backend, tmp_path) as url:
        upgrade(url)
        for api in make_api(url, backend, tmp_path, max_clusters_per_tenant=1):
            h = api.token()
            api.local_cluster(h, name="one")
            full = api.client.post("/v1/clusters", json={"name": "two", "devices": 2}, headers=h)
            assert full.status_code == 409 and "DELETE /v1/clusters" in full.json()["error"]["fix"]
            assert api.client.delete("/v1/clusters/one", headers=h).status_code == 204
            api.local_cluster(h, name="two")
