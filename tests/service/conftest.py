"""Fixtures for the service's tests: real databases (a SQLite file, and a throwaway database
on the local PostgreSQL for the session), migrated by the admin code path, and apps on them.

PostgreSQL must be running at 127.0.0.1:5432 (``./dev test`` starts it). If it is not, every
test that needs it fails with that message: they never skip.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from service.app import create_app
from service.auth import create_token
from service.db import Database
from service.migrations import upgrade
from service.settings import Settings

PG_ADMIN_URL = os.environ.get("PIPETTE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BACKENDS = ("sqlite", "postgresql")
#: The operator's /metrics credential in the service tests (PIPETTE_METRICS_TOKEN).
METRICS_TOKEN = "test-operator-metrics"


def pg_url(name: str) -> str:
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{name}"


@contextlib.contextmanager
def throwaway_pg_database(prefix: str = "pipette_test", name: str | None = None) -> Iterator[str]:
    """A new, empty PostgreSQL database, dropped afterwards (even if a connection is left open)."""
    name = name or f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as e:  # any driver error: say what to do, loudly
        admin.dispose()
        pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is not usable ({type(e).__name__}: {e}); "
                    "start it (./dev test does: pg_ctlcluster 15 main start)", pytrace=False)
    try:
        yield pg_url(name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_session_url() -> Iterator[str]:
    """One migrated PostgreSQL database for the session's API tests (tenants keep them apart)."""
    with throwaway_pg_database() as url:
        upgrade(url)
        yield url


@contextlib.contextmanager
def fresh_database(backend: str, tmp_path: Path) -> Iterator[str]:
    """An empty database of ``backend`` (not migrated)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / f'pipette-{uuid.uuid4().hex[:6]}.db'}"
    else:
        with throwaway_pg_database() as url:
            yield url


@dataclass
class Api:
    """A TestClient on an app (scheduler off: nothing runs trials) plus token helpers."""

    client: TestClient
    db: Database
    backend: str

    def token(self, tenant: str | None = None) -> dict[str, str]:
        """Authorization headers of a new token (a fresh tenant unless one is named)."""
        with self.db.write() as session:
            _, secret = create_token(session, tenant or f"t{uuid.uuid4().hex[:10]}")
        return {"Authorization": f"Bearer {secret}"}

    def local_cluster(self, headers: dict[str, str], name: str = "local", devices: int = 2) -> dict[str, Any]:
        r = self.client.post("/v1/clusters", json={"name": name, "devices": devices}, headers=headers)
        assert r.status_code == 201, r.text
        return dict(r.json())


def make_api(url: str, backend: str, home: Path, **settings: Any) -> Iterator[Api]:
    db = Database(url)
    settings.setdefault("token_cache_s", 0.5)
    settings.setdefault("metrics_token", METRICS_TOKEN)
    app = create_app(Settings(database_url=url, home=home, scheduler=False, **settings), database=db)
    with TestClient(app) as client:
        yield Api(client, db, backend)
    db.dispose()


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Api]:
    backend = request.param
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'api.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_session_url")
    yield from make_api(url, backend, tmp_path)


@pytest.fixture(params=BACKENDS)
def isolated_api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Api]:
    """Like ``api`` but on a database of its own: for tests of the (global) devices' leases."""
    with fresh_database(request.param, tmp_path) as url:
        upgrade(url)
        yield from make_api(url, request.param, tmp_path)


@pytest.fixture
def sqlite_api(tmp_path: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    upgrade(url)
    yield from make_api(url, "sqlite", tmp_path)


JOB_BODY: dict[str, Any] = {
    "cluster": "local",
    "model": "tiny-llama",
    "training": {"global_batch": 4, "seq_len": 32, "dtype": "fp32", "method": "lora", "lora": {"rank": 8, "alpha": 16}},
    "budget": {"max_trials": 2, "steps": 3},
}


@pytest.fixture
def job_body() -> Callable[..., dict[str, Any]]:
    def build(**changes: Any) -> dict[str, Any]:
        import copy

        body = copy.deepcopy(JOB_BODY)
        body.update(changes)
        return body

    return build


# ---- end-to-end: real Ray, real DeepSpeed trials ----------------------------------------

@pytest.fixture(scope="session")
def deepspeed_ready() -> None:
    """DeepSpeed builds its CPU shared-memory op on first use (about a minute, once per machine,
    cached); build it up front so no trial's timeout pays for it, into the cache the ranks use, as a
    job does (``workers.ops``; as tests/integration and tests/cluster do). DeepSpeed's own
    ``build_shm_op`` built into its default folder, which no rank reads."""
    from workers.ops import build_ops

    build_ops("cpu", timeout_s=600)


#: A profile of this machine measured by the first end-to-end job of the session, given to the
#: clusters of the next ones (the probe takes most of a minute on 2 cores).
MEASURED: dict[str, Any] = {}


def remember_profile(db: Database, cluster_id: str) -> None:
    from service.repositories.clusters import latest_profile

    with db.read() as session:
        profile = latest_profile(session, cluster_id)
        if profile is not None and profile.profile is not None:
            MEASURED.setdefault("profile", profile.profile)


def seed_profile(db: Database, cluster_id: str) -> bool:
    """Store the session's measured profile as this cluster's latest; False if none yet."""
    if "profile" not in MEASURED:
        return False
    from service.models import Cluster, utcnow
    from service.repositories.clusters import request_profile

    with db.write() as session:
        cluster = session.get(Cluster, cluster_id)
        assert cluster is not None
        profile = request_profile(session, cluster)
        profile.state, profile.profile, profile.finished_at = "succeeded", MEASURED["profile"], utcnow()
    return True
