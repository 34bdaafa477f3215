"""The HTTP connection under the app: a request whose header block is too large answers 431
with the one error body, and the client can read it.

uvicorn's h11 protocol answers a header block above its limit with a plain-text 400 and
closes at once; a client still sending its headers (a 1 MB cookie) then gets a connection
reset instead of any answer (issue 32, item 19). This protocol answers 431, half-closes, and
reads and drops what is still coming for a moment (a lingering close, as nginx does), so the
answer is read. Headers that arrive whole are counted by ``service.limits.HeaderLimitMiddleware``.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.limits import MAX_HEADER_BYTES, too_large_headers_body

#: how long a refused connection reads and drops what the client still sends
LINGER_S = 2.0


class HeaderLimitH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a 431 for a header block above ``MAX_HEADER_BYTES``
    (the server's ``h11_max_incomplete_event_size`` must be that limit)."""

    _refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the lingering close: drop the rest of what was refused
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) <= MAX_HEADER_BYTES:
            super().send_400_response(msg)
            return
        body = too_large_headers_body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
