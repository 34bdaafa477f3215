"""A tenant's share of the queue: how much queued work (jobs and profiles) it may have at once.

Devices are shared between tenants; without a limit one tenant's requests (181 profiles of one
cluster, issue 17 item 12) fill their queue. New queued work beyond
``PIPETTE_MAX_QUEUED_PER_TENANT`` answers 429 until some of it starts or is cancelled.
"""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from service.errors import TooManyRequestsError
from service.models import Cluster, Job, Profile

SETTING = "PIPETTE_MAX_QUEUED_PER_TENANT"


def serialize_tenant(session: Session, tenant: str) -> None:
    """Until this transaction ends, no other transaction passes this call for ``tenant``: the
    count of its queued work and what is queued next are one step (PostgreSQL: an advisory
    transaction lock; SQLite: every writing transaction is the single writer already)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                        {"key": f"pipette-queue:{tenant}"})


def queued_count(session: Session, tenant: str) -> int:
    """The tenant's queued jobs plus the queued profiles of its clusters."""
    jobs = session.execute(
        select(func.count()).select_from(Job).where(Job.tenant == tenant, Job.state == "queued")
    ).scalar_one()
    profiles = session.execute(
        select(func.count()).select_from(Profile).join(Cluster, Profile.cluster_id == Cluster.id)
        .where(Cluster.tenant == tenant, Profile.state == "queued")
    ).scalar_one()
    return int(jobs) + int(profiles)


def check_room(session: Session, tenant: str, limit: int) -> None:
    """Raise TooManyRequestsError (429) when the tenant may queue nothing more. Call
    ``serialize_tenant`` first in the same transaction, so concurrent requests cannot both
    take the last place."""
    count = queued_count(session, tenant)
    if count >= limit:
        raise TooManyRequestsError(
            f"tenant {tenant} has {count} queued jobs and profiles, the limit ({SETTING}) is {limit}",
            field=None,
            fix="wait until some of the queued work starts (GET /v1/jobs?state=queued), or cancel queued work: "
                "POST /v1/jobs/{id}/cancel, POST /v1/clusters/{id}/profiles/{profile_id}/cancel",
        )
