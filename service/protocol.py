"""The HTTP connection under the app: what a connection may cost the service before the app
sees a request.

- A header block above ``MAX_HEADER_BYTES`` answers 431 with the one error body, and the client
  can read it: uvicorn's h11 protocol answers with a plain-text 400 and closes at once, so a
  client still sending its headers (a 1 MB cookie) got a connection reset (issue 32, item 19).
  This protocol answers 431, half-closes, and reads and drops what is still coming for a moment
  (a lingering close, as nginx does). Headers that arrive whole are counted by
  ``service.limits.HeaderLimitMiddleware``.
- Slow clients (issue 43, item 1): uvicorn closes an idle keep-alive connection, but not one
  that sends a request line and then a header every few seconds: 10,000 of them exhausted the
  process's file descriptors. Here a request's headers must arrive within ``header_timeout_s``
  (408, as nginx's ``client_header_timeout``) and its body within ``body_timeout_s`` plus its
  size at ``MIN_BODY_RATE`` bytes/s (closed, as ``client_body_timeout``), and connections are
  capped in all and per client address (503 with ``Retry-After``), below the file-descriptor
  limit, so the listening socket keeps accepting and the service keeps answering.
- A loop that still runs out of descriptors logs it once a minute with a count, not once per
  failed ``accept`` with a traceback (``install_accept_log``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.errors import error_body
from service.limits import MAX_HEADER_BYTES, too_large_headers_body

if TYPE_CHECKING:
    from service.settings import Settings

log = logging.getLogger("pipette.service")

#: how long a refused connection reads and drops what the client still sends
LINGER_S = 2.0
#: the slowest body taken, in bytes/s, on top of ``body_timeout_s`` (64 KiB/s: a 1 MiB body
#: has 16 s more, a 64 MiB one 17 min)
MIN_BODY_RATE = 64 * 1024
#: descriptors kept free of connections for the database, Ray, logs and trial files
FD_RESERVE = 256
#: the listening socket's backlog, which is also how many connections asyncio accepts in one
#: go before any of them is checked against the caps: well inside the reserve, so a burst of
#: connections cannot run the process out of descriptors between two checks
ACCEPT_BACKLOG = FD_RESERVE // 2


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may take; 0 for a cap means none."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 0
    max_connections_per_client: int = 0

    def total_cap(self) -> int:
        """The connections taken at once: the setting, and never more than the file-descriptor
        limit leaves (so ``accept`` itself never runs out)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        by_fds = max(16, soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else 1 << 30
        return min(self.max_connections, by_fds) if self.max_connections else by_fds


def raise_fd_limit() -> int:
    """Raise this process's soft file-descriptor limit to its hard limit (what servers such as
    nginx's ``worker_rlimit_nofile`` do); the soft limit it ends at."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            return soft
    return soft


class _Once:
    """Log a kind of event at most once a ``period_s``, with how many were not logged."""

    def __init__(self, period_s: float = 60.0) -> None:
        self.period_s = period_s
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.period_s) < self.period_s:
            self._quiet[kind] += 1
            return
        self._last[kind] = now
        more = self._quiet.pop(kind, 0)
        log.warning("%s%s", message, f" ({more} more since the last such line)" if more else "")


_once = _Once()


def _raw_answer(status: int, reason: str, message: str, field: str, fix: str,
                extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 answer with the one error body, written outside h11's state machine
    (no request was parsed, so h11 has nothing to answer)."""
    body = json.dumps(error_body(message, field, fix)).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class HeaderLimitH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a 431 for a header block above ``MAX_HEADER_BYTES``
    (the server's ``h11_max_incomplete_event_size`` must be that limit), deadlines for a
    request's headers and body, and caps on connections (``guarded_protocol`` sets them)."""

    #: set by ``guarded_protocol``; a process uvicorn spawned for ``--workers N`` reads them from
    #: the environment, as its app does
    limits: ConnectionLimits | None = None
    _refused = False
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _counted: str | None = None

    @property
    def _limits(self) -> ConnectionLimits:
        if HeaderLimitH11Protocol.limits is None:
            HeaderLimitH11Protocol.limits = limits_from_env()
        return HeaderLimitH11Protocol.limits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._over_cap():
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._counted is not None:
            per_client = _per_client(self.server_state)
            per_client[self._counted] -= 1
            if per_client[self._counted] <= 0:
                del per_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the lingering close: drop the rest of what was refused
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before and self.cycle is not None:
            # a request's headers arrived whole: its body, if any, has its own deadline
            self._cancel_timers()
            if self.cycle.more_body:
                self._arm_body_timer()
        elif self._header_timer is None and (self.cycle is None or self.cycle.response_complete) \
                and not self.transport.is_closing():
            self._arm_header_timer()  # the next request on a kept-alive connection began
        if self._body_timer is not None and self.cycle is not None and not self.cycle.more_body:
            self._body_timer.cancel()
            self._body_timer = None

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
        self._refuse_and_linger()

    # the caps

    def _over_cap(self) -> bool:
        """Refuse this connection (503) when the service holds as many as it takes, in all or
        from this client's address."""
        total_cap = self._limits.total_cap()
        if len(self.connections) > total_cap:
            _once("connections", f"refusing connections: {len(self.connections) - 1} open, the cap is {total_cap} "
                  "(PIPETTE_MAX_CONNECTIONS, and the file-descriptor limit less a reserve)")
            self._refuse_now(503, "Service Unavailable", "the service holds as many connections as it takes",
                             "retry in a few seconds", linger=False)
            return True
        host = self.client[0] if self.client else "?"
        per_client = _per_client(self.server_state)
        cap = self._limits.max_connections_per_client
        if cap and per_client[host] >= cap:
            _once(f"client {host}", f"refusing connections from {host}: it holds {per_client[host]}, the cap is "
                  f"{cap} (PIPETTE_MAX_CONNECTIONS_PER_CLIENT; 0 behind a reverse proxy that caps them)")
            self._refuse_now(503, "Service Unavailable", f"this address holds {cap} connections, the most taken",
                             "close some of them (or reuse one connection) and retry", linger=False)
            return True
        per_client[host] += 1
        self._counted = host
        return False

    def _refuse_now(self, status: int, reason: str, message: str, fix: str, linger: bool = True) -> None:
        self.transport.write(_raw_answer(status, reason, message, "connection", fix, (("retry-after", "5"),)))
        if linger:
            self._refuse_and_linger()
            return
        # over a cap: the descriptor goes back at once (lingering ones would pile up past the
        # cap in a flood); the answer is flushed before the close
        self._refused = True
        self._cancel_timers()
        self.transport.close()

    def _refuse_and_linger(self) -> None:
        self._refused = True
        self._cancel_timers()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    # the deadlines

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self._limits.header_timeout_s, self._headers_too_slow)

    def _arm_body_timer(self) -> None:
        declared = dict(self.headers or ()).get(b"content-length", b"")
        size = int(declared) if declared.isdigit() else 1024 * 1024
        deadline = self._limits.body_timeout_s + size / MIN_BODY_RATE
        self._body_timer = self.loop.call_later(deadline, self._body_too_slow)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        _once("header timeout", "closed connections whose request headers took over "
              f"{self._limits.header_timeout_s:g} s (PIPETTE_HEADER_TIMEOUT_S)")
        self._refuse_now(408, "Request Timeout",
                         f"the request's headers did not arrive within {self._limits.header_timeout_s:g} s",
                         "send the whole request at once")

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is None or not self.cycle.more_body:
            return
        _once("body timeout", "closed connections whose request body came slower than "
              f"{self._limits.body_timeout_s:g} s plus {MIN_BODY_RATE // 1024} KiB/s (PIPETTE_BODY_TIMEOUT_S)")
        self.transport.close()  # the app reading the body gets a disconnect


def _per_client(server_state: Any) -> Counter[str]:
    """Open connections by client address, kept on uvicorn's server state (one per process)."""
    counts: Counter[str] | None = getattr(server_state, "pipette_per_client", None)
    if counts is None:
        counts = Counter()
        server_state.pipette_per_client = counts
    return counts


def guarded_protocol(limits: ConnectionLimits) -> type[HeaderLimitH11Protocol]:
    """The h11 protocol with these limits (uvicorn builds one protocol object per connection;
    the class itself is what it pickles for ``--workers N``)."""
    HeaderLimitH11Protocol.limits = limits
    return HeaderLimitH11Protocol


def limits_from_env() -> ConnectionLimits:
    from service.settings import Settings

    return connection_limits(Settings.from_env())


def connection_limits(settings: Settings) -> ConnectionLimits:
    return ConnectionLimits(header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                            max_connections=settings.max_connections,
                            max_connections_per_client=settings.max_connections_per_client)


def install_accept_log(loop: asyncio.AbstractEventLoop) -> None:
    """A loop that runs out of descriptors retries ``accept`` every second and logs each failure
    with a traceback (593,919 of them in 3 minutes): one line a minute, with a count, instead."""
    default = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" in str(context.get("message", "")):
            _once("accept", f"cannot accept connections: {context.get('exception')} (raise the file-descriptor "
                  "limit, or lower PIPETTE_MAX_CONNECTIONS)")
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
