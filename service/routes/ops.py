"""Operations: ``/healthz`` (the process answers), ``/readyz`` (the database is reachable and
migrated, Ray is reachable), ``/metrics`` (Prometheus text, for the operator's token ``PIPETTE_METRICS_TOKEN`` only)."""

from __future__ import annotations

import hmac
import socket
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from pipette.errors import SpecError
from service.auth import bearer_secret
from service.deps import Caller, State
from service.errors import ForbiddenError
from service.migrations import current_revision, head_revision
from service.routes import AUTHED, errors, json_errors
from service.schemas import Health, Limits, Readiness
from service.settings import Settings, split_ray_address

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/v1/limits", response_model=Limits, responses=errors(*AUTHED))
async def limits(state: State, caller: Caller) -> Limits:
    """The request-body limit in force, so a client says it before sending a body over it
    (``pipette submit`` with a working folder)."""
    return Limits(max_body_bytes=state.settings.max_body_bytes)


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness, "description": "Not ready"}})
def readyz(state: State) -> JSONResponse:
    checks = {"database": _database(state), "ray": _ray(state.settings)}
    ready = all(c["ok"] for c in checks.values())
    body = Readiness(status="ready" if ready else "not ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
    **json_errors(401, 403, 413),
})
def metrics(request: Request, state: State) -> Response:
    """Every tenant's counts: for the operator (``PIPETTE_METRICS_TOKEN``), never a tenant's token."""
    secret = bearer_secret(request)
    expected = state.settings.metrics_token
    if expected is None or not hmac.compare_digest(secret.encode(), expected.encode()):
        raise ForbiddenError(
            "/metrics shows every tenant's counts and takes the operator's token, not a tenant's"
            + ("" if expected is not None else " (none is set: metrics are off)"),
            field="Authorization",
            fix="set PIPETTE_METRICS_TOKEN on the service and scrape with 'Authorization: Bearer <that token>'",
        )
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _database(state: State) -> dict[str, Any]:
    try:
        current = current_revision(state.db.engine)
    except SQLAlchemyError as e:
        return {"ok": False, "dialect": state.db.dialect, "error": str(e).splitlines()[0]}
    head = head_revision()
    if current != head:
        return {"ok": False, "dialect": state.db.dialect, "revision": current, "head": head,
                "fix": "run `pipette-admin migrate`"}
    return {"ok": True, "dialect": state.db.dialect, "revision": current}


def _ray(settings: Settings) -> dict[str, Any]:
    import ray

    if ray.is_initialized():
        alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call,unused-ignore]
        return {"ok": bool(alive), "connected": True, "nodes": len(alive)}
    if not settings.ray_address:
        return {"ok": True, "connected": False, "note": "the local Ray starts with the first job or profile"}
    return _reachable(settings.ray_address)


def _reachable(address: str) -> dict[str, Any]:
    try:
        host, port = split_ray_address(address)
    except SpecError:
        host = port = None
    if not host or not port:
        return {"ok": False, "connected": False, "address": address,
                "error": "cannot check an address without host:port", "fix": "set RAY_ADDRESS to host:port"}
    try:
        with socket.create_connection((host, port), timeout=2):
            return {"ok": True, "connected": False, "address": address}
    except OSError as e:
        return {"ok": False, "connected": False, "address": address, "error": str(e)}


