"""Alembic environment: the service's models' metadata, the URL the admin command sets.

Imports only ``service.models`` (tests/unit/test_layering.py checks it). Runs online only:
migrations are applied to a live database by ``pipette-admin migrate``, never at app start.
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

from sqlalchemy import Engine, create_engine, event, pool

from alembic import context
from service.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("PIPETTE_DATABASE_URL", "")
    if not url:
        raise SystemExit("alembic: set PIPETTE_DATABASE_URL or run `pipette-admin migrate`")
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix):]
    return url


def _transactional_sqlite(engine: Engine) -> None:
    # pysqlite begins a transaction only before INSERT/UPDATE/DELETE, so each ALTER TABLE commits
    # on its own and a migration killed mid-way stays half-applied. Take over BEGIN (SQLAlchemy's
    # pysqlite recipe "Serializable isolation / Savepoints / Transactional DDL").
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def run_migrations_online() -> None:
    url = _url()
    sqlite = url.startswith("sqlite")
    engine = create_engine(url, poolclass=pool.NullPool)
    if sqlite:
        _transactional_sqlite(engine)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            # SQLite cannot ALTER most things: later migrations copy the table (batch mode).
            render_as_batch=sqlite,
            compare_type=True,
            # Each migration commits with its version (all or nothing), so a killed `migrate`
            # leaves the last whole one and the next run resumes there; SQLite's DDL is
            # transactional once pysqlite's own handling is off (above).
            transactional_ddl=True,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("alembic: offline (--sql) mode is not supported; run against a database")
run_migrations_online()
