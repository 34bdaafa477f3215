"""Leases: one holder at a time per set of devices, with a heartbeat and an expiry.

``claim`` runs in one transaction: lock the lease row (PostgreSQL: ``FOR UPDATE SKIP LOCKED``,
so a second scheduler skips it instead of waiting; SQLite: the whole transaction is the single
writer, ``BEGIN IMMEDIATE``), check that nobody live holds it, pick the next piece of work for
those devices (a dead holder's job first, then the least recently served tenant's oldest queued
job or profile) and take the lease for it. A holder that stops renewing (killed, hung, cut off)
loses the lease at ``expires_at`` and its job is resumed by whoever claims next.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.models import ACTIVE_STATES, Cluster, Job, Lease, Profile, utcnow

#: how often a polling scheduler records that it serves a lease's devices (seconds)
SERVED_EVERY_S = 5.0
#: a queued job whose devices no scheduler has polled for this long is told so (seconds)
UNSERVED_AFTER_S = 30.0


@dataclass(frozen=True)
class Work:
    """What a claim handed out: a job to drive (new or resumed) or a profile to measure."""

    kind: Literal["job", "profile"]
    id: str
    resource: str
    holder: str
    resumed: bool = False


def ensure_lease(session: Session, resource: str) -> None:
    """The lease row of ``resource`` exists (created free; idempotent, race-free)."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(Lease).values(resource=resource).on_conflict_do_nothing(index_elements=["resource"]))


def claim(session: Session, resource: str, holder: str, ttl_s: float, now: datetime | None = None) -> Work | None:
    now = now or utcnow()
    lease = session.execute(
        select(Lease).where(Lease.resource == resource).with_for_update(skip_locked=True)
    ).scalar_one_or_none()
    if lease is None:
        return None
    if lease.served_at is None or now - lease.served_at > timedelta(seconds=SERVED_EVERY_S):
        lease.served_at = now
    if _held(lease, now):
        return None
    _fail_orphan_profiles(session, resource, now)
    work = _next_work(session, resource, holder)
    if work is None:
        if lease.holder is not None:  # expired and nothing left to resume: free it
            _clear(lease)
        return None
    lease.holder = holder
    lease.job_id = work.id if work.kind == "job" else None
    lease.profile_id = work.id if work.kind == "profile" else None
    lease.acquired_at = lease.heartbeat_at = now
    lease.expires_at = now + timedelta(seconds=ttl_s)
    _mark_started(session, work, now)
    return work


def renew(session: Session, resource: str, holder: str, ttl_s: float) -> bool:
    """Extend the lease; False when ``holder`` no longer holds it (it expired and was taken)."""
    now = utcnow()
    result = session.execute(
        update(Lease).where(Lease.resource == resource, Lease.holder == holder)
        .values(expires_at=now + timedelta(seconds=ttl_s), heartbeat_at=now)
    )
    return bool(getattr(result, "rowcount", 0))


def release(session: Session, resource: str, holder: str) -> None:
    session.execute(
        update(Lease).where(Lease.resource == resource, Lease.holder == holder)
        .values(holder=None, job_id=None, profile_id=None, expires_at=None)
    )


def get_lease(session: Session, resource: str) -> Lease | None:
    return session.get(Lease, resource)


def _held(lease: Lease, now: datetime) -> bool:
    return lease.holder is not None and lease.expires_at is not None and lease.expires_at > now


def _clear(lease: Lease) -> None:
    lease.holder = lease.job_id = lease.profile_id = None
    lease.expires_at = None


def _mark_started(session: Session, work: Work, now: datetime) -> None:
    """The claimed work starts now, in the claim's transaction (its row is locked): a profile
    is ``running`` at once, so a cancel can no longer take it; a job's ``started_at`` is its
    tenant's turn (``_tenants_in_turn``). Both rows are in the session already."""
    if work.kind == "profile":
        profile = session.get(Profile, work.id)
        if profile is not None:
            profile.state, profile.started_at = "running", now
    else:
        job = session.get(Job, work.id)
        if job is not None and job.started_at is None:
            job.started_at = now


def _fail_orphan_profiles(session: Session, resource: str, now: datetime) -> None:
    """A profile left running under a free lease died with its holder: say so (measuring again
    is a new request, since the devices may have changed meanwhile)."""
    orphans = session.execute(
        select(Profile).join(Cluster, Profile.cluster_id == Cluster.id)
        .where(Cluster.resource == resource, Profile.state == "running")
    ).scalars().all()
    for profile in orphans:
        profile.state = "failed"
        profile.finished_at = now
        profile.error = {"message": "interrupted: its service stopped while measuring", "field": None,
                         "fix": "start another profile (POST /v1/clusters/{id}/profile)"}


def _next_work(session: Session, resource: str, holder: str) -> Work | None:
    # A job in an active state while its lease is free lost its holder mid-run: resume it first,
    # so it finishes before anything newer starts on the same devices.
    orphan = session.execute(
        select(Job).join(Cluster, Job.cluster_id == Cluster.id)
        .where(Cluster.resource == resource, Job.state.in_(ACTIVE_STATES))
        .order_by(Job.created_at, Job.id).limit(1).with_for_update(skip_locked=True, of=Job)
    ).scalars().first()
    if orphan is not None:
        return Work("job", orphan.id, resource, holder, resumed=True)
    for tenant in _tenants_in_turn(session, resource):
        work = _oldest_queued(session, resource, holder, tenant)
        if work is not None:
            return work
    return None


def _tenants_in_turn(session: Session, resource: str) -> list[str]:
    """The tenants with queued work on the devices, in the order they are served: the one
    served least recently first (the latest start of its jobs and profiles there; never served
    before any served), ties to the one with the oldest queued work. So one tenant's long queue
    delays another tenant's next piece of work by one piece of work, not by the whole queue
    (issue 17 item 12). Only the lease row is locked here (by ``claim``): these are aggregates."""
    oldest: dict[str, datetime] = {}
    for tenant, created in [
        *session.execute(
            select(Job.tenant, func.min(Job.created_at)).join(Cluster, Job.cluster_id == Cluster.id)
            .where(Cluster.resource == resource, Job.state == "queued").group_by(Job.tenant)
        ).all(),
        *session.execute(
            select(Cluster.tenant, func.min(Profile.created_at)).join(Cluster, Profile.cluster_id == Cluster.id)
            .where(Cluster.resource == resource, Profile.state == "queued").group_by(Cluster.tenant)
        ).all(),
    ]:
        oldest[tenant] = min(created, oldest.get(tenant, created))
    if len(oldest) < 2:
        return list(oldest)
    served: dict[str, datetime] = {}
    for tenant, started in [
        *session.execute(
            select(Job.tenant, func.max(Job.started_at)).join(Cluster, Job.cluster_id == Cluster.id)
            .where(Cluster.resource == resource, Job.tenant.in_(list(oldest)), Job.started_at.is_not(None))
            .group_by(Job.tenant)
        ).all(),
        *session.execute(
            select(Cluster.tenant, func.max(Profile.started_at)).join(Cluster, Profile.cluster_id == Cluster.id)
            .where(Cluster.resource == resource, Cluster.tenant.in_(list(oldest)), Profile.started_at.is_not(None))
            .group_by(Cluster.tenant)
        ).all(),
    ]:
        if started is not None:
            served[tenant] = max(started, served.get(tenant, started))
    return sorted(oldest, key=lambda t: (t in served, served.get(t, oldest[t]), oldest[t], t))


def _oldest_queued(session: Session, resource: str, holder: str, tenant: str) -> Work | None:
    """The tenant's oldest queued job or profile on the devices (its row locked: PostgreSQL
    skips one another claim holds)."""
    job = session.execute(
        select(Job).join(Cluster, Job.cluster_id == Cluster.id)
        .where(Cluster.resource == resource, Job.tenant == tenant, Job.state == "queued")
        .order_by(Job.created_at, Job.id).limit(1).with_for_update(skip_locked=True, of=Job)
    ).scalars().first()
    profile = session.execute(
        select(Profile).join(Cluster, Profile.cluster_id == Cluster.id)
        .where(Cluster.resource == resource, Cluster.tenant == tenant, Profile.state == "queued")
        .order_by(Profile.created_at, Profile.id).limit(1).with_for_update(skip_locked=True, of=Profile)
    ).scalars().first()
    if profile is not None and (job is None or profile.created_at <= job.created_at):
        return Work("profile", profile.id, resource, holder)
    if job is not None:
        return Work("job", job.id, resource, holder)
    return None
