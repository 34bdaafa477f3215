"""The stack (pipette.stacks) in the API, on SQLite and PostgreSQL: POST /v1/plan and POST /v1/jobs
accept ``stack``, show it, store it with the job, and refuse an unknown one (or, for a job of Pipette's
runner, one the runner does not run) with the field and the fix."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.service.conftest import Api
from tests.service.test_service_api import A100, _job

PLAN: dict[str, Any] = {"model": "llama2-7b", "training": {"global_batch": 64, "seq_len": 4096, "method": "lora"},
                        "cluster": A100, "top": 3}


def test_plan_takes_a_stack_and_shows_it(api: Api) -> None:
    h = api.token()
    default = api.client.post("/v1/plan", json=PLAN, headers=h)
    assert default.status_code == 200, default.text
    assert default.json()["stack"]["name"] == "pipette"
    megatron = api.client.post("/v1/plan", json={**PLAN, "stack": "megatron"}, headers=h)
    assert megatron.status_code == 200, megatron.text
    plan = megatron.json()
    assert plan["stack"]["name"] == "megatron" and plan["fits_prior"]["name"] == "megatron-gpu"
    assert plan["ranked"][0]["perf"]["step_time"] != default.json()["ranked"][0]["perf"]["step_time"]
    # the estimate's two figures: the live tensors and what the device must hold (compared with capacity)
    memory = plan["ranked"][0]["memory"]
    assert memory["live_bytes"] < memory["reserved_bytes"] == memory["peak_bytes"] and memory["capacity_bytes"] > 0
    nanotron = api.client.post("/v1/plan", json={**PLAN, "stack": "nanotron"}, headers=h)
    assert nanotron.status_code == 200, nanotron.text
    assert nanotron.json()["stack"]["name"] == "nanotron" and nanotron.json()["fits_prior"]["name"] == "nanotron-gpu"


@pytest.mark.parametrize(("stack", "words"), [
    ("bogus", ["unknown stack 'bogus'"]),
    ("fsdp+turbo", ["fsdp has no option 'turbo'"]),
    ("fsdp;drop", []),  # not a stack name at all: the schema's pattern
])
def test_plan_refuses_an_unknown_stack(api: Api, stack: str, words: list[str]) -> None:
    r = api.client.post("/v1/plan", json={**PLAN, "stack": stack}, headers=api.token())
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "stack", err
    assert all(w in err["message"] for w in words), err
    if words:
        assert "pipette, hf-deepspeed, megatron, nanotron, fsdp" in err["fix"] or "fsdp+compile" in err["fix"], err


def test_a_job_stores_its_stack(api: Api) -> None:
    h = api.token()
    api.local_cluster(h)
    plain = api.client.post("/v1/jobs", json=_job(), headers=h)
    named = api.client.post("/v1/jobs", json=_job(stack="pipette"), headers=h)
    assert plain.status_code == named.status_code == 202, (plain.text, named.text)
    for accepted in (plain, named):
        job = api.client.get(f"/v1/jobs/{accepted.json()['id']}", headers=h).json()
        assert job["stack"] == "pipette" and "stack" not in job["budget"], job


@pytest.mark.parametrize(("stack", "words"), [
    ("bogus", ["unknown stack 'bogus'"]),
    ("megatron", ["megatron cannot be tuned by Pipette's runner, which runs pipette, fsdp only"]),
    ("fsdp+compile", ["fsdp+compile: Pipette's runner runs fsdp without compile"]),
])
def test_a_job_of_pipettes_runner_refuses_a_stack_it_does_not_run(api: Api, stack: str, words: list[str]) -> None:
    h = api.token()
    api.local_cluster(h)
    r = api.client.post("/v1/jobs", json=_job(stack=stack), headers=h)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "stack" and all(w in err["message"] for w in words), err
    assert api.client.get("/v1/jobs", headers=h).json()["items"] == []  # nothing queued


def test_plan_and_job_take_several_stacks_side_by_side(api: Api) -> None:
    h = api.token()
    both = api.client.post("/v1/plan", json={**PLAN, "stack": "pipette,fsdp", "top": 1000}, headers=h)
    assert both.status_code == 200, both.text
    plan = both.json()
    assert [s["name"] for s in plan["stacks"]] == ["pipette", "fsdp"]
    assert {c["config"]["stack"] for c in plan["ranked"]} == {"pipette", "fsdp"}
    api.local_cluster(h)
    accepted = api.client.post("/v1/jobs", json=_job(stack="pipette,fsdp"), headers=h)
    assert accepted.status_code == 202, accepted.text
    assert api.client.get(f"/v1/jobs/{accepted.json()['id']}", headers=h).json()["stack"] == "pipette,fsdp"
    twice = api.client.post("/v1/jobs", json=_job(stack="fsdp,fsdp"), headers=h)
    assert twice.status_code == 422 and twice.json()["error"]["field"] == "stack", twice.text


def test_the_best_of_an_fsdp_trial_is_launched_with_torchrun_and_has_no_deepspeed_config(api: Api) -> None:
    """A job over both families whose best trial ran on the fsdp stack: GET /best gives its torchrun
    command (Pipette's native runner) and no DeepSpeed config, its files are that stack's, each one
    downloads, and asking for ds_config.json is a 404 naming the field. The trial's record is stored
    as the driver stores one (``end_trial``); the figures in it are a recorded trial's kind."""
    from pathlib import Path

    from pipette.clusterfile import load_cluster
    from pipette.measurement import Measurement
    from pipette.model import ModelSpec
    from pipette.plan import make_plan
    from pipette.training import TrainingSpec
    from pipette.trials import TrialRecord
    from service.models import Cluster, Job, utcnow
    from service.repositories.clusters import request_profile
    from service.repositories.trials import end_trial

    h = api.token()
    cluster = api.local_cluster(h, devices=4)
    accepted = api.client.post("/v1/jobs", json=_job(stack="pipette,fsdp"), headers=h)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["id"]
    profile = load_cluster(str(Path(__file__).resolve().parents[2] / "examples" / "clusters" / "cpu-4.yaml"))
    training = TrainingSpec.from_dict(_job()["training"])
    plan = make_plan(ModelSpec.preset("tiny-llama"), training, profile, stack="pipette,fsdp")
    planned = next(p for p in plan.ranked if p.config.stack == "fsdp")
    record = TrialRecord(0, planned.config, Measurement("ok", (0.21, 0.20, 0.22), training.tokens_per_step),
                         planned.perf, planned.memory, planned.perf.step_time, 0.1, stack="fsdp")
    with api.db.write() as session:
        row = request_profile(session, session.get(Cluster, cluster["id"]))
        row.state, row.profile, row.finished_at = "succeeded", profile.to_dict(), utcnow()
        session.flush()
        job = session.get(Job, job_id)
        job.profile_id = row.id
        end_trial(session, job_id, record)
        job.best = {"trial": 0, "label": record.label, "config": record.config.to_dict(),
                    "measured_step_time": 0.21, "tokens_per_s": training.tokens_per_step / 0.21,
                    "predicted_step_time": record.predicted_step_time}

    best = api.client.get(f"/v1/jobs/{job_id}/best", headers=h).json()
    assert best["config"]["stack"] == "fsdp" and best["ds_config"] is None, best
    assert "-m torch.distributed.run" in best["launch_command"] and "-m workers.rank.fsdp" in best["launch_command"]
    assert sorted(best["files"]) == ["candidate.json", "hostfile", "launch.sh", "rank_map.json"]
    files = {name: api.client.get(link, headers=h) for name, link in best["files"].items()}
    assert all(r.status_code == 200 for r in files.values()), {n: r.text for n, r in files.items()}
    assert best["launch_command"] in files["launch.sh"].text and "deepspeed" not in files["launch.sh"].text
    assert json.loads(files["candidate.json"].text)["stack"]["name"] == "fsdp"
    missing = api.client.get(f"/v1/jobs/{job_id}/best/files/ds_config.json", headers=h)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "name", missing.text
