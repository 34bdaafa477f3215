"""The service on the shaped 4-host Ray cluster, deployed as deploy/docker-compose.yml deploys
it (its processes run as plain processes, ``tests/cluster/stack.py``), used through the CLI
(issue 8: "The job itself", "Losing a host", deploy/ "Validation").

1. The compose wiring works: PostgreSQL with the file's credentials, ``migrate`` to head, the
   API (``/readyz``: database and Ray) and the scheduler (Ray Client, token auth); the cluster
   is registered by its GCS address and profiled by the scheduler across the 4 hosts.
2. A complete tuning job runs on it; one host's Ray node is killed in the middle of a trial:
   the trial ends ``failed`` naming the host within a minute (nothing hangs), the job waits for
   the node and goes on when it is back, and no trial is lost or duplicated.
3. The job's choice is within 5% of the best of an exhaustive job over the same candidates
   (every candidate run, no stop rule, no pruning), judged on the exhaustive job's
   measurements; where they differ by more, the two are timed again in interleaved rounds
   (a load change on this shared 2-core machine then hits both alike), and the target is
   missed when those trials show the pick more than 5% slower at the 5% level (one-sided
   Welch t-test on log step times; the median ratio is printed).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from alembic.script import ScriptDirectory

from pipette.clusterfile import cluster_from_dict
from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from tests.cluster.conftest import Profiled, drive
from tests.cluster.shaped import REPO, ShapedCluster
from tests.cluster.stack import ComposeStack, parse_json
from tests.deploy.compose import flags
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow]

#: the same communication-heavy model as test_shaped_cluster (2.6 M parameters, full FT), as
#: the Hugging Face config.json a user would give
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "wide-tiny-llama",
             "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
             "intermediate_size": 688, "vocab_size": 2048, "max_position_embeddings": 256}
#: 9 candidates on 4 devices (tp x pp x dp x micro-batch), each placed by Pipette
TRAINING = {"global_batch": 4, "seq_len": 32, "dtype": "fp32", "method": "full", "recompute": ["none"],
            "zero_stages": [0], "schedules": ["1f1b"], "micro_batches": [1, 2]}
#: stop_probability 0.01, not the default 0.05: trial-to-trial spread here (up to ~30% for one
#: candidate) makes the learned model over-confident after 3 trials; with the default, one run
#: of five stopped after 3 trials on a pick 21% slower than the best (re-timed).
#: Two re-timing rounds of the best two (reserve 4 of 8: a CPU job's default at this budget since
#: 2026-12-02, said here so the test does not move with it): with one round (budget 6) CI
#: (2026-12-02) handed over a pick 85% sure, measured 137/126 ms against the best's 136/134,
#: which re-timed 21% slower than the best.
BUDGET = {"max_trials": 8, "retime": 2, "reserve": 4, "steps": 6, "retries": 1, "trial_timeout_s": 300,
          "stop_probability": 0.01}
#: the issue's target: the job's pick within 5% of the exhaustive best
WITHIN = 0.05
LOST_HOST = 3
RETIME_ROUNDS = 4
#: the pick misses the target when the re-timed trials show it more than WITHIN slower at this level
SIGNIFICANCE = 0.05


@pytest.fixture(scope="module")
def profile(profiled: Profiled) -> dict[str, Any]:
    """The scheduler's profile of the 4 hosts (``conftest.profiled``: measured once a session)."""
    return profiled.profile


def _job_file(stack: ComposeStack, name: str, budget: dict[str, Any]) -> Path:
    path = stack.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "cluster": "shaped", "model": HF_CONFIG, "training": TRAINING,
                                    "budget": budget}))
    return path


def test_the_compose_processes_serve_the_shaped_cluster(stack: ComposeStack, cluster: ShapedCluster,
                                                         profile: dict[str, Any]) -> None:
    # the Ray nodes the compose file starts listen where the shaped cluster's nodes do
    head, worker = flags(stack.argv("ray-head")), flags(stack.argv("ray-worker"))
    assert int(head["port"]) == cluster.ray_port and int(head["ray-client-server-port"]) == cluster.client_port
    assert worker["address"] == f"ray-head:{cluster.ray_port}"
    assert stack.env("scheduler")["RAY_ADDRESS"] == f"ray://{cluster.address(0)}:{cluster.client_port}"
    # the API's own view: PostgreSQL (migrated by the one-shot step) and the Ray head answer
    code = ("import urllib.request; "
            "print(urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=10).read().decode())")
    ready = parse_json(stack.run("api", [sys.executable, "-c", code], timeout=60))
    print(f"readyz: {ready}")
    head_revision = ScriptDirectory(str(REPO / "alembic")).get_current_head()
    assert ready["status"] == "ready" and ready["checks"]["ray"]["ok"], ready
    assert ready["checks"]["database"] == {"ok": True, "dialect": "postgresql", "revision": head_revision}, ready
    # the scheduler measured the 4 hosts through Ray Client, one device each, and the
    # degraded link 1 <-> 3 is the slowest pair
    assert [n["address"] for n in profile["nodes"]] == [cluster.address(h) for h in range(cluster.hosts)]
    bandwidth = cluster_from_dict(profile).bandwidth
    pairs = {(a, b): bandwidth[a][b] for a in range(cluster.hosts) for b in range(a + 1, cluster.hosts)}
    print("measured Mbit/s per pair: " + ", ".join(f"{a}-{b}: {v * 8 / 1e6:.0f}" for (a, b), v in pairs.items()))
    assert min(pairs, key=pairs.__getitem__) == (1, 3)


@pytest.fixture(scope="module")
def tuned(stack: ComposeStack, token: str, cluster: ShapedCluster, profile: dict[str, Any]) -> dict[str, Any]:
    """Job A, the tuning job, followed with ``pipette submit --watch --json``; host 3's Ray node
    is killed at the first timed step of trial 1 and restarted once the job says it waits."""
    del profile  # measured first: the job plans with it
    job_file = _job_file(stack, "tune-shaped", BUDGET)
    proc = stack.popen_pipette(token, "submit", str(job_file), "--watch", "--json")
    events: list[dict[str, Any]] = []
    lines: list[str] = []
    at: dict[str, float] = {}
    seen: dict[str, Any] = {}
    restarter: threading.Thread | None = None
    started = time.monotonic()
    timer = threading.Timer(1800, proc.kill)  # a hang ends the test instead of CI
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict) or "kind" not in event:
                continue
            events.append(event)
            kind, data = event["kind"], event.get("data") or {}
            # at trial 1's first step (a warm-up step: the incumbent pruner, which needs two
            # timed steps, cannot end the trial before the loss is noticed)
            if kind == "trial_step" and event.get("trial") == 1 and "kill" not in at:
                at["kill"] = time.monotonic()
                cluster.stop_host(LOST_HOST)
                print(f"killed host {LOST_HOST} at trial 1, step {data.get('step')}")
            if kind == "trial_ended" and "kill" in at and "failed" not in at:
                at["failed"] = time.monotonic()
            if kind == "waiting_for_nodes" and restarter is None:
                at["waiting"] = time.monotonic()
                seen["waiting_job"] = stack.get(token, f"/v1/jobs/{event['job_id']}")
                restarter = threading.Thread(target=cluster.restart_host, args=(LOST_HOST,))
                restarter.start()
            if kind == "nodes_back":
                at["back"] = time.monotonic()
        proc.wait(timeout=60)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if restarter is not None:
            restarter.join(timeout=300)
        elif "kill" in at:  # the job never said it waits: bring the host back for the other tests
            cluster.restart_host(LOST_HOST)
    output = "".join(lines)
    assert proc.returncode == 0, f"job A ended with exit code {proc.returncode}:\n{output[-4000:]}"
    job_id = next(str(e["job_id"]) for e in events if e.get("job_id"))
    print(f"job A: {time.monotonic() - started:.1f} s, {len(events)} events")
    return {"events": events, "job_id": job_id, "at": at, "seen": seen}


def test_a_job_waits_for_a_lost_host_and_loses_nothing(stack: ComposeStack, token: str, cluster: ShapedCluster,
                                                      tuned: dict[str, Any]) -> None:
    events, at, job = tuned["events"], tuned["at"], tuned["job_id"]
    lost = cluster.address(LOST_HOST)
    assert "kill" in at, "trial 1 never reached a timed step"
    kinds = [e["kind"] for e in events]
    assert "waiting_for_nodes" in kinds and "nodes_back" in kinds, kinds
    waiting = next(e for e in events if e["kind"] == "waiting_for_nodes")
    assert any(lost in m for m in waiting["data"]["missing"]), waiting
    # while it waits, the job says so (the dashboard shows progress.waiting_for_nodes)
    during = tuned["seen"]["waiting_job"]
    assert during["state"] == "running" and any(lost in m for m in during["progress"]["waiting_for_nodes"]), during
    trials = stack.get(token, f"/v1/jobs/{job}/trials")["items"]
    numbers = [t["number"] for t in trials]
    assert sorted(numbers) == list(range(len(numbers))), numbers  # none lost, none twice
    assert {e["trial"] for e in events if e["kind"] == "trial_ended"} == set(numbers)
    # the trial that lost the host: trial 1 (or, if a prune ended trial 1 first, the next one)
    lost_in = [n for n in numbers if n >= 1 and any(
        a["measurement"].get("lost_nodes") for a in stack.get(token, f"/v1/jobs/{job}/trials/{n}")
        ["attempts"])]
    assert lost_in, "no trial recorded an attempt that lost a node"
    one = stack.get(token, f"/v1/jobs/{job}/trials/{lost_in[0]}")
    statuses = [a["measurement"]["status"] for a in one["attempts"]]
    errors = [a["measurement"].get("error") or "" for a in one["attempts"]]
    print(f"trial {lost_in[0]} ({one['label']}) attempts: {statuses}; the failed one said: {errors[0][:300]!r}")
    print(f"kill -> trial failed {at['failed'] - at['kill']:.1f} s, -> job waiting {at['waiting'] - at['kill']:.1f} s, "
          f"-> node back and job going on {at['back'] - at['kill']:.1f} s")
    assert statuses[0] == "failed" and "node" in errors[0] and lost in errors[0], (statuses, errors[0][:500])
    assert at["failed"] - at["kill"] < 60  # nothing hangs: no wait for gloo's or the trial's timeout
    assert one["attempts"][0]["measurement"].get("lost_nodes"), one["attempts"][0]["measurement"]
    # the rerun, with the host back, ran to its end: a rerun after a lost node is not pruned (its
    # first steps follow the restart; CI, 2026-11-25, once pruned a tp2 x pp2 rerun against the incumbent)
    assert one["state"] == statuses[-1] == "ok", statuses
    job_row = stack.get(token, f"/v1/jobs/{job}")
    assert job_row["state"] == "succeeded" and job_row["progress"].get("waiting_for_nodes") is None, job_row


def test_the_job_picks_within_5_percent_of_an_exhaustive_run(stack: ComposeStack, token: str, cluster: ShapedCluster,
                                                            profile: dict[str, Any], tuned: dict[str, Any],
                                                            tmp_path: Path) -> None:
    job_a = stack.get(token, f"/v1/jobs/{tuned['job_id']}")
    pick = job_a["best"]["label"]
    # what job A measured, in its order: a miss is read from these (CI once: the pick 31.6% slower)
    print(f"job A stopped: {job_a['stop_reason']}")
    for t in stack.get(token, f"/v1/jobs/{tuned['job_id']}/trials")["items"]:
        ms = "" if t["measured_step_time"] is None else f"{float(t['measured_step_time']) * 1000:8.1f} ms"
        print(f"  A#{t['number']:<2} {t['label']:36s} {t['state']:8s} {ms}")
    # Job B: the same job with every candidate run, no stop rule, no pruning
    budget = {**BUDGET, "max_trials": 50, "stop_probability": 0.0, "prune": False, "retime": 0}
    started = time.monotonic()
    out = stack.pipette(token, "submit", str(_job_file(stack, "exhaustive-shaped", budget)), "--json", timeout=120)
    job_b = parse_json(out)["id"]
    deadline = time.monotonic() + 2400
    while (row := stack.get(token, f"/v1/jobs/{job_b}"))["state"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, row
        time.sleep(5)
    assert row["state"] == "succeeded", row
    trials_b = stack.get(token, f"/v1/jobs/{job_b}/trials")["items"]
    ok_b = {t["label"]: float(t["measured_step_time"]) for t in trials_b if t["state"] == "ok"}
    configs = {t["label"]: t["config"] for t in trials_b}
    print(f"job A ran {job_a['progress']['trials_done']} trials and picked {pick}; the exhaustive job ran "
          f"{len(trials_b)} in {time.monotonic() - started:.0f} s (stop: {row['stop_reason']}):")
    for label, t in sorted(ok_b.items(), key=lambda kv: kv[1]):
        print(f"  {label:36s} {t * 1000:8.1f} ms{'   <- job A' if label == pick else ''}")
    assert "every candidate" in str(row["stop_reason"]), row["stop_reason"]
    assert pick in ok_b, (pick, ok_b)
    best = min(ok_b, key=ok_b.__getitem__)
    ratio = ok_b[pick] / ok_b[best]
    print(f"job A's pick / exhaustive best, as the exhaustive job measured them: {ratio:.3f}")
    if ratio > 1 + WITHIN:
        times = _retime(cluster, profile, {pick: configs[pick], best: configs[best]}, tmp_path)
        for label in (pick, best):
            times[label].append(ok_b[label])
            print(f"  {label}: {[round(x * 1000, 1) for x in times[label]]} ms")
        ratio = statistics.median(times[pick]) / statistics.median(times[best])
        p_value = _p_slower_than_within(times[pick], times[best])
        print(f"re-timed in {RETIME_ROUNDS} interleaved rounds: pick / best = {ratio:.3f} (medians); "
              f"p = {p_value:.3f} that the pick is no more than {WITHIN:.0%} slower (Welch, log times)")
        # Two candidates whose trials overlap (one run: 119-144 ms against 110-134 ms, medians
        # 6.5% apart) cannot be told apart by four trials each on this machine: the target is
        # missed when the trials show the pick more than 5% slower beyond their spread (the
        # 21% miss seen once, 128-160 ms against 109-124 ms, gives p = 0.02 with four trials
        # each spread evenly over those ranges; the 6.5% run above gives p = 0.36).
        assert p_value >= SIGNIFICANCE, (f"{pick} is {ratio - 1:.1%} slower than the exhaustive best {best} "
                                         f"(p = {p_value:.3f})")
    else:
        assert ratio <= 1 + WITHIN


def _p_slower_than_within(pick: list[float], best: list[float]) -> float:
    """One-sided Welch t-test on log step times of H0 "the pick is at most ``WITHIN`` slower
    than the best" (log pick - log(1 + WITHIN) <= log best): a small p says it is slower."""
    from scipy.stats import ttest_ind

    shifted = [math.log(t) - math.log(1 + WITHIN) for t in pick]
    return float(ttest_ind(shifted, [math.log(t) for t in best], equal_var=False, alternative="greater").pvalue)


def _retime(cluster: ShapedCluster, profile: dict[str, Any], configs: dict[str, dict[str, Any]],
            tmp_path: Path) -> dict[str, list[float]]:
    """Each candidate again, ``RETIME_ROUNDS`` times in interleaved rounds, from host 0 as a Ray
    driver (``tests/cluster/drive.py``), with the trial length the jobs used."""
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps(profile))
    model, training = ModelSpec.from_hf_config(HF_CONFIG), TrainingSpec.from_dict(TRAINING)
    times: dict[str, list[float]] = {label: [] for label in configs}
    for _ in range(RETIME_ROUNDS):
        for label, config in configs.items():
            spec = tmp_path / "spec.json"
            spec.write_text(json.dumps(TrialSpec(model, training, ParallelConfig.from_dict(config), warmup_steps=2,
                                                 min_steps=3, max_steps=BUDGET["steps"]).candidate()))
            run = drive(cluster, ["trial", "--profile", str(profile_path), "--spec", str(spec), "--timeout", "300"],
                        timeout_s=420)
            m = run.result["measurement"]
            assert m["status"] == "ok", m
            times[label].append(float(m["step_time"]))
    return times
