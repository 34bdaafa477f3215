"""Schemathesis against the OpenAPI schema: generated valid and invalid requests to every
operation must never get a 5xx, must conform to the documented responses, and every 4xx must
say what was wrong and which field (``{"error": {"message", "field", "fix"}}``).

Bounded (``max_examples``) to keep CI short, on SQLite and PostgreSQL; the scheduler is off, so no request starts a
trial (submitting a job only queues it).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service.app import create_app
from service.auth import create_token
from service.db import Database
from service.migrations import upgrade
from service.settings import Settings
from tests.service.conftest import pg_url, throwaway_pg_database

# Not run: "positive data acceptance" (a schema-valid request must not answer 422). The core
# checks meaning no schema can express: a config.json whose hidden size the heads do not
# divide, a cluster file with a 3x2 link matrix for 2 devices, a recipe nothing fits. Those
# answer 422 naming the field, which ``errors_name_the_field`` checks instead.
FIELD_STATUSES = {400, 401, 404, 409, 413, 422}


@schemathesis.check
def errors_name_the_field(ctx: Any, response: Any, case: Any) -> None:
    """Every 4xx answers the one error shape, and names the field where one is to blame."""
    if not 400 <= response.status_code < 500:
        return
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], f"no message: {error}"
    if response.status_code in FIELD_STATUSES:
        assert error["field"], f"{response.status_code} does not name the field: {error}"
        assert error["fix"], f"{response.status_code} gives no fix: {error}"


# The schemas are read from the apps at import (pytest parametrizes by operation then); an app
# touches its database only when called, and the fixtures below create and migrate it first.
HOME = Path(tempfile.gettempdir()) / f"pipette-fuzz-{uuid.uuid4().hex[:8]}"
SQLITE_URL = f"sqlite:///{HOME / 'fuzz.db'}"
PG_NAME = f"pipette_fuzz_{uuid.uuid4().hex[:10]}"
APPS = {
    "sqlite": create_app(Settings(database_url=SQLITE_URL, home=HOME, scheduler=False)),
    "postgresql": create_app(Settings(database_url=pg_url(PG_NAME), home=HOME, scheduler=False)),
}
sqlite_schema = schemathesis.openapi.from_asgi("/openapi.json", APPS["sqlite"])
pg_schema = schemathesis.openapi.from_asgi("/openapi.json", APPS["postgresql"])


def _prepare(app: Any, url: str) -> dict[str, str]:
    upgrade(url)
    db = Database(url)
    with db.write() as session:
        _, secret = create_token(session, f"fuzz-{uuid.uuid4().hex[:6]}")
    db.dispose()
    headers = {"Authorization": f"Bearer {secret}"}
    with TestClient(app) as client:  # a cluster to submit to, so valid submissions reach the database
        assert client.post("/v1/clusters", json={"name": "local", "devices": 2}, headers=headers).status_code == 201
    return headers


@pytest.fixture(scope="module")
def sqlite_token() -> Iterator[dict[str, str]]:
    HOME.mkdir(parents=True, exist_ok=True)
    yield _prepare(APPS["sqlite"], SQLITE_URL)
    shutil.rmtree(HOME, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_token() -> Iterator[dict[str, str]]:
    with throwaway_pg_database(name=PG_NAME) as url:
        yield _prepare(APPS["postgresql"], url)
        APPS["postgresql"].state.pipette.db.dispose()


def _check(case: Any, headers: dict[str, str]) -> None:
    case.call_and_validate(headers=headers, additional_checks=[errors_name_the_field],
                           excluded_checks=[positive_data_acceptance])


@pytest.mark.slow
@pytest.mark.timeout(900)
@sqlite_schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_sqlite(case: Any, sqlite_token: dict[str, str]) -> None:
    _check(case, sqlite_token)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pg_schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_postgresql(case: Any, pg_token: dict[str, str]) -> None:
    _check(case, pg_token)
