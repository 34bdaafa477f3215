"""users' own training scripts: who may run them, and a job's script

``clusters.allow_scripts``: an operator enabled scripts for the cluster's tenant
(``pipette-admin cluster allow-scripts``); off for every existing cluster.
``jobs.script``: the job's ``ScriptSpec`` (argument list, knobs); ``jobs.script_files``: its
working directory, zipped (``workers.host.workdir.pack``), shipped to the ranks with every trial.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("allow_scripts", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("script", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"),
                                      nullable=True))
        batch_op.add_column(sa.Column("script_files", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("script_files")
        batch_op.drop_column("script")
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_column("allow_scripts")
