"""A tenant's rate of expensive requests (``POST /v1/plan``: up to a second of CPU each),
counted in this process: a token bucket per tenant, 429 with Retry-After when it is empty.

Without it one tenant's plans took every thread of the API process (issue 32, item 20).
"""

from __future__ import annotations

import math
import threading
import time

from service.errors import TooManyRequestsError


class TenantRate:
    """``per_minute`` requests a minute per tenant, up to ``per_minute`` in a burst."""

    def __init__(self, per_minute: int, setting: str, what: str) -> None:
        self.per_minute = per_minute
        self.setting = setting
        self.what = what
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, tenant: str) -> None:
        """Count one request of ``tenant``; TooManyRequestsError when it is over its rate."""
        now = time.monotonic()
        rate = self.per_minute / 60.0
        with self._lock:
            tokens, at = self._buckets.get(tenant, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - at) * rate)
            if tokens < 1.0:
                self._buckets[tenant] = (tokens, now)
                error = TooManyRequestsError(
                    f"tenant {tenant} sent more than {self.per_minute} {self.what} a minute "
                    f"(the limit, {self.setting})",
                    field=None, fix="wait the Retry-After seconds; reuse a plan's answer instead of asking again")
                error.retry_after_s = max(1, math.ceil((1.0 - tokens) / rate))
                raise error
            self._buckets[tenant] = (tokens - 1.0, now)
