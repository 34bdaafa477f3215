"""Polled reads answered from memory until their rows change (PostgreSQL).

A dashboard polls ``GET /v1/jobs``, ``GET /v1/jobs/{id}`` and ``GET /v1/jobs/{id}/trials``
every second or so, and almost every poll finds the rows as they were. Reading them again cost
a database round trip in a worker thread per poll (the thread hop and psycopg were the largest
share of the service's samples: docs/results.md, "The service under load"). Here
each API process keeps the answers, and PostgreSQL says when to drop them: the ``0005`` migration's triggers send a
notification on every write of a job, a trial, a lease or a cluster, from any process, and
``ChangeFeed`` listens on a connection of its own.

Correctness rests on three rules:
- An answer is served only while the feed is listening (``live``); when its connection drops,
  every answer is dropped and the reads go to the database until it listens again.
- An answer is stored with the generations of the keys it depends on, taken *before* its
  query ran; a change that lands during the query bumps a generation, so the stored answer
  is already stale and the next read queries again.
- A write committed by this process drops every answer at once (``Database`` calls
  ``flush``), so a client that wrote reads its write next; another process's write shows
  when its notification arrives (milliseconds).
SQLite sends no notifications: there the feed never goes live and nothing is cached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import make_url

log = logging.getLogger("pipette.service")

CHANNEL = "pipette_changes"
#: the triggers of the ``0005`` migration: without them no notification comes, nothing is cached
TRIGGERS = ("pipette_notify_jobs", "pipette_notify_trials", "pipette_notify_leases", "pipette_notify_clusters")
#: the first reconnection wait, doubled up to ``MAX_RETRY_S`` while the database stays away
RETRY_S = 1.0
MAX_RETRY_S = 30.0
#: the feed notifies itself this often and goes dark when that does not come back in time: a
#: connection that LISTENs but hears nothing (a transaction-pooling PgBouncer hands LISTEN and
#: the writes' NOTIFY different server connections) must not leave answers cached forever
PING_S = 5.0
PING_TIMEOUT_S = 10.0


class FeedLost(Exception):
    """The feed's own notification did not come back: it cannot trust what it hears."""


@dataclass(frozen=True)
class Stamp:
    """The feed's state when a read began: its epoch and the generations of the read's keys."""

    epoch: int
    keys: tuple[str, ...]
    generations: tuple[int, ...]

    def only(self, n: int) -> Stamp:
        """The stamp of the first ``n`` keys (an answer that turned out not to depend on the rest)."""
        return Stamp(self.epoch, self.keys[:n], self.generations[:n])


class ChangeFeed:
    """Generations of the keys the polled reads depend on, bumped by the database's
    notifications: ``job:<id>``, ``tenant:<name>`` (any job of the tenant), ``trials:<job id>``,
    ``leases`` (any lease: a queued job's notice) and ``clusters:<tenant>``."""

    def __init__(self, url: str | None = None, *, max_keys: int = 100_000, ping_s: float = PING_S,
                 ping_timeout_s: float = PING_TIMEOUT_S) -> None:
        self.url = url
        self.max_keys = max_keys
        self.ping_s = ping_s
        self.ping_timeout_s = ping_timeout_s
        #: where the pings go (a test points it elsewhere to see the feed go dark)
        self.ping_channel = CHANNEL
        self.live = False
        self._pings = 0
        self._epoch = 0
        self._generations: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the reads use ------------------------------------------------------------------
    def stamp(self, keys: Sequence[str]) -> Stamp | None:
        """The state to store an answer under, taken before its query (None: not listening)."""
        with self._lock:
            if not self.live:
                return None
            return Stamp(self._epoch, tuple(keys), tuple(self._generations.get(k, 0) for k in keys))

    def current(self, stamp: Stamp) -> bool:
        """No change of the stamp's keys (and no flush) since it was taken, and still listening."""
        with self._lock:
            now = self._generations
            return (self.live and stamp.epoch == self._epoch
                    and all(now.get(k, 0) == g for k, g in zip(stamp.keys, stamp.generations, strict=True)))

    def flush(self) -> None:
        """Every answer is stale (a write of this process committed, or the feed lost track)."""
        with self._lock:
            self._epoch += 1

    # -- what the notifications do -----------------------------------------------------------
    def changed(self, payload: str) -> None:
        """Apply one notification (``job <id> <tenant>``, ``trials <job id>``, ``lease <resource>``,
        ``cluster <tenant>``); one it cannot read drops everything."""
        kind, _, rest = payload.partition(" ")
        if kind == "job":
            job_id, _, tenant = rest.partition(" ")
            keys = [f"job:{job_id}", f"tenant:{tenant}"]
        elif kind == "trials":
            keys = [f"trials:{rest}"]
        elif kind == "lease":
            keys = ["leases"]
        elif kind == "cluster":
            keys = [f"clusters:{rest}"]
        else:
            self.flush()
            return
        with self._lock:
            if len(self._generations) + len(keys) > self.max_keys:
                self._generations.clear()
                self._epoch += 1  # a forgotten generation must not read as unchanged
            for key in keys:
                self._generations[key] = self._generations.get(key, 0) + 1

    # -- the listening thread ----------------------------------------------------------------
    def start(self) -> None:
        if self.url is None or not self.url.startswith("postgresql") or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._listen, name="pipette-change-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._go_dark()

    def _go_live(self) -> None:
        with self._lock:
            self._epoch += 1  # whatever changed while nobody listened
            self.live = True

    def _go_dark(self) -> None:
        with self._lock:
            self.live = False
            self._epoch += 1

    def _listen(self) -> None:
        import psycopg

        assert self.url is not None
        conninfo = make_url(self.url).set(drivername="postgresql").render_as_string(hide_password=False)
        wait, logged = RETRY_S, False
        while not self._stop.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
                    missing = _missing_triggers(conn)
                    if missing:
                        if not logged:
                            log.warning("polled reads are not cached: the database lacks the change triggers %s "
                                        "(run `pipette-admin migrate`)", ", ".join(missing))
                            logged = True
                        self._stop.wait(MAX_RETRY_S)
                        continue
                    conn.execute(f"LISTEN {CHANNEL}")
                    first = self._ping(conn)  # live once it comes back: the channel works both ways
                    wait, logged = RETRY_S, False
                    self._hear(conn, first)
            except (psycopg.Error, FeedLost) as error:
                if not logged:  # the outage itself is logged by service.outage, once
                    log.info("the change feed lost its connection (%s): polled reads go to the database until "
                             "it is back", str(error).strip().splitlines()[0] if str(error).strip() else error)
                    logged = True
            finally:
                self._go_dark()
            self._stop.wait(wait)
            wait = min(2 * wait, MAX_RETRY_S)


    def _ping(self, conn: Any) -> str:
        self._pings += 1
        payload = f"ping {id(self)}-{self._pings}"
        conn.execute("SELECT pg_notify(%s, %s)", (self.ping_channel, payload))
        return payload

    def _hear(self, conn: Any, pending: str) -> None:
        """Apply notifications until told to stop; ping every ``ping_s`` and raise ``FeedLost``
        when a ping (``pending``: the one sent last) is not heard within ``ping_timeout_s``."""
        sent_at, heard_at = time.monotonic(), None
        while not self._stop.is_set():
            for note in conn.notifies(timeout=min(1.0, self.ping_s)):
                if note.payload == pending:
                    if not self.live:
                        self._go_live()
                    pending, heard_at = "", time.monotonic()
                elif not note.payload.startswith("ping "):  # other processes' pings: nothing changed
                    self.changed(note.payload)
            now = time.monotonic()
            if pending and now - sent_at > self.ping_timeout_s:
                raise FeedLost(f"its own notification did not come back within {self.ping_timeout_s:.0f} s")
            if not pending and heard_at is not None and now - heard_at >= self.ping_s:
                pending, sent_at = self._ping(conn), now


def _missing_triggers(conn: Any) -> list[str]:
    found = {row[0] for row in conn.execute("SELECT tgname FROM pg_trigger WHERE tgname = ANY(%s)", (list(TRIGGERS),))}
    return [t for t in TRIGGERS if t not in found]


class ReadCache:
    """Answers of the polled reads by request key, each kept with the feed's ``Stamp`` taken
    before its query; served while that stamp is current."""

    def __init__(self, feed: ChangeFeed, size: int = 8192) -> None:
        self.feed = feed
        self.size = size
        self._answers: dict[Hashable, tuple[Stamp, Any]] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            found = self._answers.get(key)
        if found is None or not self.feed.current(found[0]):
            self.misses += 1
            return None
        self.hits += 1
        return found[1]

    def put(self, key: Hashable, stamp: Stamp | None, answer: Any) -> None:
        """Keep ``answer`` under the stamp taken before its query (None: the feed was not
        listening then, so nothing is kept)."""
        if stamp is None:
            return
        with self._lock:
            if len(self._answers) >= self.size:
                self._answers.clear()
            self._answers[key] = (stamp, answer)
