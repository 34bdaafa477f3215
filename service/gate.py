"""The token before the body (issue 43, item 2).

FastAPI reads and parses a request's JSON body before it solves the route's dependencies, so
the Bearer token was checked after the parse: an anonymous 990 KB body of 33,000 small objects
to ``/v1/plan`` cost ~115 ms of CPU before its 401. Here a request with a body under ``/v1``
is authenticated first (a body of an anonymous or unknown caller is drained unparsed and
answered 401), and an authenticated body's shape is bounded before it is parsed: at most
``MAX_CONTAINERS`` objects and arrays, counted on the raw bytes (an upper bound: braces inside
strings count too).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipette.errors import PipetteError
from service.auth import PRINCIPAL_KEY, bearer_secret_of
from service.deps import authenticate
from service.errors import RequestError, error_body

#: objects and arrays a JSON body may hold; the largest real ones (a cluster file of a few
#: hundred nodes, a job with a config.json) hold a few thousand
MAX_CONTAINERS = 20_000
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class AuthFirstMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        try:
            principal = await authenticate(scope["app"].state.pipette, bearer_secret_of(scope))
        except PipetteError as e:
            await _drain(receive)
            await _answer(send, e)
            return
        scope[PRINCIPAL_KEY] = principal
        body, rest = await _read_body(receive)
        containers = body.count(b"{") + body.count(b"[")
        if containers > MAX_CONTAINERS:
            await _answer(send, RequestError(
                f"the body holds {containers:,} objects and arrays, more than the {MAX_CONTAINERS:,} taken",
                field="body", fix="send the request's fields as documented in /docs (no more than a few thousand "
                "objects)"))
            return
        await self.app(scope, _replay(body, rest, receive), send)


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The whole body (``BodyLimitMiddleware``, outside this one, bounds its size), and a
    disconnect met while reading it, if any."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), message
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), None


def _replay(body: bytes, rest: Message | None, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return rest if rest is not None else await receive()

    return replayed


async def _drain(receive: Receive) -> None:
    """Read the body to its end and drop it (so the client reads the answer, not a reset)."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _answer(send: Send, error: PipetteError) -> None:
    body = json.dumps(error_body(error.message, error.field, error.fix)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.http_status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
