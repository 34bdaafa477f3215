"""The database going away while the service runs: one log line when it goes, one when it is
back, and the answer a client can act on (503 with Retry-After), instead of a 500 with two
tracebacks per request and a ``claim failed`` line every second (issue 32, item 17)."""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

log = logging.getLogger("pipette.service")

#: what a client is told to wait before retrying (seconds)
RETRY_AFTER_S = 5
#: while the database stays down, it is logged again this often (seconds)
RELOG_S = 300.0


def is_unavailable(error: BaseException) -> bool:
    """The database cannot be reached (refused, gone, timed out), as opposed to a bad query."""
    if isinstance(error, OperationalError | InterfaceError | PoolTimeoutError):
        return True
    return isinstance(error, DBAPIError) and bool(error.connection_invalidated)


class Outage:
    """This process's view of its database: down since when, and when that was last logged."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._logged_at = 0.0
        self._lock = threading.Lock()

    def failed(self, error: SQLAlchemyError, who: str) -> None:
        """Record a failure to reach the database; logged when it starts and every ``RELOG_S``."""
        now = time.monotonic()
        with self._lock:
            first = self._since is None
            if first:
                self._since = now
            elif now - self._logged_at < RELOG_S:
                return
            self._logged_at = now
            since = self._since or now
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0][:300]
        if first:
            log.warning("the database is unreachable (%s, seen by %s): answering 503 and retrying", reason, who)
        else:
            log.warning("the database is still unreachable after %.0f s (%s)", now - since, reason)

    def recovered(self) -> None:
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.info("the database is reachable again after %.0f s", time.monotonic() - since)

    @property
    def down(self) -> bool:
        return self._since is not None


#: one per process: the API's requests and the scheduler share it
OUTAGE = Outage()
