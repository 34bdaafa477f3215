"""The service's errors (all ``PipetteError``s) and the one place they become HTTP answers.

Every error answer has the same body, ``{"error": {"message", "field", "fix"}}``, whether it
came from the core (a bad model, nothing fits), from request validation, from auth or from a
route that does not exist; an unexpected exception answers 500 with no traceback (it is
logged).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pipette.errors import PipetteError
from service.outage import OUTAGE, RETRY_AFTER_S, is_unavailable
from service.settings import MAX_BODY_BYTES_CEILING

#: what a 413 tells the client to do: the limit is the operator's setting (``service.settings``)
BODY_FIX = ("send a smaller body (a script's working folder: leave data and checkpoints out of it), or ask the "
            f"service's operator to raise PIPETTE_MAX_BODY_BYTES (at most {MAX_BODY_BYTES_CEILING // 1024**2} MiB)")

log = logging.getLogger("pipette.service")


class NotFoundError(PipetteError):
    """The thing does not exist, or belongs to another tenant (which must look the same)."""

    http_status = 404


class ConflictError(PipetteError):
    """The request is valid but not in the thing's current state (cancel a finished job)."""

    http_status = 409


class AuthError(PipetteError):
    http_status = 401


class ForbiddenError(PipetteError):
    """Authenticated, but not allowed here (a tenant's token on the operator's /metrics)."""

    http_status = 403


class TooLargeError(PipetteError):
    http_status = 413


class RequestError(PipetteError):
    """A malformed request (bad JSON, a wrong type, a missing field)."""

    http_status = 422


class TooManyRequestsError(PipetteError):
    """Valid, but over a limit that passes with time (a tenant's queue is full): retry later."""

    http_status = 429
    #: the ``Retry-After`` header of the answer (seconds)
    retry_after_s: int = 60


class UnavailableError(PipetteError):
    http_status = 503
    #: the ``Retry-After`` header of the answer (seconds)
    retry_after_s: int = RETRY_AFTER_S


def database_unavailable() -> UnavailableError:
    """The answer while the database cannot be reached (``service.outage``)."""
    return UnavailableError("the service's database is not reachable right now", field=None,
                            fix=f"retry in {RETRY_AFTER_S} s (Retry-After); if it lasts, the operator checks the "
                                "database server (PIPETTE_DATABASE_URL)")


def stored_error(e: BaseException, fix: str = "see the service log", prefix: str = "") -> dict[str, Any]:
    """How a job or profile keeps the error that ended it: a PipetteError as it is (message,
    field, fix); anything else as its type and text, with ``fix``."""
    if isinstance(e, PipetteError):
        return {"message": e.message, "field": e.field, "fix": e.fix}
    return {"message": f"{prefix}{type(e).__name__}: {e}", "field": None, "fix": fix}


def error_body(message: str, field: str | None = None, fix: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "field": field, "fix": fix}}


def pipette_error_response(error: PipetteError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.http_status == 401 else None
    if isinstance(error, TooManyRequestsError | UnavailableError):
        headers = {"Retry-After": str(error.retry_after_s)}
    return JSONResponse(error_body(error.message, error.field, error.fix), status_code=error.http_status,
                        headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def on_pipette_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, PipetteError)
        return pipette_error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media and media != "application/json" and not media.endswith("+json") \
                and any(tuple(e.get("loc", ()))[:1] == ("body",) for e in exc.errors()):
            # FastAPI does not read a body of another media type as JSON (it sees no object)
            return pipette_error_response(RequestError(
                f"the body is sent as {media}; this endpoint reads JSON", field="body",
                fix="send the body with Content-Type: application/json"))
        return pipette_error_response(validation_error(exc.errors()))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            # FastAPI's decoder gives up on a body nested ~1000 levels deep: say that, not "not UTF-8"
            return pipette_error_response(RequestError(
                "the body is nested too deeply to read (arrays or objects about 1000 levels deep)",
                field="body", fix="send the config.json as Hugging Face writes it (a flat object of numbers)"))
        if exc.status_code == 400:
            # FastAPI's answer to a body it cannot decode (not UTF-8): the same 422 as bad JSON.
            return pipette_error_response(RequestError(
                f"the body cannot be read as JSON ({exc.detail})", field="body", fix="send a valid UTF-8 JSON body"))
        fixes = {404: "check the URL (the API is under /v1; see /docs)", 405: "check the HTTP method (see /docs)",
                 413: BODY_FIX}
        field = "body" if exc.status_code in (400, 413) else None
        response = JSONResponse(error_body(str(exc.detail), field, fixes.get(exc.status_code)),
                                status_code=exc.status_code)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(_allowed_methods(request))
        return response

    async def on_database_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, SQLAlchemyError)
        if not is_unavailable(exc):
            return await on_unexpected(request, exc)
        OUTAGE.failed(exc, "the API")  # one line per outage, not a traceback per request
        return pipette_error_response(database_unavailable())

    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error", exc_info=exc)
        return JSONResponse(error_body("internal error (logged by the service)", None,
                                       "retry; if it persists, report it with the service log"), status_code=500)

    app.add_exception_handler(PipetteError, on_pipette_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(SQLAlchemyError, on_database_error)
    app.add_exception_handler(Exception, on_unexpected)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def validation_error(errors: Any) -> RequestError:
    """The first validation error, with its location as a dotted field (``body.training.seq_len``
    becomes ``training.seq_len``; ``query.limit`` stays ``limit``)."""
    items = list(errors)
    if not items:
        return RequestError("invalid request", field=None, fix="see /docs for the request schema")
    first = items[0]
    raw = [str(p) for p in first.get("loc", ())]
    loc = [p for p in raw if p != "body"]
    if loc and loc[0] in ("query", "path", "header", "cookie"):
        loc = loc[1:]
    # Pydantic names the union member it tried (``str``, ``function-after[...]``); drop those.
    loc = [p for p in loc if not _is_type_tag(p)]
    field = ".".join(loc) or ("body" if raw[:1] == ["body"] else None)
    message = str(first.get("msg", "invalid value"))
    kind = str(first.get("type", ""))
    fix = _fix(kind, first.get("ctx") or {})
    if kind == "json_invalid":
        field = "body"  # not the character offset pydantic puts in the location
    elif kind == "missing" and field == "body":
        message, fix = "the request has no body", "send a JSON object (see /docs for its fields)"
    if field == "model" and isinstance(first.get("input"), str):
        # not the ~30 presets in one line: the closest few, and where they all are
        from pipette.model import preset_fix

        message, fix = f"unknown model preset {first['input']!r}", preset_fix(first["input"], "or a config.json object")
        items = items[:1]  # the other error is the union's dict branch refusing a string: noise
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return RequestError(message + more, field=field, fix=fix)


def _fix(kind: str, ctx: dict[str, Any]) -> str:
    """What would be right, from pydantic's error type and its context."""
    fixed = {
        "missing": "give it",
        "json_invalid": "send a valid JSON body",
        "extra_forbidden": "drop it (see /docs for the fields)",
        "model_attributes_type": "send a JSON object",
        "dict_type": "send a JSON object",
        "list_type": "send a JSON array",
        "int_parsing": "give a whole number",
        "int_type": "give a whole number",
        "int_from_float": "give a whole number",
        "float_parsing": "give a number",
        "float_type": "give a number",
        "bool_parsing": "give true or false",
        "bool_type": "give true or false",
        "string_type": "give a string",
        "finite_number": "give a finite number",
    }
    if kind in fixed:
        return fixed[kind]
    bounds = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "above"),
              "less_than_equal": ("le", "at most"), "less_than": ("lt", "below")}
    if kind in bounds:
        key, words = bounds[kind]
        return f"give a value {words} {ctx.get(key)}"
    if kind == "string_pattern_mismatch":
        return f"match the pattern {ctx.get('pattern')}"
    if kind in ("string_too_long", "too_long"):
        return f"give at most {ctx.get('max_length')} {'characters' if kind.startswith('string') else 'items'}"
    if kind in ("string_too_short", "too_short"):
        return f"give at least {ctx.get('min_length')} {'characters' if kind.startswith('string') else 'items'}"
    if kind in ("literal_error", "enum"):
        return f"use one of {ctx.get('expected')}"
    return "see /docs for the request schema"


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "dict[str,any]", "list[any]"} or "[" in part
