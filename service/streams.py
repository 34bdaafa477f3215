"""Open event streams: a share per tenant and a cap in all, counted in this process.

Each open stream polls the database; 300 idle streams of one tenant took ~0.9 of a core and
another tenant's reads went from p50 19 ms to 558 ms (issue 32, item 12). A stream past
either cap answers 429 with Retry-After; an idle stream ends after ``stream_idle_s`` (an
``EventSource`` reconnects by itself with ``Last-Event-ID``, losing nothing).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.errors import TooManyRequestsError

TENANT_SETTING = "PIPETTE_MAX_STREAMS_PER_TENANT"
TOTAL_SETTING = "PIPETTE_MAX_STREAMS"
#: when a refused client should try again (seconds): streams end as jobs end or go idle
RETRY_AFTER_S = 10


class StreamSlots:
    """How many event streams each tenant has open, and all together."""

    def __init__(self, per_tenant: int, total: int) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str) -> Callable[[], None]:
        """A slot for one stream of ``tenant`` (429 when none is free); call the result once
        to give it back."""
        with self._lock:
            mine, everyone = self._open.get(tenant, 0), sum(self._open.values())
            if mine >= self.per_tenant:
                raise _full(f"tenant {tenant} has {mine} event streams open, the limit ({TENANT_SETTING}) is "
                            f"{self.per_tenant}", "close streams this tenant no longer reads")
            if everyone >= self.total:
                raise _full(f"the service has {everyone} event streams open, the limit ({TOTAL_SETTING}) is "
                            f"{self.total}", "retry later, or poll GET /v1/jobs/{id} instead")
            self._open[tenant] = mine + 1
        given = threading.Event()

        def give_back() -> None:
            if given.is_set():
                return
            given.set()
            with self._lock:
                left = self._open.get(tenant, 1) - 1
                if left > 0:
                    self._open[tenant] = left
                else:
                    self._open.pop(tenant, None)

        return give_back

    def open_count(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._open.get(tenant, 0) if tenant is not None else sum(self._open.values())


def _full(message: str, fix: str) -> TooManyRequestsError:
    error = TooManyRequestsError(message, field=None, fix=fix)
    error.retry_after_s = RETRY_AFTER_S
    return error


class SlotStreamingResponse(StreamingResponse):
    """A stream that gives its slot back however it ends, even when the client left before
    its first byte (the body's own ``finally`` never runs then)."""

    def __init__(self, content: AsyncIterator[str], give_back: Callable[[], None],
                 headers: Mapping[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._give_back = give_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._give_back()
