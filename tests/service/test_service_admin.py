"""The admin command: tokens are created (printed once, stored hashed), listed without their
secrets and revoked; errors are one line naming the field and the fix, exit code 1."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from service.migrations import upgrade

ROOT = Path(__file__).resolve().parents[2]


def admin(*args: str, url: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIPETTE_DATABASE_URL": url, "PIPETTE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "service.admin", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_token_lifecycle(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'admin.db'}"
    upgrade(url)
    created = admin("token", "create", "--tenant", "acme", "--name", "ci", "--json", url=url, home=tmp_path)
    assert created.returncode == 0, created.stderr
    token = json.loads(created.stdout)
    assert token["tenant"] == "acme" and token["token"].startswith("pip_") and len(token["token"]) > 40
    engine = create_engine(url)
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT token_hash, prefix FROM tokens")).one()
    engine.dispose()
    assert stored.token_hash == hashlib.sha256(token["token"].encode()).hexdigest()
    listed = admin("token", "list", url=url, home=tmp_path)
    assert listed.returncode == 0 and "acme" in listed.stdout and token["token"] not in listed.stdout
    assert admin("token", "revoke", str(token["id"]), url=url, home=tmp_path).returncode == 0
    assert "revoked" in admin("token", "list", "--tenant", "acme", url=url, home=tmp_path).stdout
    again = admin("token", "revoke", str(token["id"]), url=url, home=tmp_path)
    assert again.returncode == 1 and again.stderr.startswith("pipette-admin: error: id: no active token")


def test_errors_are_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    bad_tenant = admin("token", "create", "--tenant", "a b;rm", url=url, home=tmp_path)
    assert bad_tenant.returncode == 1
    unmigrated = admin("token", "create", "--tenant", "acme", url=url, home=tmp_path)
    assert unmigrated.returncode == 1
    assert "pipette-admin migrate" in unmigrated.stderr and len(unmigrated.stderr.strip().splitlines()) == 1
    upgrade(url)
    bad_tenant = admin("token", "create", "--tenant", "a b;rm", url=url, home=tmp_path)
    assert bad_tenant.returncode == 1 and "tenant" in bad_tenant.stderr and "Traceback" not in bad_tenant.stderr
    bad_url = admin("migrate", url="mysql://x/y", home=tmp_path)
    assert bad_url.returncode == 1 and "PIPETTE_DATABASE_URL" in bad_url.stderr
    assert admin("frobnicate", url=url, home=tmp_path).returncode == 2


def test_serve_and_worker_refuse_a_missing_or_unmigrated_database_in_one_line(tmp_path: Path) -> None:
    """With the scheduler on (the default), `serve` died with a 148-line traceback on a missing
    database and on an unmigrated one (issue 17, item 20); `worker` too."""
    from tests.service.conftest import pg_url, throwaway_pg_database

    missing = admin("serve", "--port", "0", url=pg_url("pipette_no_such_db"), home=tmp_path)
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 1 and len(lines) == 1, missing.stderr
    assert "cannot reach the database" in lines[0] and "pipette_no_such_db" in lines[0]
    with throwaway_pg_database() as url:  # created, never migrated
        for command in (["serve", "--port", "0"], ["worker"]):
            done = admin(*command, url=url, home=tmp_path)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1 and len(lines) == 1, done.stderr
            assert "is at schema none (empty)" in lines[0] and "pipette-admin migrate" in lines[0]


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_serve_exits_130_at_ctrl_c_and_143_at_sigterm_like_tune(tmp_path: Path, inherited: str) -> None:
    """Issue 32, item 7: the same exit codes across `tune` and `serve`. uvicorn re-raised the
    signal, so `pipette serve` died by SIGTERM (-15) with nothing said. An ignored SIGINT inherited
    from a background job (`pytest ... &` or `pipette serve &`), which uvicorn put back before it
    re-raised the signal, ended the process 0 with nothing said."""
    import signal
    import time

    import httpx

    from tests.service.processes import free_port

    disposition = signal.SIG_DFL if inherited == "default" else signal.SIG_IGN
    for signum, code, said in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")):
        port = free_port()
        env = {**os.environ, "PIPETTE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "PIPETTE_SCHEDULER": "0",
               "PIPETTE_DATABASE_URL": f"sqlite:///{tmp_path / 'serve.db'}"}
        proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == code and f"pipette: {said}" in err, (signum, proc.returncode, err[-2000:])
