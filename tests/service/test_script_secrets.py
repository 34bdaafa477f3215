"""A tenant's script cannot read the service's secrets: it runs as another OS user (``nobody``
for a service run as root), Ray's token file and session folder and the service's home are
the service user's alone, and whatever a trial prints is stored with the service's secret values
blanked. A real service and Ray, a script that tries to read them all."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from service.db import Database
from service.migrations import upgrade
from service.redact import MARK, Redactor, service_secrets
from tests.service.conftest import JOB_BODY, METRICS_TOKEN, remember_profile, seed_profile
from tests.service.processes import ServiceProcess, admin_token, wait_for
from tests.service.script_access import python_open_to_others
from tests.service.test_service_scripts import _allow, _files

RAY_TOKEN = Path.home() / ".ray" / "auth_token"
TEST_SECRET = "s3cret-of-the-service-4242"


def test_the_services_secret_values_are_redacted(tmp_path: Path) -> None:
    token = tmp_path / "ray_token"
    token.write_text("ray-token-0123456789\n")
    home = str(tmp_path / "svc")  # a value that is no secret: left as it is
    secrets = service_secrets("postgresql+psycopg://svc:pa55word-xyz@db.example/pipette", METRICS_TOKEN,
                              {"RAY_AUTH_TOKEN_PATH": str(token), "PIPETTE_API_SECRET": "api-secret-value",
                               "PIPETTE_POLL_S": "0.5", "HOME": home})
    text = ("url postgresql+psycopg://svc:pa55word-xyz@db.example/pipette, pw pa55word-xyz, metrics "
            f"{METRICS_TOKEN}, ray ray-token-0123456789, api api-secret-value, poll 0.5, home {home}")
    assert secrets.text(text) == (f"url {MARK}, pw {MARK}, metrics {MARK}, ray {MARK}, api {MARK}, poll 0.5, "
                                  f"home {home}")
    record = {"error": f"x {METRICS_TOKEN}", "extra": {"output_tail": ["pa55word-xyz"], "n": 3}}
    assert secrets.found(record)
    assert secrets.data(record) == {"error": f"x {MARK}", "extra": {"output_tail": [MARK], "n": 3}}
    assert not Redactor(["short"]).found({"a": "short"})  # too short to be a secret: not blanked


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(os.geteuid() != 0, reason="starting a script as another user needs root (CI runs as root)")
def test_a_tenants_script_reads_none_of_the_services_secrets(tmp_path: Path) -> None:
    home = tmp_path / "home"
    url = f"sqlite:///{home / 'pipette.db'}"
    home.mkdir()
    upgrade(url)
    headers = admin_token(url, home, "spy-tenant")
    service = ServiceProcess(url, home, log_name="api", PIPETTE_METRICS_TOKEN=METRICS_TOKEN,
                             PIPETTE_TEST_SECRET=TEST_SECRET)
    db = Database(url)
    with python_open_to_others():
        try:
            service.start()
            c = httpx.Client(base_url=service.base, headers=headers, timeout=30)
            cluster = c.post("/v1/clusters", json={"name": "local", "devices": 2}).json()
            seed_profile(db, cluster["id"])
            assert _allow(url, home, "spy-tenant", "local").returncode == 0
            body = {**JOB_BODY, "budget": {"max_trials": 1, "steps": 3, "retries": 0, "retime": 0,
                                           "trial_timeout_s": 300},
                    "script": {"argv": ["python", "spy.py", str(RAY_TOKEN), str(home / "pipette.db")],
                               "kind": "deepspeed", "files": _files()}}
            job = c.post("/v1/jobs", json=body)
            assert job.status_code == 202, job.text
            done = wait_for(lambda: (j := c.get(job.json()["url"]).json())["state"] in ("succeeded", "failed") and j,
                            600, "the spy's job to end", service)
            remember_profile(db, cluster["id"])
            items = c.get(f"{job.json()['url']}/trials").json()["items"]
            details = [c.get(f"{job.json()['url']}/trials/{t['number']}").json() for t in items]
        finally:
            db.dispose()
            service.stop()
    served = json.dumps([done, items, details])
    assert details, (done, service.tail())
    tail = "\n".join(str(d["record"]["measurement"]["extra"].get("output_tail", "")) for d in details)
    # the script ran, as nobody, and tried: it says so in its output
    assert "I am uid 65534" in tail, (served[-3000:], service.tail())
    assert f"file {RAY_TOKEN}: denied (PermissionError)" in tail, tail
    assert f"file {home / 'pipette.db'}: denied (PermissionError)" in tail, tail
    secrets = [METRICS_TOKEN, TEST_SECRET, url]
    if RAY_TOKEN.exists():
        secrets.append(RAY_TOKEN.read_text().strip())
    leaked = [s for s in secrets if s in served]
    assert not leaked, (leaked, tail)
    assert "PIPETTE_DATABASE_URL=" not in served and "PIPETTE_METRICS_TOKEN=" not in served, tail


@pytest.mark.skipif(os.geteuid() != 0, reason="checks a user switch as root")
def test_a_script_user_who_cannot_run_python_fails_the_job_in_one_line(tmp_path: Path) -> None:
    """Root's home (mode 0700) holds CI's interpreter: as it is, nobody cannot run it."""
    from pipette.errors import SpecError
    from workers.host.script_user import resolve, service_script_user

    with python_open_to_others():
        assert service_script_user(None) == "nobody"
    if os.stat(Path.home()).st_mode & 0o001 or not str(Path(os.path.realpath(sys.executable))).startswith(
            str(Path.home())):
        pytest.skip("this interpreter is open to other users already")
    with pytest.raises(SpecError, match=r"names 'nobody', who cannot run this service's Python .*Permission"):
        service_script_user(None)
    with pytest.raises(SpecError, match=r"names 'no-such-user-43', no user on this host"):
        resolve("no-such-user-43")
    with pytest.raises(SpecError, match=r"names 'root', which is root or the service's own user"):
        resolve("root")


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a check as another user, which needs root")
def test_a_service_that_cannot_switch_users_refuses_a_script_in_one_line() -> None:
    """The check, run by a service that is not root and has no capabilities (here: as nobody)."""
    import subprocess

    code = ("from pipette.errors import SpecError\nfrom workers.host.script_user import service_script_user\n"
            "try:\n    service_script_user(None)\n"
            "except SpecError as e:\n    print(e.field, '|', e.message, '|', e.fix)")
    root = Path(__file__).resolve().parents[2]
    with python_open_to_others():
        done = subprocess.run([sys.executable, "-c", code], user=65534, group=65534, extra_groups=[], cwd="/",
                              env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    field, message, fix = (p.strip() for p in done.stdout.split("|"))
    assert field == "PIPETTE_SCRIPT_USER"
    assert message == ("a tenant's script must run as another user, and this service (uid 65534) cannot switch "
                       "users: it lacks CAP_CHOWN, CAP_KILL, CAP_SETGID, CAP_SETUID")
    assert fix.startswith("run pipette-admin serve as root (scripts then run as nobody")
