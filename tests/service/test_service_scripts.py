"""Jobs of a user's own training script through the service: only where an operator enabled
scripts for the tenant on the cluster (403 naming both otherwise), bad scripts refused at
submit (422), and a real job whose script runs on the embedded Ray without any of the
service's credentials in its environment."""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.db import Database
from service.migrations import upgrade
from tests.service.conftest import JOB_BODY, METRICS_TOKEN, Api, remember_profile, seed_profile
from tests.service.processes import ROOT, ServiceProcess, admin_token, wait_for
from tests.service.script_access import python_open_to_others
from workers.host.workdir import pack

SCRIPTS = ROOT / "tests" / "integration" / "scripts"


def _files() -> str:
    return base64.b64encode(pack(SCRIPTS)).decode()


def _script_job(**script: Any) -> dict[str, Any]:
    return {**JOB_BODY, "script": {"argv": ["python", "ds_tiny.py"], "kind": "deepspeed", "files": _files(),
                                   **script}}


def _allow(url: str, home: Path, tenant: str, cluster: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIPETTE_DATABASE_URL": url, "PIPETTE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "service.admin", "cluster", "allow-scripts", "--tenant", tenant,
                           "--cluster", cluster, *extra], env=env, capture_output=True, text=True, timeout=120)


def _tenant(api: Api) -> tuple[str, dict[str, str]]:
    tenant = f"t{os.urandom(5).hex()}"
    return tenant, api.token(tenant)


def test_a_script_job_needs_the_operators_permission(api: Api, tmp_path: Path) -> None:
    tenant, headers = _tenant(api)
    api.local_cluster(headers)
    r = api.client.post("/v1/jobs", json=_script_job(), headers=headers)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["field"] == "script"
    assert error["message"] == f"scripts are not enabled for tenant {tenant!r} on cluster 'local'"
    assert f"pipette-admin cluster allow-scripts --tenant {tenant} --cluster local" in error["fix"]

    url = str(api.db.engine.url.render_as_string(hide_password=False))
    done = _allow(url, tmp_path, tenant, "local")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"scripts enabled for tenant {tenant!r} on cluster 'local'"
    r = api.client.post("/v1/jobs", json=_script_job(), headers=headers)
    assert r.status_code == 202, r.text

    # another tenant's cluster of the same name is not enabled by it
    _, other = _tenant(api)
    api.local_cluster(other)
    assert api.client.post("/v1/jobs", json=_script_job(), headers=other).status_code == 403
    # and it can be taken back
    assert _allow(url, tmp_path, tenant, "local", "--off").returncode == 0
    assert api.client.post("/v1/jobs", json=_script_job(), headers=headers).status_code == 403
    # an unknown cluster: one line, exit 1
    missing = _allow(url, tmp_path, tenant, "nowhere")
    assert missing.returncode == 1 and "no cluster 'nowhere'" in missing.stderr


@pytest.mark.parametrize(("script", "field", "says"), [
    ({"argv": ["python train.py --lr 1"]}, "script.argv", "shell string"),
    ({"argv": []}, "script.argv", "at least 1"),
    ({"argv": ["python", "missing.py"]}, "script.argv", "has no 'missing.py'"),
    ({"files": "not base64!"}, "script.files", "base64"),
    ({"knobs": {"epochs": "--epochs"}}, "script.knobs", "unknown knob"),
    ({"argv": ["python", "ds_tiny.py"], "files": ""}, "script.files", "none was sent"),
])
def test_bad_scripts_are_refused_at_submit(sqlite_api: Api, tmp_path: Path, script: dict[str, Any], field: str,
                                           says: str) -> None:
    tenant, headers = _tenant(sqlite_api)
    sqlite_api.local_cluster(headers)
    url = str(sqlite_api.db.engine.url)
    assert _allow(url, tmp_path, tenant, "local").returncode == 0
    r = sqlite_api.client.post("/v1/jobs", json=_script_job(**script), headers=headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field, error
    assert says in error["message"] or says in (error["fix"] or ""), error


def test_what_a_script_cannot_run_is_said_through_the_api_as_on_the_command_line(sqlite_api: Api,
                                                                                   tmp_path: Path) -> None:
    """``pipette tune --script-unsupported`` had no counterpart in a job of the service: a job's
    script could not say it runs no pipeline, and its pp candidates were tried and failed."""
    from sqlalchemy import select

    from pipette.script import UNSUPPORTED
    from service.models import Job

    tenant, headers = _tenant(sqlite_api)
    sqlite_api.local_cluster(headers)
    assert _allow(str(sqlite_api.db.engine.url), tmp_path, tenant, "local").returncode == 0
    r = sqlite_api.client.post("/v1/jobs", json=_script_job(unsupported=["pp", "offload"]), headers=headers)
    assert r.status_code == 202, r.text
    with sqlite_api.db.read() as s:
        row = s.scalars(select(Job).where(Job.id == r.json()["id"])).one()
        assert row.script is not None and row.script["unsupported"] == ["offload", "pp"]
    bad = sqlite_api.client.post("/v1/jobs", json=_script_job(unsupported=["warp"]), headers=headers)
    assert bad.status_code == 422, bad.text
    assert bad.json()["error"]["field"].startswith("script.unsupported"), bad.text
    # the API's choices are the core's
    schema = sqlite_api.client.get("/openapi.json").json()["components"]["schemas"]["ScriptIn"]
    assert set(schema["properties"]["unsupported"]["items"]["enum"]) == set(UNSUPPORTED)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_script_job_runs_without_the_services_credentials(tmp_path: Path, deepspeed_ready: None) -> None:
    url = f"sqlite:///{tmp_path / 'scripts.db'}"
    upgrade(url)
    headers = admin_token(url, tmp_path, "script-tenant")
    service = ServiceProcess(url, tmp_path, log_name="api", PIPETTE_METRICS_TOKEN=METRICS_TOKEN,
                             PIPETTE_TEST_SECRET="s3cret")
    db = Database(url)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(python_open_to_others())  # the service runs the script as nobody
        service.start()
        c = httpx.Client(base_url=service.base, headers=headers, timeout=30)
        cluster = c.post("/v1/clusters", json={"name": "local", "devices": 2}).json()
        seed_profile(db, cluster["id"])
        assert _allow(url, tmp_path, "script-tenant", "local").returncode == 0
        body = {**JOB_BODY, "budget": {"max_trials": 2, "steps": 3, "retries": 0, "retime": 0,
                                       "trial_timeout_s": 480},
                "script": {"argv": ["python", "env_guard.py", "ds_tiny.py"], "kind": "deepspeed", "files": _files()}}
        job = c.post("/v1/jobs", json=body)
        assert job.status_code == 202, job.text
        done = wait_for(lambda: (j := c.get(job.json()["url"]).json())["state"] in ("succeeded", "failed") and j,
                        900, "the script job to end", service)
        remember_profile(db, cluster["id"])
        trials = c.get(f"{job.json()['url']}/trials").json()["items"]
        assert done["state"] == "succeeded", (done, [t.get("error") for t in trials], service.tail())
        assert all(t["state"] in ("ok", "oom", "failed", "pruned") for t in trials)
        best = c.get(f"{job.json()['url']}/best").json()
        assert "optimizer" not in best["ds_config"]
        assert sorted(best["files"]) == sorted(["ds_config.json", "accelerate_config.yaml", "hostfile",
                                                "rank_map.json", "candidate.json", "launch-deepspeed.sh",
                                                "launch-torchrun.sh", "launch-accelerate.sh"])
        launch = c.get(best["files"]["launch-torchrun.sh"])
        assert launch.status_code == 200 and "ds_tiny.py" in launch.text and "env_guard.py" in launch.text
    finally:
        db.dispose()
        service.stop()
        stack.close()
