"""change notifications for the polled reads (PostgreSQL only)

Every insert, update and delete of a job, a trial, a lease or a cluster sends a notification on
the channel ``pipette_changes`` (``pg_notify``, delivered at commit, in commit order), whatever
wrote it: the ORM, a Core ``update``, another process or ``psql``. Each API process listens
(``service.changes.ChangeFeed``) and answers the polled reads from memory until a
notification says their rows changed. SQLite has no notifications: its reads are not cached.

Payloads: ``job <id> <tenant>``, ``trials <job id>``, ``lease <resource>``, ``cluster <tenant>``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: the tables whose rows the polled reads are made of, and each one's trigger
TABLES = ("jobs", "trials", "leases", "clusters")
FUNCTION = """
CREATE OR REPLACE FUNCTION pipette_notify_change() RETURNS trigger AS $$
DECLARE
    r record;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    IF TG_TABLE_NAME = 'jobs' THEN
        PERFORM pg_notify('pipette_changes', 'job ' || r.id || ' ' || r.tenant);
    ELSIF TG_TABLE_NAME = 'trials' THEN
        PERFORM pg_notify('pipette_changes', 'trials ' || r.job_id);
    ELSIF TG_TABLE_NAME = 'leases' THEN
        PERFORM pg_notify('pipette_changes', 'lease ' || r.resource);
    ELSE
        PERFORM pg_notify('pipette_changes', 'cluster ' || r.tenant);
    END IF;
    RETURN NULL;
END
$$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(FUNCTION)
    for table in TABLES:
        op.execute(f"CREATE TRIGGER pipette_notify_{table} AFTER INSERT OR UPDATE OR DELETE ON {table} "
                   f"FOR EACH ROW EXECUTE FUNCTION pipette_notify_change()")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS pipette_notify_{table} ON {table}")
    op.execute("DROP FUNCTION IF EXISTS pipette_notify_change()")
