"""The API against SQLite and the real local PostgreSQL: shapes, filters, pages, cancel,
planning, events, limits, and every bad input answering 4xx with the field and the fix.

The scheduler is off here (nothing runs trials); jobs with real trials are in
test_service_jobs.py and test_service_restart.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from service.migrations import head_revision
from tests.service.conftest import METRICS_TOKEN, Api

CPU4 = {"name": "cpu4", "device": {"preset": "cpu", "memory": "5 GiB"}, "nodes": 1, "devices_per_node": 4,
        "intra_node": {"bandwidth": "2 GB/s", "latency": "50 us"}}
A100 = {"name": "a100-2x8", "device": "A100-80GB", "nodes": 2, "devices_per_node": 8,
        "intra_node": {"bandwidth": "300 GB/s", "latency": "3 us"},
        "inter_node": {"bandwidth": "25 GB/s", "latency": "10 us"}}


def test_health_ready_and_metrics(api: Api) -> None:
    c = api.client
    assert c.get("/healthz").json() == {"status": "ok"}
    ready = c.get("/readyz")
    assert ready.status_code == 200, ready.text
    body = ready.json()
    assert body["status"] == "ready"
    assert body["checks"]["database"] == {"ok": True, "dialect": api.backend, "revision": head_revision()}
    assert c.get("/metrics").status_code == 401  # only health is open
    h = api.token()
    api.local_cluster(h)
    assert c.post("/v1/jobs", json=_job(), headers=h).status_code == 202
    # every tenant's counts: never for a tenant's token (issue 17, item 13)
    tenant = c.get("/metrics", headers=h)
    assert tenant.status_code == 403 and tenant.json()["error"]["field"] == "Authorization", tenant.text
    assert "PIPETTE_METRICS_TOKEN" in tenant.json()["error"]["fix"]
    assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 403
    text = c.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    assert 'pipette_jobs{state="queued"}' in text
    assert "pipette_trials_total" in text and "pipette_trial_duration_seconds_bucket" in text
    assert 'pipette_api_request_duration_seconds_count{method="POST",route="/v1/jobs",status="202"}' in text


def test_register_and_read_clusters(api: Api) -> None:
    h = api.token()
    c = api.client
    local = api.local_cluster(h, devices=2)
    assert local["kind"] == "local" and local["devices_per_node"] == 2 and local["latest_profile"] is None
    assert local["lease"] == {"busy": False, "job_id": None, "profile_id": None, "expires_at": None,
                              "served_at": None}
    ray = c.post("/v1/clusters", json={"name": "gpus", "kind": "ray", "address": "10.0.0.1:6379", "devices": 8,
                                       "nodes": [{"name": "n0", "address": "10.0.0.1", "devices": 8}]}, headers=h)
    assert ray.status_code == 201, ray.text
    assert ray.headers["location"] == ray.json()["url"]
    assert [x["name"] for x in c.get("/v1/clusters", headers=h).json()["items"]] == ["local", "gpus"]
    by_name = c.get("/v1/clusters/gpus", headers=h).json()
    assert by_name["id"] == ray.json()["id"] and by_name["nodes"][0]["devices"] == 8
    dup = c.post("/v1/clusters", json={"name": "local"}, headers=h)
    assert dup.status_code == 409 and dup.json()["error"]["field"] == "name"
    no_address = c.post("/v1/clusters", json={"name": "r2", "kind": "ray"}, headers=h)
    assert no_address.status_code == 422 and no_address.json()["error"]["field"] == "address"
    profile = c.post(f"/v1/clusters/{local['id']}/profile", headers=h)
    assert profile.status_code == 202 and profile.json()["state"] == "queued"
    again = c.get(profile.json()["url"], headers=h)
    assert again.status_code == 200 and again.json()["id"] == profile.json()["id"]


def test_submit_read_list_and_cancel_jobs(api: Api) -> None:
    h = api.token()
    c = api.client
    cluster = api.local_cluster(h)
    submitted = c.post("/v1/jobs", json=_job(name="first"), headers=h)
    assert submitted.status_code == 202, submitted.text
    accepted = submitted.json()
    assert accepted["state"] == "queued" and submitted.headers["location"] == accepted["url"]
    job = c.get(accepted["url"], headers=h).json()
    assert job["name"] == "first" and job["cluster_id"] == cluster["id"]
    assert job["model"]["name"] == "tiny-llama" and job["training"]["method"] == "lora"
    assert job["budget"]["max_trials"] == 2 and job["progress"]["max_trials"] == 2
    assert job["best"] is None and job["links"]["events"] == accepted["url"] + "/events"

    ids = [accepted["id"]] + [c.post("/v1/jobs", json=_job(name=f"j{i}"), headers=h).json()["id"] for i in range(4)]
    page1 = c.get("/v1/jobs", params={"limit": 2}, headers=h).json()
    page2 = c.get("/v1/jobs", params={"limit": 2, "cursor": page1["next_cursor"]}, headers=h).json()
    page3 = c.get("/v1/jobs", params={"limit": 2, "cursor": page2["next_cursor"]}, headers=h).json()
    seen = [j["id"] for j in page1["items"] + page2["items"] + page3["items"]]
    assert seen == list(reversed(ids)) and page3["next_cursor"] is None  # newest first, no repeats

    cancelled = c.post(f"/v1/jobs/{ids[0]}/cancel", headers=h)
    assert cancelled.status_code == 202 and cancelled.json()["state"] == "cancelled"
    again = c.post(f"/v1/jobs/{ids[0]}/cancel", headers=h)
    assert again.status_code == 409 and again.json()["error"]["field"] == "job_id"
    only_cancelled = c.get("/v1/jobs", params={"state": "cancelled"}, headers=h).json()["items"]
    assert [j["id"] for j in only_cancelled] == [ids[0]]
    both = c.get("/v1/jobs", params=[("state", "cancelled"), ("state", "queued")], headers=h).json()["items"]
    assert len(both) == 5
    assert len(c.get("/v1/jobs", params={"cluster": "local"}, headers=h).json()["items"]) == 5
    assert c.get("/v1/jobs", params={"cluster": "nope"}, headers=h).status_code == 404

    for path in ("trials", "best", "plan"):
        r = c.get(f"/v1/jobs/{ids[1]}/{path}", headers=h)
        if path == "trials":
            assert r.status_code == 200 and r.json() == {"items": []}
        else:
            assert r.status_code == 404 and r.json()["error"]["field"] == "job_id", r.text
    assert c.get(f"/v1/jobs/{ids[1]}/trials/0", headers=h).status_code == 404
    assert c.get(f"/v1/jobs/{ids[1]}/best/files/hostfile", headers=h).status_code == 404


def test_huggingface_config_as_model(api: Api) -> None:
    h = api.token()
    api.local_cluster(h)
    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 1000, "max_position_embeddings": 512}
    r = api.client.post("/v1/jobs", json=_job(model=config), headers=h)
    assert r.status_code == 202, r.text
    model = api.client.get(r.json()["url"], headers=h).json()["model"]
    assert (model["hidden"], model["layers"], model["kv_heads"], model["vocab"]) == (256, 2, 2, 1000)
    bad = api.client.post("/v1/jobs", json=_job(model={**config, "hidden_size": "wide"}), headers=h)
    assert bad.status_code == 422 and bad.json()["error"]["field"].startswith("model")
    missing = api.client.post("/v1/jobs", json=_job(model={"model_type": "llama"}), headers=h)
    assert missing.status_code == 422 and missing.json()["error"]["field"] == "model.num_attention_heads"


def test_what_if_plan(api: Api) -> None:
    h = api.token()
    c = api.client
    r = c.post("/v1/plan", json={"model": "llama2-7b", "training": {"global_batch": 64, "seq_len": 4096,
                                                                   "method": "lora"}, "cluster": A100, "top": 3},
               headers=h)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["cluster"] == {"name": "a100-2x8", "devices": 16, "nodes": 2}
    assert len(plan["ranked"]) == 3 and plan["feasible"] >= 3
    expected = [p["expected_step_time"] for p in plan["ranked"]]  # by the step time to expect (pipette.fits)
    assert expected == sorted(expected) and all(0.02 <= p["chance_to_fit"] <= 1 for p in plan["ranked"])
    assert all(v["reason"] for v in plan["dropped"].values())
    assert plan["enumerated"] == plan["feasible"] + sum(v["count"] for v in plan["dropped"].values())

    nothing = c.post("/v1/plan", json={"model": "llama2-70b", "training": {"global_batch": 16, "seq_len": 4096,
                                                                          "zero_stages": [0], "recompute": ["none"],
                                                                          "micro_batches": [2, 4]},
                                       "cluster": A100}, headers=h)
    assert nothing.status_code == 422
    err = nothing.json()["error"]
    assert err["field"] == "cluster" and "nothing fits" in err["message"] and "ZeRO-3" in err["fix"]

    small = c.post("/v1/plan", json={"model": "tiny-llama", "training": {"global_batch": 8, "seq_len": 64},
                                     "cluster": CPU4, "top": 1000}, headers=h).json()
    assert small["feasible"] == len(small["ranked"])


@pytest.mark.parametrize(("options", "field"), [({"top": 0}, "top"), ({"top": "many"}, "top"),
                                               ({"top": 1001}, "top"), ({"margin": -0.5}, "margin")])
def test_a_bad_plan_option_names_its_field(api: Api, options: dict[str, Any], field: str) -> None:
    body = {"model": "tiny-llama", "training": {"global_batch": 8, "seq_len": 64}, "cluster": CPU4, **options}
    r = api.client.post("/v1/plan", json=body, headers=api.token())
    assert r.status_code == 422 and r.json()["error"]["field"] == field and r.json()["error"]["fix"], r.text


def test_a_plan_shows_the_declared_number_of_candidates(api: Api) -> None:
    from pipette.options import default

    r = api.client.post("/v1/plan", json={"model": "tiny-llama", "training": {"global_batch": 16, "seq_len": 128},
                                          "cluster": CPU4}, headers=api.token())
    assert r.status_code == 200 and len(r.json()["ranked"]) == default("top") == 10, r.text


def test_plan_of_a_registered_cluster_needs_a_profile(api: Api) -> None:
    h = api.token()
    api.local_cluster(h)
    r = api.client.post("/v1/plan", json={"model": "tiny-llama", "training": {"global_batch": 8, "seq_len": 64},
                                          "cluster": "local"}, headers=h)
    assert r.status_code == 404
    assert r.json()["error"]["field"] == "cluster" and "profile" in r.json()["error"]["fix"]


BAD_JOBS: list[tuple[dict[str, Any], int, str]] = [
    ({"model": "gpt-9"}, 422, "model"),
    ({"model": 7}, 422, "model"),
    ({"training": {"seq_len": 32}}, 422, "training.global_batch"),
    ({"training": {"global_batch": 0, "seq_len": 32}}, 422, "training.global_batch"),
    ({"training": {"global_batch": 4, "seq_len": 32, "dtype": "fp8"}}, 422, "training.dtype"),
    ({"training": {"global_batch": 4, "seq_len": 32, "zero_stages": [5]}}, 422, "training.zero_stages.0"),
    ({"training": {"global_batch": 4, "seq_len": 32, "method": "full", "lora": {"rank": 8}}}, 422, "training.lora"),
    ({"training": {"global_batch": 4, "seq_len": 32, "method": "lora", "lora": {"targets": ["qq"]}}}, 422,
     "training.lora.targets"),
    ({"training": {"global_batch": 4, "seq_len": 32, "colour": "red"}}, 422, "training.colour"),
    ({"budget": {"max_trials": 0}}, 422, "budget.max_trials"),
    ({"budget": {"tolerance": 1.5}}, 422, "budget.tolerance"),
    ({"budget": {"max_trials": "many"}}, 422, "budget.max_trials"),
    ({"budget": {"retime": -1}}, 422, "budget.retime"),
    ({"budget": {"reserve": -1}}, 422, "budget.reserve"),
    ({"budget": {"max_trials": 4, "reserve": 4}}, 422, "budget.reserve"),
    # issue 17, item 14: refused at submit, naming the field, not coerced nor failed at planning
    ({"training": {"global_batch": True, "seq_len": 32}}, 422, "training.global_batch"),
    ({"training": {"global_batch": 4, "seq_len": "32"}}, 422, "training.seq_len"),
    ({"training": {"global_batch": 4, "seq_len": 100000}}, 422, "training.seq_len"),
    # packed documents: at least one token, at most the sequence
    ({"training": {"global_batch": 4, "seq_len": 32, "document_len": 0}}, 422, "training.document_len"),
    ({"training": {"global_batch": 4, "seq_len": 32, "document_len": 64}}, 422, "training.document_len"),
    # MoE routings: dropless or a positive capacity factor, each once
    ({"training": {"global_batch": 4, "seq_len": 32, "moe_routing": ["drop"]}}, 422, "training.moe_routing"),
    ({"training": {"global_batch": 4, "seq_len": 32, "moe_routing": [0]}}, 422, "training.moe_routing"),
    ({"training": {"global_batch": 4, "seq_len": 32, "moe_routing": [1, "cf1"]}}, 422, "training.moe_routing"),
    ({"model": {"model_type": "llama", "hidden_size": 1e30, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 64, "vocab_size": 128}}, 422, "model.hidden"),
    ({"budget": {"confidence": 1.0}}, 422, "budget.confidence"),
    # the options declared once (pipette.options): negative, zero, a wrong type, past the service's cap
    ({"budget": {"steps": 0}}, 422, "budget.steps"),
    ({"budget": {"trial_timeout_s": -5}}, 422, "budget.trial_timeout_s"),
    ({"budget": {"seed": -1}}, 422, "budget.seed"),
    ({"budget": {"max_trials": 2.5}}, 422, "budget.max_trials"),
    ({"budget": {"max_trials": 501}}, 422, "budget.max_trials"),
    ({"budget": {"prune": "yes"}}, 422, "budget.prune"),
    ({"budget": {"margin": 1}}, 422, "budget.margin"),
    ({"cluster": "nope"}, 404, "cluster"),
    ({"cluster": "bad name;rm -rf /"}, 422, "cluster"),
    ({"name": "x\u0000y"}, 422, "name"),
    ({"surprise": 1}, 422, "surprise"),
]


def test_a_job_no_backend_can_run_is_refused_at_submit(api: Api) -> None:
    """Issue 32, item 19: ``tiny-gpt`` on the local cluster was accepted (202) and failed at
    planning; fp16 on a cluster measured as CPU devices likewise. Now a 422 with the fix."""
    import uuid

    from pipette.clusterfile import cluster_from_dict
    from service.models import Cluster, Profile, utcnow

    h = api.token()
    cluster = api.local_cluster(h)
    gpt = api.client.post("/v1/jobs", json=_job(model="tiny-gpt"), headers=h)
    assert gpt.status_code == 422, gpt.text
    error = gpt.json()["error"]
    assert error["field"] == "model" and "Llama" in error["message"] and "tiny-llama" in error["fix"], error
    fp16 = _job(training={"global_batch": 4, "seq_len": 32, "dtype": "fp16"})
    assert api.client.post("/v1/jobs", json=fp16, headers=h).status_code == 202  # not measured yet: unknown
    with api.db.write() as session:
        row = session.get(Cluster, cluster["id"])
        assert row is not None
        profile = cluster_from_dict({**CPU4, "nodes": 1, "devices_per_node": 2}, default_name="local").to_dict()
        session.add(Profile(id=str(uuid.uuid4()), cluster_id=row.id, state="succeeded", created_at=utcnow(),
                            finished_at=utcnow(), profile=profile))
    refused = api.client.post("/v1/jobs", json=fp16, headers=h)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["field"] == "training.dtype" and "bf16 or fp32" in error["fix"], error
    assert api.client.post("/v1/jobs", json=_job(), headers=h).status_code == 202


def test_a_deeply_nested_model_config_says_so(api: Api) -> None:
    """Issue 32, item 19: a config.json nested ~1000 levels deep was called "not UTF-8"."""
    h = api.token()
    body = json.dumps(_job()).replace('"tiny-llama"', '{"hidden_size": 64, "x": ' + "[" * 5000 + "]" * 5000 + "}")
    r = api.client.post("/v1/jobs", content=body.encode(), headers={**h, "content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "body" and "nested too deeply" in error["message"] and error["fix"], error


def test_an_unknown_preset_names_the_closest_not_all(api: Api) -> None:
    """Issue 17, item 11: the 422 listed every preset in one line."""
    h = api.token()
    api.local_cluster(h)
    r = api.client.post("/v1/jobs", json=_job(model="llama2-7"), headers=h)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "model" and error["message"] == "unknown model preset 'llama2-7'", error
    assert error["fix"].startswith("did you mean llama2-7b") and len(error["fix"]) < 200, error


@pytest.mark.parametrize(("change", "status", "field"), BAD_JOBS, ids=[f for _, _, f in BAD_JOBS])
def test_bad_job_input_names_the_field(api: Api, change: dict[str, Any], status: int, field: str) -> None:
    h = api.token()
    api.local_cluster(h)
    r = api.client.post("/v1/jobs", json=_job(**change), headers=h)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["field"] == field and error["message"] and error["fix"], error


def test_malformed_bodies_and_parameters(api: Api) -> None:
    h = api.token()
    c = api.client
    cases: list[tuple[Callable[[], Any], int, str | None]] = [
        (lambda: c.post("/v1/jobs", content=b"{not json", headers={**h, "content-type": "application/json"}),
         422, "body"),
        (lambda: c.post("/v1/jobs", headers=h), 422, "body"),
        (lambda: c.post("/v1/jobs", json=[1, 2], headers=h), 422, None),
        (lambda: c.get("/v1/jobs", params={"limit": 0}, headers=h), 422, "limit"),
        (lambda: c.get("/v1/jobs", params={"stat": "running"}, headers=h), 422, "stat"),
        (lambda: c.get("/v1/jobs", params={"state": "sleeping"}, headers=h), 422, "state.0"),
        (lambda: c.get("/v1/jobs", params={"cursor": "AAAA"}, headers=h), 404, "cursor"),
        (lambda: c.get("/v1/jobs", params={"cursor": "not a cursor"}, headers=h), 422, "cursor"),
        (lambda: c.get("/v1/jobs/not-a-uuid!", headers=h), 422, "job_id"),
        (lambda: c.get("/v1/jobs/00000000-0000-0000-0000-000000000000", headers=h), 404, "job_id"),
        (lambda: c.get("/v1/jobs/00000000-0000-0000-0000-000000000000/trials/99999999999", headers=h), 422,
         "number"),
        (lambda: c.get("/v1/jobs/00000000-0000-0000-0000-000000000000/events",
                       headers={**h, "Last-Event-ID": "x"}), 422, "Last-Event-ID"),
        (lambda: c.post("/v1/plan", json={"model": "tiny-llama", "training": {"global_batch": 8, "seq_len": 8},
                                          "cluster": {"nodes": 100000, "devices_per_node": 8, "device": "cpu"}},
                        headers=h), 422, "cluster.nodes"),
        (lambda: c.post("/v1/plan", json={"model": "tiny-llama", "training": {"global_batch": 8, "seq_len": 8},
                                          "cluster": {"device": "cpu", "devices": [{"node": "zero"}], "links": {}}},
                        headers=h),
         422, "cluster.devices[0].node"),
        (lambda: c.post("/v1/plan", json={"model": "tiny-llama", "training": {"global_batch": 8, "seq_len": 8},
                                          "cluster": {"nodes": 1, "devices_per_node": 2, "device": "H900"}},
                        headers=h), 422, "cluster.device"),
    ]
    for call, status, field in cases:
        r = call()
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["fix"], error
        if field is not None:
            assert error["field"] == field, error


def test_small_input_faults(api: Api) -> None:
    """Issue 17, item 19: an upper-cased id, a non-JSON or empty body, a NaN tolerance."""
    h = api.token()
    api.local_cluster(h)
    c = api.client
    job = c.post("/v1/jobs", json=_job(), headers=h).json()
    assert c.get(f"/v1/jobs/{job['id'].upper()}", headers=h).json()["id"] == job["id"]
    bad = c.post("/v1/jobs", content=b"{not json", headers={**h, "content-type": "application/json"}).json()["error"]
    assert bad["field"] == "body" and bad["fix"] == "send a valid JSON body", bad
    empty = c.post("/v1/jobs", headers=h).json()["error"]
    assert empty["field"] == "body" and empty["fix"] != "give it" and "JSON object" in empty["fix"], empty
    nan = c.post("/v1/jobs", content=json.dumps(_job(budget={"tolerance": float("nan")})).encode(),
                 headers={**h, "content-type": "application/json"})
    assert nan.status_code == 422, nan.text
    error = nan.json()["error"]
    assert error["field"] == "budget.tolerance" and error["fix"] == "give a finite number", error


def test_body_size_limit(tmp_path: Any) -> None:
    from service.migrations import upgrade
    from tests.service.conftest import make_api

    url = f"sqlite:///{tmp_path / 'limit.db'}"
    upgrade(url)
    for api in make_api(url, "sqlite", tmp_path, max_body_bytes=4096):
        h = api.token()
        big = {"model": {"pad": "x" * 5000}, "training": {"global_batch": 4, "seq_len": 8}, "cluster": CPU4}
        r = api.client.post("/v1/plan", json=big, headers=h)
        assert r.status_code == 413 and r.json()["error"]["field"] == "body"

        def chunks() -> Any:  # no Content-Length: counted as it streams
            for _ in range(10):
                yield b" " * 1000

        streamed = api.client.post("/v1/plan", content=chunks(), headers={**h, "content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text
        small = api.client.post("/v1/plan", json={"model": "tiny-llama", "cluster": CPU4,
                                                  "training": {"global_batch": 8, "seq_len": 64}, "top": 1},
                                headers=h)
        assert small.status_code == 200, small.text


def test_authentication(api: Api) -> None:
    c = api.client
    assert c.get("/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer pip_forged"},
                    {"Authorization": "Bearer "}):
        r = c.get("/v1/jobs", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["field"] == "Authorization" and r.headers["www-authenticate"] == "Bearer"
    h = api.token()
    assert c.get("/v1/jobs", headers=h).status_code == 200
    from service.auth import revoke_token
    from service.models import Token

    with api.db.write() as session:
        token = session.query(Token).order_by(Token.id.desc()).first()
        assert token is not None and len(token.token_hash) == 64
        assert token.token_hash not in h["Authorization"]  # only the hash is stored
        revoke_token(session, token.id)
    time.sleep(0.6)  # a verified token is trusted for token_cache_s (0.5 s here; 5 s by default)
    assert c.get("/v1/jobs", headers=h).status_code == 401


def test_event_stream_resumes_after_last_event_id(api: Api) -> None:
    h = api.token()
    api.local_cluster(h)
    url = api.client.post("/v1/jobs", json=_job(), headers=h).json()["url"]
    api.client.post(f"{url}/cancel", headers=h)
    events = _events(api.client.get(f"{url}/events", headers=h))  # ends: the job is final
    assert [e["event"] for e in events] == ["state", "state"]
    assert [e["data"]["data"]["state"] for e in events] == ["queued", "cancelled"]
    first = events[0]["id"]
    rest = _events(api.client.get(f"{url}/events", headers={**h, "Last-Event-ID": str(first)}))
    assert [e["id"] for e in rest] == [events[1]["id"]]
    assert _events(api.client.get(f"{url}/events", params={"after": events[1]["id"]}, headers=h)) == []


def test_last_event_id_is_bounded_like_after(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32, item 13: a Last-Event-ID above 2^63-1 answered 200, then cut the stream and
    logged a traceback (the database's integer overflowed); now a 422 like ``?after``, nothing logged."""
    h = api.token()
    api.local_cluster(h)
    url = api.client.post("/v1/jobs", json=_job(), headers=h).json()["url"]
    api.client.post(f"{url}/cancel", headers=h)
    for value in (str(2**63), "9" * 20, str(2**62 + 1)):
        r = api.client.get(f"{url}/events", headers={**h, "Last-Event-ID": value})
        assert r.status_code == 422, (value, r.status_code, r.text[:200])
        error = r.json()["error"]
        assert error["field"] == "Last-Event-ID" and str(2**62) in error["fix"], error
    assert _events(api.client.get(f"{url}/events", headers={**h, "Last-Event-ID": str(2**62)})) == []
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_openapi_documents_the_api(api: Api) -> None:
    schema = api.client.get("/openapi.json").json()
    paths = set(schema["paths"])
    assert {"/v1/clusters", "/v1/clusters/{cluster_id}", "/v1/clusters/{cluster_id}/profile", "/v1/jobs",
            "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/trials",
            "/v1/jobs/{job_id}/best", "/v1/jobs/{job_id}/best/files/{name}", "/v1/jobs/{job_id}/plan",
            "/v1/jobs/{job_id}/events", "/v1/plan", "/healthz", "/readyz", "/metrics"} <= paths
    submit = schema["paths"]["/v1/jobs"]["post"]["responses"]
    assert "202" in submit and submit["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")


def _job(**changes: Any) -> dict[str, Any]:
    from tests.service.conftest import JOB_BODY

    body: dict[str, Any] = json.loads(json.dumps(JOB_BODY))
    body.update(changes)
    return body


def _events(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "id" in fields:
            out.append({"id": int(fields["id"]), "event": fields["event"], "data": json.loads(fields["data"])})
    return out


def test_api_docs_load_nothing_from_another_site(api: Api) -> None:
    """/docs and /redoc reference only this service's files, which it serves (they were blank
    offline: Swagger UI and ReDoc came from a public CDN)."""
    import re

    for page in ("/docs", "/redoc"):
        r = api.client.get(page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        urls = re.findall(r'(?:src|href)=["\']([^"\']+)["\']', r.text) + re.findall(r"url: *'([^']+)'", r.text)
        assert urls, r.text
        assert all(u.startswith("/") for u in urls), urls
        for u in urls:
            got = api.client.get(u)
            assert got.status_code == 200 and len(got.content) > 100, u
    assert api.client.get("/docs-assets/../../etc/passwd").status_code == 404
    assert api.client.get("/docs-assets/pyproject.toml").status_code == 404


def test_a_text_plain_body_is_not_read_as_json(api: Api) -> None:
    h = api.token()
    r = api.client.post("/v1/plan", content=json.dumps({"model": "tiny-llama"}),
                        headers={**h, "content-type": "text/plain"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "application/json" in error["fix"], error


def test_plans_and_clusters_have_per_tenant_limits(tmp_path: Any) -> None:
    """Issue 32, item 20: a tenant's plans (up to a second of CPU each) and clusters were
    unlimited. Now PIPETTE_PLANS_PER_MINUTE (429 with Retry-After) and
    PIPETTE_MAX_CLUSTERS_PER_TENANT (409); another tenant is not held back."""
    from service.migrations import upgrade
    from tests.service.conftest import make_api

    url = f"sqlite:///{tmp_path / 'quota.db'}"
    upgrade(url)
    plan = {"model": "tiny-llama", "cluster": CPU4, "training": {"global_batch": 8, "seq_len": 64}, "top": 1}
    for api in make_api(url, "sqlite", tmp_path, plans_per_minute=3, max_clusters_per_tenant=2):
        h, other = api.token(), api.token()
        assert [api.client.post("/v1/plan", json=plan, headers=h).status_code for _ in range(3)] == [200] * 3
        over = api.client.post("/v1/plan", json=plan, headers=h)
        assert over.status_code == 429, over.text
        assert "PIPETTE_PLANS_PER_MINUTE" in over.json()["error"]["message"]
        assert 1 <= int(over.headers["retry-after"]) <= 20
        assert api.client.post("/v1/plan", json=plan, headers=other).status_code == 200
        api.local_cluster(h, "one")
        api.local_cluster(h, "two")
        third = api.client.post("/v1/clusters", json={"name": "three", "devices": 2}, headers=h)
        assert third.status_code == 409, third.text
        error = third.json()["error"]
        assert "PIPETTE_MAX_CLUSTERS_PER_TENANT" in error["message"] and error["field"] == "name" and error["fix"]
        api.local_cluster(other, "one")


def _statements(api: Api) -> list[str]:
    """Every SQL statement the app runs from now on (appended as they run)."""
    from sqlalchemy import event

    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.split(None, 1)[0].upper() not in ("BEGIN", "COMMIT", "ROLLBACK"):
            seen.append(statement)

    event.listen(api.db.engine, "before_cursor_execute", record)
    return seen


def test_the_hot_reads_cost_one_query_each(api: Api, job_body: Callable[..., dict[str, Any]]) -> None:
    """The polled reads (issue 32 item 22): a job's trials in one query (the job row was loaded
    first, its JSON columns decoded only to check the tenant), and a queued job with its
    cluster and lease in one (were three, then two). The token is cached, so it costs none."""
    from service.repositories.trials import start_trial

    headers = api.token()
    api.local_cluster(headers)
    job = api.client.post("/v1/jobs", json=job_body(), headers=headers).json()
    with api.db.write() as session:
        start_trial(session, job["id"], 0, label="tp1-pp1-dp2", config={}, predicted_step_time=1.0)
    api.client.get("/v1/jobs", headers=headers)  # the token is verified and cached
    seen = _statements(api)
    trials = api.client.get(f"/v1/jobs/{job['id']}/trials", headers=headers)
    assert trials.status_code == 200 and [t["number"] for t in trials.json()["items"]] == [0]
    assert len(seen) == 1, seen
    seen.clear()
    read = api.client.get(f"/v1/jobs/{job['id']}", headers=headers)
    assert read.status_code == 200 and read.json()["state"] == "queued"
    assert len(seen) == 1, seen
    seen.clear()
    empty = api.client.post("/v1/jobs", json=job_body(), headers=headers).json()
    seen.clear()
    assert api.client.get(f"/v1/jobs/{empty['id']}/trials", headers=headers).json()["items"] == []
    assert len(seen) == 2, seen  # no trials: one more query tells an empty job from a missing one
