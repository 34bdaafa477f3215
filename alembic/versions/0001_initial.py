"""initial schema: tokens, clusters, profiles, jobs, trials, events, leases

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-21

Written out, not imported from service.models, so that later changes to the models cannot
change what this revision creates. Times are stored as UTC (service.models.UTCDateTime).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# JSONB on PostgreSQL (indexable, compact), JSON text elsewhere; 64-bit ids that SQLite
# autoincrements (it only does so for INTEGER PRIMARY KEY).
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table('clusters',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('tenant', sa.String(length=100), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('address', sa.String(length=500), nullable=False),
    sa.Column('resource', sa.String(length=600), nullable=False),
    sa.Column('nodes', JSON, nullable=False),
    sa.Column('devices_per_node', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_clusters')),
    sa.UniqueConstraint('tenant', 'name', name='uq_clusters_tenant_name')
    )
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_clusters_resource'), ['resource'], unique=False)
        batch_op.create_index(batch_op.f('ix_clusters_tenant'), ['tenant'], unique=False)

    op.create_table('tokens',
    sa.Column('id', BIG_ID, autoincrement=True, nullable=False),
    sa.Column('tenant', sa.String(length=100), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_tokens_token_hash'))
    )
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tokens_tenant'), ['tenant'], unique=False)

    op.create_table('profiles',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('cluster_id', sa.String(length=36), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('profile', JSON, nullable=True),
    sa.Column('error', JSON, nullable=True),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE',
                            name=op.f('fk_profiles_cluster_id_clusters')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_profiles'))
    )
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.create_index('ix_profiles_cluster_created', ['cluster_id', 'created_at'], unique=False)

    op.create_table('jobs',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('tenant', sa.String(length=100), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('cluster_id', sa.String(length=36), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('model', JSON, nullable=False),
    sa.Column('training', JSON, nullable=False),
    sa.Column('options', JSON, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=200), nullable=True),
    sa.Column('profile_id', sa.String(length=36), nullable=True),
    sa.Column('progress', JSON, nullable=False),
    sa.Column('tuning_s', sa.Float(), nullable=False),
    sa.Column('plan', JSON, nullable=True),
    sa.Column('best', JSON, nullable=True),
    sa.Column('result', JSON, nullable=True),
    sa.Column('stop_reason', sa.String(length=200), nullable=True),
    sa.Column('error', JSON, nullable=True),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE',
                            name=op.f('fk_jobs_cluster_id_clusters')),
    sa.ForeignKeyConstraint(['profile_id'], ['profiles.id'], ondelete='SET NULL',
                            name=op.f('fk_jobs_profile_id_profiles')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_cluster_id'), ['cluster_id'], unique=False)
        batch_op.create_index('ix_jobs_state_created', ['state', 'created_at'], unique=False)
        batch_op.create_index('ix_jobs_tenant_created', ['tenant', 'created_at', 'id'], unique=False)

    op.create_table('events',
    sa.Column('id', BIG_ID, autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('kind', sa.String(length=40), nullable=False),
    sa.Column('trial', sa.Integer(), nullable=True),
    sa.Column('data', JSON, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE',
                            name=op.f('fk_events_job_id_jobs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_job_id_id', ['job_id', 'id'], unique=False)

    op.create_table('leases',
    sa.Column('resource', sa.String(length=600), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=True),
    sa.Column('job_id', sa.String(length=36), nullable=True),
    sa.Column('profile_id', sa.String(length=36), nullable=True),
    sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='SET NULL',
                            name=op.f('fk_leases_job_id_jobs')),
    sa.ForeignKeyConstraint(['profile_id'], ['profiles.id'], ondelete='SET NULL',
                            name=op.f('fk_leases_profile_id_profiles')),
    sa.PrimaryKeyConstraint('resource', name=op.f('pk_leases'))
    )
    op.create_table('trials',
    sa.Column('id', BIG_ID, autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('label', sa.String(length=200), nullable=False),
    sa.Column('config', JSON, nullable=False),
    sa.Column('predicted_step_time', sa.Float(), nullable=True),
    sa.Column('measured_step_time', sa.Float(), nullable=True),
    sa.Column('steps', JSON, nullable=False),
    sa.Column('record', JSON, nullable=True),
    sa.Column('attempts', JSON, nullable=False),
    sa.Column('runs', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('duration_s', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE',
                            name=op.f('fk_trials_job_id_jobs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trials')),
    sa.UniqueConstraint('job_id', 'number', name='uq_trials_job_number')
    )


def downgrade() -> None:
    op.drop_table('trials')
    op.drop_table('leases')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_job_id_id')

    op.drop_table('events')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_tenant_created')
        batch_op.drop_index('ix_jobs_state_created')
        batch_op.drop_index(batch_op.f('ix_jobs_cluster_id'))

    op.drop_table('jobs')
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.drop_index('ix_profiles_cluster_created')

    op.drop_table('profiles')
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tokens_tenant'))

    op.drop_table('tokens')
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_clusters_tenant'))
        batch_op.drop_index(batch_op.f('ix_clusters_resource'))

    op.drop_table('clusters')
