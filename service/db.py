"""The database: one engine per process, short sessions, and the writer discipline.

SQLite (the embedded default) allows one writer at a time: every writing session starts with
``BEGIN IMMEDIATE``, so it waits for the write lock up front (``busy_timeout``) instead of
failing on a read-to-write upgrade, and WAL lets readers run beside it. PostgreSQL sessions
are plain transactions; the scheduler adds row locks (``FOR UPDATE SKIP LOCKED``) itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session

SQLITE_BUSY_TIMEOUT_MS = 30_000


class Database:
    def __init__(self, url: str, *, pool_size: int = 20) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.engine = make_engine(url, pool_size=pool_size)
        # PostgreSQL reads run in autocommit: under READ COMMITTED each statement has its own
        # snapshot anyway, and it saves the BEGIN and ROLLBACK round trips of every request.
        self._reader = self.engine if self.is_sqlite else self.engine.execution_options(isolation_level="AUTOCOMMIT")
        #: called after each ``write`` commits (``service.changes``: this process's cached reads are dropped)
        self.after_commit: list[Callable[[], None]] = []

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads (nothing is committed)."""
        with Session(self._reader, expire_on_commit=False) as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on any error."""
        with self.engine.connect() as conn:
            if self.is_sqlite:
                conn.execution_options(sqlite_immediate=True)
            with Session(bind=conn, expire_on_commit=False) as session:
                with session.begin():
                    yield session
        for hook in self.after_commit:
            hook()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


def make_engine(url: str, *, pool_size: int = 20) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
                               json_serializer=dumps)
        _sqlite_discipline(engine)
        return engine
    # No pre-ping (a round trip per checkout); connections are recycled instead, and a dead
    # one fails its request, which the client retries.
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800, pool_timeout=30,
                         json_serializer=dumps)


def dumps(value: Any) -> str:
    """JSON for the JSON columns: a float JSON cannot hold (inf, nan: an estimate with nothing
    to divide by) is stored as null, as PostgreSQL refuses it and a reader could not parse it."""
    return json.dumps(_finite(value), separators=(",", ":"))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _sqlite_discipline(engine: Engine) -> None:
    # pysqlite's own transaction handling begins lazily and never IMMEDIATE; take it over
    # (the SQLAlchemy documentation's recipe for SQLite transactions).
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
