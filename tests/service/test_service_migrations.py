"""Migrations: an empty database goes up to head (matching the models exactly) and back down,
on SQLite and PostgreSQL; the app never migrates by itself and says so in /readyz."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect, text

from service.app import create_app
from service.migrations import current_revision, downgrade, head_revision, upgrade
from service.models import Base
from service.settings import Settings
from tests.service.conftest import BACKENDS, fresh_database

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"tokens", "clusters", "profiles", "jobs", "trials", "events", "leases"}
HEAD = "0006"


@pytest.mark.parametrize("backend", BACKENDS)
def test_upgrade_to_head_and_back_down(backend: str, tmp_path: Path) -> None:
    with fresh_database(backend, tmp_path) as url:
        engine = create_engine(url)
        try:
            assert set(inspect(engine).get_table_names()) == set()
            upgrade(url)
            assert current_revision(engine) == head_revision() == HEAD
            assert set(inspect(engine).get_table_names()) == TABLES | {"alembic_version"}
            with engine.connect() as conn:  # the migration creates exactly what the models declare
                diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
            assert diff == []
            downgrade(url, "base")
            assert set(inspect(engine).get_table_names()) == {"alembic_version"}
            assert current_revision(engine) is None
            upgrade(url)  # and up again: the downgrade left nothing behind
            assert current_revision(engine) == HEAD
        finally:
            engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_app_never_migrates_and_readyz_says_so(backend: str, tmp_path: Path) -> None:
    with fresh_database(backend, tmp_path) as url:
        app = create_app(Settings(database_url=url, home=tmp_path, scheduler=False))
        with TestClient(app) as client:
            r = client.get("/readyz")
            assert r.status_code == 503
            check = r.json()["checks"]["database"]
            assert check["ok"] is False and "pipette-admin migrate" in check["fix"]
        engine = create_engine(url)
        assert "jobs" not in inspect(engine).get_table_names()
        engine.dispose()


def test_admin_migrate_command(tmp_path: Path) -> None:
    env = {**os.environ, "PIPETTE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    env.pop("PIPETTE_DATABASE_URL", None)
    r = subprocess.run([sys.executable, "-m", "service.admin", "migrate"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    db = tmp_path / "home" / "pipette.db"
    assert db.exists() and "database at head" in r.stdout  # the embedded default: SQLite under PIPETTE_HOME
    engine = create_engine(f"sqlite:///{db}")
    assert current_revision(engine) == HEAD
    engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_0002_fills_the_trial_figures_of_stored_records(backend: str, tmp_path: Path) -> None:
    """A database at 0001 with a recorded trial: 0002 copies the record's figures to columns."""
    from pipette.clusterfile import load_cluster
    from pipette.measurement import Measurement
    from pipette.model import ModelSpec
    from pipette.plan import make_plan
    from pipette.training import TrainingSpec
    from pipette.tuner import TrialRecord

    training = TrainingSpec(global_batch=8, seq_len=64, dtype="fp32")
    planned = make_plan(ModelSpec.preset("tiny-llama"), training,
                        load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")).best
    measured = Measurement("ok", (0.30, 0.32, 0.31), training.tokens_per_step, (2**27, 2**28), (6.2, 6.1, 6.0))
    record = TrialRecord(0, planned.config, measured, planned.perf, planned.memory, 0.25, attempt=2).to_dict()
    with fresh_database(backend, tmp_path) as url:
        upgrade(url, "0001")
        engine = create_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO clusters (id, tenant, name, kind, address, resource, nodes, "
                                  "devices_per_node, created_at) VALUES ('c', 't', 'n', 'local', 'h', 'local:h', "
                                  "'[]', 2, CURRENT_TIMESTAMP)"))
                conn.execute(text("INSERT INTO jobs (id, tenant, name, cluster_id, state, model, training, options, "
                                  "created_at, updated_at, cancel_requested, attempts, progress, tuning_s) VALUES "
                                  "('j', 't', '', 'c', 'running', '{}', '{}', '{}', CURRENT_TIMESTAMP, "
                                  "CURRENT_TIMESTAMP, false, 1, '{}', 0)"))
                conn.execute(text("INSERT INTO trials (job_id, number, state, label, config, steps, record, attempts, "
                                  "runs, started_at) VALUES ('j', 0, 'ok', :label, :config, '[]', :record, '[]', 1, "
                                  "CURRENT_TIMESTAMP)"),
                             {"label": planned.config.label, "config": json.dumps(record["config"]),
                              "record": json.dumps(record)})
            upgrade(url)
            with engine.connect() as conn:
                row = conn.execute(text("SELECT analytic_step_time, predicted_peak_bytes, tokens_per_s, "
                                        "peak_memory_bytes, error, attempt FROM trials")).one()
            assert row.analytic_step_time == pytest.approx(planned.perf.step_time)
            assert row.predicted_peak_bytes == planned.memory.peak_bytes - planned.memory.breakdown["overhead"]
            assert row.tokens_per_s == pytest.approx(training.tokens_per_step / 0.31)
            assert (row.peak_memory_bytes, row.error, row.attempt) == (2**28, None, 2)
            downgrade(url, "0001")
            assert "tokens_per_s" not in {c["name"] for c in inspect(engine).get_columns("trials")}
        finally:
            engine.dispose()


#: Loaded at the start of the killed ``migrate`` (as ``sitecustomize``): it pauses the process right
#: after 0002's first ALTER TABLE (between two operations of one migration) and says so in a file.
PAUSE_MID_MIGRATION = '''
import os, time
from sqlalchemy import event
from sqlalchemy.engine import Engine

@event.listens_for(Engine, "after_cursor_execute")
def _pause(conn, cursor, statement, parameters, context, executemany):
    if "ADD COLUMN analytic_step_time" in statement:
        open(os.environ["PAUSED_AT"], "w").write(statement)
        time.sleep(600)
'''


def test_a_migrate_killed_mid_migration_on_sqlite_is_resumed_by_the_next(tmp_path: Path) -> None:
    """SIGKILL of a real ``pipette-admin migrate`` between two ALTERs of 0002: the half-done
    migration is rolled back (0001 stays whole), and the next ``migrate`` goes on to head."""
    import signal
    import time

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PAUSE_MID_MIGRATION)
    paused = tmp_path / "paused"
    url = f"sqlite:///{tmp_path / 'pipette.db'}"
    env = {**os.environ, "PIPETTE_HOME": str(tmp_path / "home"), "PIPETTE_DATABASE_URL": url}
    killed = subprocess.Popen([sys.executable, "-m", "service.admin", "migrate"], cwd=ROOT,
                              env={**env, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "PAUSED_AT": str(paused)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not paused.exists():
            assert killed.poll() is None, killed.communicate()[0]
            assert time.monotonic() < deadline, "migrate never reached 0002's ALTER TABLE"
            time.sleep(0.1)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
    engine = create_engine(url)
    try:
        assert current_revision(engine) == "0001"
        assert "analytic_step_time" not in {c["name"] for c in inspect(engine).get_columns("trials")}
        r = subprocess.run([sys.executable, "-m", "service.admin", "migrate"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**env, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr
        assert current_revision(engine) == HEAD
    finally:
        engine.dispose()
