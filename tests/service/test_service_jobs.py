"""Jobs end to end: the API in one process, two scheduler processes (``service.worker``) on the
same devices, a real local Ray and real DeepSpeed trials of tiny-llama on 2 CPU devices.

The lease test: two jobs submitted together on one cluster run one after the other, never
both at once, whichever worker takes them. Along the way the first job is followed live over
the event stream and its results are read back: trials with predicted and measured figures,
the best configuration and its launch files, the full plan, the metrics.
"""

from __future__ import annotations

import itertools
import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.db import Database
from service.migrations import upgrade
from tests.service.conftest import JOB_BODY, METRICS_TOKEN, remember_profile, seed_profile
from tests.service.processes import ServiceProcess, admin_token, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FINAL = {"succeeded", "failed", "cancelled"}


def test_two_jobs_on_one_cluster_run_one_after_the_other(tmp_path: Path, deepspeed_ready: None) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade(url)
    headers = admin_token(url, tmp_path, "lease-test")
    api = ServiceProcess(url, tmp_path, log_name="api", PIPETTE_SCHEDULER="0", PIPETTE_METRICS_TOKEN=METRICS_TOKEN)
    workers = [ServiceProcess(url, tmp_path, command="worker", log_name=f"worker{i}", PIPETTE_LEASE_TTL_S="10")
               for i in range(2)]
    db = Database(url)
    try:
        api.start()
        for w in workers:
            w.start()
        c = httpx.Client(base_url=api.base, headers=headers, timeout=30)
        cluster = c.post("/v1/clusters", json={"name": "local", "devices": 2}).json()
        seed_profile(db, cluster["id"])
        body = {**JOB_BODY, "budget": {"max_trials": 1, "steps": 3, "retries": 0, "trial_timeout_s": 480}}
        a = c.post("/v1/jobs", json={**body, "name": "a"}).json()
        b = c.post("/v1/jobs", json={**body, "name": "b"}).json()

        live: list[dict[str, Any]] = []
        follower = threading.Thread(target=_follow, args=(api.base, headers, a["url"], live), daemon=True)
        follower.start()
        # While a runs, the devices are leased to it and b waits its turn.
        wait_for(lambda: c.get(a["url"]).json()["state"] == "running", 600, "job a to run", api)
        lease = c.get(f"/v1/clusters/{cluster['id']}").json()["lease"]
        assert lease["busy"] is True and lease["job_id"] == a["id"]
        assert c.get(b["url"]).json()["state"] == "queued"

        jobs = wait_for(lambda: _all_final(c, [a["url"], b["url"]]), 900, "both jobs to end", api)
        follower.join(30)
        remember_profile(db, cluster["id"])
        job_a, job_b = jobs
        assert job_a["state"] == job_b["state"] == "succeeded", (job_a, job_b, workers[0].tail(), workers[1].tail())
        # One after the other: b started when a had finished, and no trials overlapped.
        assert _t(job_b["started_at"]) >= _t(job_a["finished_at"])
        spans = [(_t(t["started_at"]), _t(t["ended_at"])) for j in (a, b)
                 for t in c.get(f"{j['url']}/trials").json()["items"]]
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), spans

        _check_results(c, a["url"], job_a)
        _check_live_events(live, c, a["url"])
        metrics = c.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
        assert 'pipette_jobs{state="succeeded"} 2.0' in metrics
        assert 'pipette_trial_duration_seconds_count 2.0' in metrics
    finally:
        for process in (*workers, api):
            process.stop()
        db.dispose()


def _check_results(c: httpx.Client, url: str, job: dict[str, Any]) -> None:
    trials = c.get(f"{url}/trials").json()["items"]
    assert [t["number"] for t in trials] == [0] and trials[0]["state"] == "ok"
    t = trials[0]
    assert t["predicted_step_time"] > 0 and t["analytic_step_time"] > 0 and t["predicted_peak_bytes"] > 0
    assert t["measured_step_time"] > 0 and t["tokens_per_s"] > 0 and t["peak_memory_bytes"] > 0
    assert t["prediction_error"] == pytest.approx((t["measured_step_time"] - t["predicted_step_time"])
                                                  / t["predicted_step_time"])
    detail = c.get(f"{url}/trials/0").json()
    step_times = detail["record"]["measurement"]["step_times"]
    assert len(step_times) >= 1 and detail["record"]["config"] == t["config"]
    # Every step as it streamed (rank 0's time) and as recorded (a step ends with its slowest rank).
    timed = [s["time"] for s in detail["steps"] if not s["warmup"]]
    assert len(timed) == len(step_times) and all(a <= b + 1e-9 for a, b in zip(timed, step_times, strict=True))
    assert detail["attempts"] == [detail["record"]]

    assert job["best"]["trial"] == 0 and job["best"]["label"] == t["label"]
    assert job["progress"]["trials_done"] == 1 and job["stop_reason"].startswith("trial budget")
    best = c.get(f"{url}/best").json()
    assert best["config"] == t["config"] and best["ds_config"]["train_batch_size"] == 4
    assert "deepspeed" in best["launch_command"] and len(best["rank_map"]) == 2
    files = {name: c.get(link) for name, link in best["files"].items()}
    assert all(r.status_code == 200 for r in files.values())
    assert json.loads(files["ds_config.json"].text) == best["ds_config"]
    assert files["hostfile"].text == best["hostfile"] and "slots=2" in best["hostfile"]
    launch = files["launch.sh"].text
    assert launch.startswith("#!/usr/bin/env bash") and best["launch_command"] in launch
    assert files["launch.sh"].headers["content-disposition"] == 'attachment; filename="launch.sh"'
    assert json.loads(files["rank_map.json"].text) == best["rank_map"]

    plan = c.get(f"{url}/plan").json()
    assert plan["feasible"] == len(plan["ranked"]) > 0
    assert all("runnable" in p and "refusals" in p for p in plan["ranked"])
    assert t["label"] in {p["label"] for p in plan["ranked"] if p["runnable"]}
    assert plan["dropped"] and all(v["reason"] for v in plan["dropped"].values())
    refused = [p for p in plan["ranked"] if not p["runnable"]]
    if refused:
        assert plan["dropped"]["not_runnable"]["count"] == len(refused)


def _check_live_events(live: list[dict[str, Any]], c: httpx.Client, url: str) -> None:
    kinds = [e["kind"] for e in live]
    states = [e["data"]["state"] for e in live if e["kind"] == "state"]
    assert states[0] == "queued" and states[-1] == "succeeded"
    assert states[-3:] == ["planning", "running", "succeeded"]
    order = [kinds.index(k) for k in ("trial_started", "trial_step", "trial_ended", "stopped")]
    assert order == sorted(order), kinds
    assert kinds[-1] == "finished"
    ids = [e["id"] for e in live]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # Reconnecting with the last id gets nothing more; from the middle, exactly the rest.
    middle = ids[len(ids) // 2]
    rest: list[dict[str, Any]] = []
    _follow(str(c.base_url), dict(c.headers), url, rest, last_event_id=middle)
    assert [e["id"] for e in rest] == [i for i in ids if i > middle]


def _follow(base: str, headers: dict[str, str], url: str, out: list[dict[str, Any]],
            last_event_id: int | None = None) -> None:
    extra = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
    with httpx.stream("GET", f"{base}{url}/events", headers={**headers, **extra}, timeout=900) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[len("data: "):]))


def _all_final(c: httpx.Client, urls: list[str]) -> list[dict[str, Any]] | None:
    jobs = [c.get(u).json() for u in urls]
    return jobs if all(j["state"] in FINAL for j in jobs) else None


def _t(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
