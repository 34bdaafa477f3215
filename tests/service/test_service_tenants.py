"""Tenant isolation: a token sees only its own tenant's clusters and jobs; another tenant's
job answers exactly like a job that does not exist (404), on every route."""

from __future__ import annotations

from tests.service.conftest import JOB_BODY, Api


def test_another_tenants_job_is_not_found(api: Api) -> None:
    c = api.client
    alice, bob = api.token("alice-" + api.backend), api.token("bob-" + api.backend)
    api.local_cluster(alice)
    job = c.post("/v1/jobs", json=JOB_BODY, headers=alice).json()
    missing = "00000000-0000-0000-0000-000000000000"
    for suffix in ("", "/trials", "/trials/0", "/best", "/best/files/launch.sh", "/plan", "/events"):
        theirs = c.get(f"/v1/jobs/{job['id']}{suffix}", headers=bob)
        nobodys = c.get(f"/v1/jobs/{missing}{suffix}", headers=bob)
        assert theirs.status_code == nobodys.status_code == 404, suffix
        assert theirs.json()["error"]["field"] == nobodys.json()["error"]["field"] == "job_id"
        assert theirs.text.replace(job["id"], missing) == nobodys.text  # word for word the same answer
    assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=bob).status_code == 404
    assert c.get(f"/v1/jobs/{job['id']}", headers=alice).json()["state"] == "queued"  # bob cancelled nothing

    assert c.get("/v1/jobs", headers=bob).json() == {"items": [], "next_cursor": None}
    assert [j["id"] for j in c.get("/v1/jobs", headers=alice).json()["items"]] == [job["id"]]


def test_clusters_are_per_tenant(api: Api) -> None:
    c = api.client
    alice, bob = api.token(), api.token()
    mine = api.local_cluster(alice, name="shared-name")
    assert c.get(f"/v1/clusters/{mine['id']}", headers=bob).status_code == 404
    assert c.get("/v1/clusters/shared-name", headers=bob).status_code == 404
    assert c.post(f"/v1/clusters/{mine['id']}/profile", headers=bob).status_code == 404
    # Both tenants may use a name; bob cannot submit to alice's cluster by its id.
    theirs = api.local_cluster(bob, name="shared-name")
    assert theirs["id"] != mine["id"]
    r = c.post("/v1/jobs", json={**JOB_BODY, "cluster": mine["id"]}, headers=bob)
    assert r.status_code == 404 and r.json()["error"]["field"] == "cluster"
    assert [x["id"] for x in c.get("/v1/clusters", headers=bob).json()["items"]] == [theirs["id"]]
    plan = c.post("/v1/plan", json={"model": "tiny-llama", "training": {"global_batch": 8, "seq_len": 64},
                                    "cluster": mine["id"]}, headers=bob)
    assert plan.status_code == 404


def test_busy_devices_do_not_reveal_another_tenants_job(isolated_api: Api) -> None:
    from service.repositories import leases

    api = isolated_api
    c = api.client
    alice, bob = api.token(), api.token()
    a = api.local_cluster(alice, name="a")
    b = api.local_cluster(bob, name="b")  # the same local devices: one lease
    job = c.post("/v1/jobs", json={**JOB_BODY, "cluster": "a"}, headers=alice).json()
    with api.db.write() as session:
        work = leases.claim(session, f"local:{a['address']}", "test-holder", ttl_s=60)
    try:
        assert work is not None and work.id == job["id"]
        assert c.get(f"/v1/clusters/{a['id']}", headers=alice).json()["lease"]["job_id"] == job["id"]
        seen_by_bob = c.get(f"/v1/clusters/{b['id']}", headers=bob).json()["lease"]
        assert seen_by_bob["busy"] is True and seen_by_bob["job_id"] is None
    finally:
        with api.db.write() as session:
            leases.release(session, f"local:{a['address']}", "test-holder")
