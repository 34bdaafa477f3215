"""Alembic environment: the service's models' metadata, the URL the admin command sets.

Imports only ``service.models`` (tests/unit/test_layering.py checks it). Runs online only:
migrations are applied to a live database by ``pipette-admin migrate``, never at app start.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from sqlalchemy import create_engine, pool

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


def run_migrations_online() -> None:
    url = _url()
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            # SQLite cannot ALTER most things: later migrations copy the table (batch mode).
            render_as_batch=url.startswith("sqlite"),
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("alembic: offline (--sql) mode is not supported; run against a database")
run_migrations_online()
