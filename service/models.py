"""SQLAlchemy 2 models: what the service stores. Alembic's migrations are written from these.

The database is the one source of truth (DESIGN.md): every job, every trial with its
measurement (every step time) as the tuner's ``TrialRecord`` dict, every profile, every event
and the hashed API tokens. The Optuna study of a job is rebuilt from its trials, never kept.

JSON columns hold the core's own ``to_dict`` forms, so the API answers with the same shapes
the CLI prints with ``--json``. Times are timezone-aware UTC on both SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: Job states, in the order a job passes them; the last three are final.
JOB_STATES: tuple[str, ...] = ("queued", "profiling", "planning", "running", "succeeded", "failed", "cancelled")
FINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
ACTIVE_STATES: frozenset[str] = frozenset({"profiling", "planning", "running"})
PROFILE_STATES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
#: Trial states: running, a measurement status, or interrupted (the service died mid-trial).
TRIAL_STATES: tuple[str, ...] = ("running", "ok", "oom", "failed", "timeout", "pruned", "interrupted")
CLUSTER_KINDS: tuple[str, ...] = ("local", "ray")

# Names for constraints, so migrations are the same on SQLite and PostgreSQL.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out (SQLite keeps no time zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# Python None is SQL NULL (not JSON 'null'), so "IS NULL" finds what was never set.
Json = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
# An autoincrementing 64-bit key (SQLite autoincrements INTEGER PRIMARY KEY only).
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Token(Base):
    """An API token: only the SHA-256 of its secret is stored."""

    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(100), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Cluster(Base):
    """A set of devices jobs run on: the embedded local Ray, or a Ray cluster's chosen nodes."""

    __tablename__ = "clusters"
    # Names are unique among the tenant's live clusters: a deleted one's name may be used again.
    __table_args__ = (Index("uq_clusters_tenant_live_name", "tenant", "name", unique=True,
                            sqlite_where=text("deleted_at IS NULL"), postgresql_where=text("deleted_at IS NULL")),)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(100), index=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(16))
    #: the Ray address (kind ray) or the host name of the embedded cluster (kind local)
    address: Mapped[str] = mapped_column(String(500))
    #: the lease key: the devices behind this cluster (shared by clusters on the same devices)
    resource: Mapped[str] = mapped_column(String(600), index=True)
    #: [{name, address, devices}] the jobs may use; [] means every node Ray sees
    nodes: Mapped[list[dict[str, Any]]] = mapped_column(Json, default=list)
    #: devices per node (CPU worker processes where there is no GPU)
    devices_per_node: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    #: jobs of this cluster may run their own training script (an operator enabled it for the
    #: tenant: ``pipette-admin cluster allow-scripts``)
    allow_scripts: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: when the tenant deleted it (None: live); the row stays so its jobs' records stay readable
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Profile(Base):
    """One measurement of a cluster: inventory, link matrix, compute (a ClusterProfile dict)."""

    __tablename__ = "profiles"
    __table_args__ = (Index("ix_profiles_cluster_created", "cluster_id", "created_at"),)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(String(16), default="queued")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    profile: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)


class Job(Base):
    """One tuning request and everything it produced."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_created", "tenant", "created_at", "id"),
        Index("ix_jobs_state_created", "state", "created_at"),
    )
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(100))
    name: Mapped[str] = mapped_column(String(200), default="")
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    #: ModelSpec.to_dict(), TrainingSpec.to_dict(), the search budget and stop rule
    model: Mapped[dict[str, Any]] = mapped_column(Json)
    training: Mapped[dict[str, Any]] = mapped_column(Json)
    options: Mapped[dict[str, Any]] = mapped_column(Json)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    #: how many times a scheduler took the job (more than one: it was resumed)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    profile_id: Mapped[str | None] = mapped_column(ForeignKey("profiles.id", ondelete="SET NULL"), nullable=True)
    #: {trials_done, trials_ok, running_trial, max_trials}: kept current by the driver
    progress: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    #: seconds spent tuning over all attempts (the time budget spans restarts)
    tuning_s: Mapped[float] = mapped_column(Float, default=0.0)
    #: the full plan (every candidate; large) and the tuner's result: loaded only when asked for
    plan: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True, deferred=True)
    best: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True, deferred=True)
    stop_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    #: the user's own training script (``pipette.script.ScriptSpec.to_dict``, no workdir); None:
    #: Pipette's runner
    script: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    #: the script's working directory, zipped (``workers.host.workdir.pack``)
    script_files: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True, deferred=True)


class Trial(Base):
    """One trial of a job; (job, number) is unique, so a rerun replaces, never duplicates."""

    __tablename__ = "trials"
    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_trials_job_number"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="running")
    label: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict[str, Any]] = mapped_column(Json)
    predicted_step_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    measured_step_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The last attempt's figures, copied from its record so that a list needs not parse it.
    analytic_step_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    predicted_peak_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    #: every step as it streamed in: [{step, time, warmup}]
    steps: Mapped[list[dict[str, Any]]] = mapped_column(Json, default=list, deferred=True)
    #: the tuner's TrialRecord.to_dict() of the last attempt once it ended (the measurement,
    #: all step times); None while running or after an interruption
    record: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True, deferred=True)
    #: every ended attempt's TrialRecord dict, in order (a failed attempt is retried)
    attempts: Mapped[list[dict[str, Any]]] = mapped_column(Json, default=list, deferred=True)
    #: times an attempt of the trial was started (interrupted and retried ones included)
    runs: Mapped[int] = mapped_column(Integer, default=1)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class Event(Base):
    """One entry of a job's event stream; its id is the SSE event id (``Last-Event-ID``)."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job_id_id", "job_id", "id"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(40))
    trial: Mapped[int | None] = mapped_column(Integer, nullable=True)
    data: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Lease(Base):
    """Who may run trials on a set of devices (``resource``) until ``expires_at``."""

    __tablename__ = "leases"
    resource: Mapped[str] = mapped_column(String(600), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(200), nullable=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True)
    profile_id: Mapped[str | None] = mapped_column(ForeignKey("profiles.id", ondelete="SET NULL"), nullable=True)
    acquired_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: when a scheduler serving these devices last looked for work (held or not)
    served_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

