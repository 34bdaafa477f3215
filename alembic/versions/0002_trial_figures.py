"""trial figures as columns

A trial's list entry needs its last attempt's figures (analytic step time, predicted peak,
tokens/s, measured peak, error, attempt); reading them from the ``record`` JSON made every list
parse every record. They become columns, filled here from the records already stored.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("analytic_step_time", "predicted_peak_bytes", "tokens_per_s", "peak_memory_bytes", "error", "attempt")


def upgrade() -> None:
    with op.batch_alter_table("trials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("analytic_step_time", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("predicted_peak_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("tokens_per_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="1"))
    trials = sa.table("trials", sa.column("id", sa.BigInteger()), sa.column("record", sa.JSON()),
                      *(sa.column(c) for c in COLUMNS))
    conn = op.get_bind()
    rows = conn.execute(sa.select(trials.c.id, trials.c.record).where(trials.c.record.is_not(None))).all()
    for trial_id, record in rows:
        figures = _figures(json.loads(record) if isinstance(record, str) else record)
        conn.execute(sa.update(trials).where(trials.c.id == trial_id).values(**figures))


def downgrade() -> None:
    with op.batch_alter_table("trials", schema=None) as batch_op:
        for column in reversed(COLUMNS):
            batch_op.drop_column(column)


def _figures(record: dict[str, Any] | None) -> dict[str, Any]:
    record = record or {}
    measurement = record.get("measurement") or {}
    peaks = [int(x) for x in measurement.get("peak_memory") or []]
    peak = record.get("predicted_peak_bytes")
    return {
        "analytic_step_time": record.get("analytic_step_time"),
        "predicted_peak_bytes": None if peak is None else int(peak),
        "tokens_per_s": measurement.get("tokens_per_s"),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "error": str(measurement.get("error") or "") or None,
        "attempt": int(record.get("attempt", 1)),
    }
