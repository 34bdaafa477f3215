"""The request size limits, enforced before a body is parsed.

A declared ``Content-Length`` above the limit is refused at once; a chunked body is counted as
it arrives and refused when it passes the limit, so no body larger than the limit is held in
memory whatever the client claims. A refused body of a few MiB is read and dropped before the
answer: a client still sending it got a connection reset instead of the 413 ("cannot reach the
service"). A header block above ``MAX_HEADER_BYTES`` answers 431.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import BODY_FIX, error_body

#: the largest header block taken (request line and headers), in bytes
MAX_HEADER_BYTES = 64 * 1024
#: a refused body up to this size is drained before the 413, so the client reads the answer
DRAIN_BYTES = 16 * 1024 * 1024


class HeaderLimitMiddleware:
    """431 for a header block above ``MAX_HEADER_BYTES`` that reached the app whole (one read);
    one that arrives in parts is refused by ``service.protocol`` before it is parsed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and header_bytes(scope) > MAX_HEADER_BYTES:
            body = too_large_headers_body()
            await send({"type": "http.response.start", "status": 431,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def too_large_headers_body() -> bytes:
    return json.dumps(error_body(f"the request's headers are larger than {MAX_HEADER_BYTES // 1024} KiB",
                                 "headers", "send smaller headers (a shorter cookie or token)")).encode()


def header_bytes(scope: Scope) -> int:
    """The size of the request line and headers as sent (``name: value\r\n`` each)."""
    line = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or ())


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                await self._refuse(send, 400, "Content-Length is not a number", "send a valid Content-Length")
                return
            if too_large:
                if int(declared) <= DRAIN_BYTES:
                    await _drain(receive)
                await self._refuse(send, 413, f"the request body is larger than {self.max_bytes} bytes",
                                   BODY_FIX)
                return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send, 413, f"the request body is larger than {self.max_bytes} bytes",
                                   BODY_FIX)

    async def _refuse(self, send: Send, status: int, message: str, fix: str) -> None:
        body = json.dumps(error_body(message, "body", fix)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    """Read the request's body to its end and drop it."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class _TooLarge(StarletteHTTPException):
    """Raised from ``receive``: FastAPI re-raises HTTP exceptions met while reading a body, so
    it reaches the one error handler as a 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")
