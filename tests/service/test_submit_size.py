"""One limit on what a client sends, said where it applies (issue 43, item 6): `pipette submit` of
a working folder over ~750 KB zipped failed with "the request body is larger than 1048576 bytes"
though the schema allowed 64 MiB files. The body limit (PIPETTE_MAX_BODY_BYTES) is the one bound,
its ceiling is the schema's; the service says the value in force (GET /v1/limits) and the CLI
checks a job against it before sending, naming the folder's size and the setting to raise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pipette.errors import SpecError
from service.migrations import upgrade
from service.schemas import ScriptIn
from service.settings import DEFAULT_MAX_BODY_BYTES, MAX_BODY_BYTES_CEILING, Settings
from tests.service.conftest import Api, make_api
from tests.service.processes import ROOT, ServiceProcess, admin_token
from tests.service.test_service_scripts import _allow

MiB = 1024**2


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    upgrade(url)
    yield from make_api(url, "sqlite", tmp_path, max_body_bytes=2 * MiB)


def test_the_service_says_the_body_limit_in_force(api: Api) -> None:
    r = api.client.get("/v1/limits", headers=api.token())
    assert r.status_code == 200, r.text
    assert r.json() == {"max_body_bytes": 2 * MiB, "setting": "PIPETTE_MAX_BODY_BYTES"}
    assert api.client.get("/v1/limits").status_code == 401


def test_a_body_over_the_limit_is_told_the_setting_that_raises_it(api: Api) -> None:
    r = api.client.post("/v1/plan", content=b"{" + b" " * (2 * MiB) + b"}",
                        headers={**api.token(), "Content-Type": "application/json"})
    assert r.status_code == 413
    assert "PIPETTE_MAX_BODY_BYTES" in r.json()["error"]["fix"]


def test_the_schema_bound_is_the_body_limits_ceiling() -> None:
    assert ScriptIn.model_fields["files"].metadata[0].max_length == MAX_BODY_BYTES_CEILING == 64 * MiB
    assert Settings.from_env({"PIPETTE_MAX_BODY_BYTES": str(64 * MiB)}).max_body_bytes == 64 * MiB
    assert Settings.from_env({}).max_body_bytes == DEFAULT_MAX_BODY_BYTES == MiB
    with pytest.raises(SpecError, match="PIPETTE_MAX_BODY_BYTES") as e:
        Settings.from_env({"PIPETTE_MAX_BODY_BYTES": str(65 * MiB)})
    assert e.value.fix == f"give a number from 1024 to {64 * MiB}"


def _job_file(tmp_path: Path, payload: int) -> Path:
    """A script job whose working folder holds ``payload`` random bytes (they do not compress)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('train')\n")
    (work / "data.bin").write_bytes(os.urandom(payload))
    job = tmp_path / "job.yaml"
    job.write_text("cluster: local\nmodel: tiny-llama\ntraining: {global_batch: 4, seq_len: 32, dtype: fp32}\n"
                   "budget: {max_trials: 2, steps: 3}\nscript:\n  argv: [python, train.py]\n  kind: deepspeed\n"
                   "  workdir: work\n")
    return job


def _submit(service: ServiceProcess, token: str, job: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIPETTE_URL": service.base, "PIPETTE_TOKEN": token, "PYTHONPATH": str(ROOT),
           "PIPETTE_CONFIG": str(job.parent / "cli.json"), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "cli", "submit", str(job)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@pytest.mark.timeout(300)
def test_submit_checks_the_folder_against_the_services_limit_before_sending(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'svc.db'}"
    upgrade(url)
    headers = admin_token(url, tmp_path, "alice")
    token = headers["Authorization"].removeprefix("Bearer ")
    job = _job_file(tmp_path, 800_000)  # ~800 KB zipped, ~1.07 MB as base64: over 1 MiB
    small = ServiceProcess(url, tmp_path, log_name="small", PIPETTE_SCHEDULER="0").start()
    try:
        assert httpx.post(f"{small.base}/v1/clusters", json={"name": "local", "devices": 2}, headers=headers,
                          timeout=30).status_code == 201
        assert _allow(url, tmp_path, "alice", "local").returncode == 0
        done = _submit(small, token, job)
        assert done.returncode == 1, done.stdout + done.stderr
        said = done.stderr.strip()
        assert len(said.splitlines()) == 1 and "Traceback" not in said, said
        assert "more than the service's request limit of 1,048,576 bytes" in said, said
        assert "script.workdir" in said and "raise PIPETTE_MAX_BODY_BYTES" in said, said
        assert re.search(r"its working folder is 78\d\.\d KiB zipped, sent as base64; up to about 76\d\.\d KiB "
                         r"zipped fits", said), said
        jobs = httpx.get(f"{small.base}/v1/jobs", headers=headers, timeout=30).json()["items"]
        assert jobs == []
    finally:
        small.stop()
    # the operator raises the limit: the same folder goes through
    large = ServiceProcess(url, tmp_path, log_name="large", PIPETTE_SCHEDULER="0",
                           PIPETTE_MAX_BODY_BYTES=str(4 * MiB)).start()
    try:
        done = _submit(large, token, job)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "submitted job" in done.stdout
    finally:
        large.stop()
