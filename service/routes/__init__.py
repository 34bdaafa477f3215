"""The API's routes, one module per resource."""

from __future__ import annotations

from typing import Any

from service.schemas import ErrorOut

_DESCRIPTIONS = {
    400: "Malformed request",
    401: "Missing or invalid Bearer token",
    403: "A valid token that may not do this (a tenant's token on the operator's /metrics)",
    404: "Not found (or another tenant's)",
    409: "Not possible in the current state",
    413: "Request body too large",
    422: "Invalid input; `field` names it and `fix` says what would be right",
    429: "Too much queued work for the tenant (`PIPETTE_MAX_QUEUED_PER_TENANT`); retry after `Retry-After` "
         "seconds, or cancel queued work",
    503: "Not ready",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route can give (all ``ErrorOut``)."""
    return {code: {"model": ErrorOut, "description": _DESCRIPTIONS[code]} for code in codes}


def json_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The same for a route whose success is not JSON (FastAPI would document its errors in
    the success's media type): the JSON content is spelled out."""
    ref = {"$ref": "#/components/schemas/ErrorOut"}
    return {code: {"description": _DESCRIPTIONS[code], "content": {"application/json": {"schema": ref}}}
            for code in codes}


#: What every authenticated route can answer.
AUTHED = (401, 413, 422)
