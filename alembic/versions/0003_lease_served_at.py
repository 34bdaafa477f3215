"""when a scheduler last looked for work on a lease's devices

``leases.served_at``: set (at most every few seconds) by every scheduler that polls the lease,
held or not, so the API can tell a queued job that no scheduler serves its cluster's devices
instead of leaving it queued without a word.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("served_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("served_at")
