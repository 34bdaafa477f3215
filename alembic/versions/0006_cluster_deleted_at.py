"""deleted clusters: ``clusters.deleted_at``, names unique among live clusters only

A deleted cluster leaves the tenant's list (and its cap) but its row stays, so the records of
the jobs that ran on it stay readable; its name is free for a new cluster.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = sa.text("deleted_at IS NULL")


def upgrade() -> None:
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.drop_constraint("uq_clusters_tenant_name", type_="unique")
        batch_op.create_index("uq_clusters_tenant_live_name", ["tenant", "name"], unique=True,
                              sqlite_where=LIVE, postgresql_where=LIVE)


def downgrade() -> None:
    # The older schema has no deleted clusters: they go, with their jobs' records (deleted by
    # hand, child rows first, as SQLite's migrations run without foreign-key cascades).
    gone = "SELECT id FROM clusters WHERE deleted_at IS NOT NULL"
    jobs = f"SELECT id FROM jobs WHERE cluster_id IN ({gone})"
    for statement in (f"DELETE FROM events WHERE job_id IN ({jobs})", f"DELETE FROM trials WHERE job_id IN ({jobs})",
                      f"DELETE FROM jobs WHERE cluster_id IN ({gone})",
                      f"DELETE FROM profiles WHERE cluster_id IN ({gone})", "DELETE FROM clusters WHERE deleted_at "
                      "IS NOT NULL"):
        op.execute(statement)
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_index("uq_clusters_tenant_live_name")
        batch_op.create_unique_constraint("uq_clusters_tenant_name", ["tenant", "name"])
        batch_op.drop_column("deleted_at")
