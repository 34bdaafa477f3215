"""The request body size limit, enforced before a body is parsed.

A declared ``Content-Length`` above the limit is refused at once; a chunked body is counted as
it arrives and refused when it passes the limit, so no body larger than the limit is held in
memory whatever the client claims.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_body


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
                await self._refuse(send, 413, f"the request body is larger than {self.max_bytes} bytes",
                                   "send a smaller body")
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
                                   "send a smaller body")

    async def _refuse(self, send: Send, status: int, message: str, fix: str) -> None:
        body = json.dumps(error_body(message, "body", fix)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(StarletteHTTPException):
    """Raised from ``receive``: FastAPI re-raises HTTP exceptions met while reading a body, so
    it reaches the one error handler as a 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")
