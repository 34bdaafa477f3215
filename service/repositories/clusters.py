"""Clusters and their profiles."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.errors import ConflictError, NotFoundError
from service.models import Cluster, Job, Profile, utcnow
from service.repositories.leases import ensure_lease
from service.repositories.quotas import check_room, serialize_tenant

#: Deleted clusters keep their rows (their jobs' records stay readable) but are no one's cluster.
LIVE = Cluster.deleted_at.is_(None)
#: A job in one of these states still needs its cluster.
UNFINISHED = ("queued", "profiling", "planning", "running")


def create_cluster(
    session: Session, *, tenant: str, name: str, kind: str, address: str, resource: str,
    nodes: list[dict[str, Any]], devices_per_node: int,
) -> Cluster:
    if session.execute(select(Cluster.id).where(Cluster.tenant == tenant, Cluster.name == name, LIVE)).first():
        raise ConflictError(f"a cluster named {name!r} exists already", field="name", fix="choose another name")
    cluster = Cluster(
        id=str(uuid.uuid4()), tenant=tenant, name=name, kind=kind, address=address, resource=resource,
        nodes=nodes, devices_per_node=devices_per_node, created_at=utcnow(),
    )
    session.add(cluster)
    try:
        session.flush()
    except IntegrityError:
        raise ConflictError(f"a cluster named {name!r} exists already", field="name",
                            fix="choose another name") from None
    ensure_lease(session, resource)
    return cluster


def check_cluster_room(session: Session, tenant: str, limit: int) -> None:
    """ConflictError (409) when the tenant has ``limit`` clusters already (each is a lease row
    and a scheduler's poll); call ``serialize_tenant`` first in the same transaction."""
    count = session.execute(
        select(func.count()).select_from(Cluster).where(Cluster.tenant == tenant, LIVE)).scalar_one()
    if count >= limit:
        raise ConflictError(
            f"tenant {tenant} has {count} clusters, the limit (PIPETTE_MAX_CLUSTERS_PER_TENANT) is {limit}",
            field="name", fix="submit to a cluster registered already (GET /v1/clusters), delete one you no longer "
                              "use (DELETE /v1/clusters/{name}), or ask the operator to raise "
                              "PIPETTE_MAX_CLUSTERS_PER_TENANT")


def get_cluster(session: Session, tenant: str, ref: str, *, for_update: bool = False) -> Cluster:
    """A live cluster by id or by name, within the tenant."""
    query = select(Cluster).where(Cluster.tenant == tenant, LIVE, or_(Cluster.id == ref.lower(), Cluster.name == ref))
    if for_update:
        query = query.with_for_update().execution_options(populate_existing=True)
    cluster = session.execute(query).scalars().first()
    if cluster is None:
        raise NotFoundError(f"no cluster {ref!r}", field="cluster",
                            fix="register it with POST /v1/clusters, or list them with GET /v1/clusters")
    return cluster


def delete_cluster(session: Session, tenant: str, ref: str) -> Cluster:
    """Mark the cluster deleted: it leaves the tenant's list and cap, its name is free again,
    and its finished jobs stay readable. ConflictError (409) while work of it is queued or runs.
    Call with the tenant serialized (``serialize_tenant``): a submit cannot slip in between."""
    cluster = get_cluster(session, tenant, ref, for_update=True)
    jobs = session.execute(
        select(Job.id, Job.state).where(Job.cluster_id == cluster.id, Job.state.in_(UNFINISHED))
        .order_by(Job.created_at, Job.id)
    ).all()
    if jobs:
        listed = ", ".join(f"{job_id} ({state})" for job_id, state in jobs[:5])
        more = f" and {len(jobs) - 5} more" if len(jobs) > 5 else ""
        raise ConflictError(
            f"cluster {cluster.name!r} has {len(jobs)} unfinished jobs: {listed}{more}", field="cluster",
            fix="cancel them (POST /v1/jobs/{id}/cancel, `pipette cancel ID`) or wait until they end, then delete "
                "the cluster again")
    profile = session.execute(
        select(Profile.id, Profile.state).where(Profile.cluster_id == cluster.id,
                                                Profile.state.in_(("queued", "running"))).limit(1)
    ).first()
    if profile is not None:
        raise ConflictError(
            f"cluster {cluster.name!r} has a {profile.state} profile ({profile.id})", field="cluster",
            fix="wait until it ends (a queued one can be cancelled: POST /v1/clusters/{id}/profiles/{profile_id}"
                "/cancel), then delete the cluster again")
    cluster.deleted_at = utcnow()
    return cluster


def list_clusters(session: Session, tenant: str) -> Sequence[Cluster]:
    return session.execute(
        select(Cluster).where(Cluster.tenant == tenant, LIVE).order_by(Cluster.created_at, Cluster.id)
    ).scalars().all()


def latest_profile(session: Session, cluster_id: str, *, succeeded: bool = True) -> Profile | None:
    query = select(Profile).where(Profile.cluster_id == cluster_id)
    if succeeded:
        query = query.where(Profile.state == "succeeded")
    return session.execute(query.order_by(Profile.created_at.desc(), Profile.id.desc()).limit(1)).scalars().first()


def request_profile(session: Session, cluster: Cluster, *, max_queued: int | None = None) -> Profile:
    """A queued profile of the cluster: the one already queued if there is one (requests while
    it waits coalesce: it measures the devices for all of them), else a new one. With
    ``max_queued``, a new one must fit the tenant's queue (else TooManyRequestsError, 429); a
    coalesced request adds nothing to the queue, so it always passes."""
    serialize_tenant(session, cluster.tenant)  # two requests at once: still one queued profile
    queued = session.execute(
        select(Profile).where(Profile.cluster_id == cluster.id, Profile.state == "queued")
        .order_by(Profile.created_at, Profile.id).limit(1)
    ).scalars().first()
    if queued is not None:
        return queued
    if max_queued is not None:
        check_room(session, cluster.tenant, max_queued)
    profile = Profile(id=str(uuid.uuid4()), cluster_id=cluster.id, state="queued", created_at=utcnow())
    session.add(profile)
    session.flush()
    return profile


def cancel_profile(session: Session, cluster_id: str, profile_id: str) -> Profile:
    """A queued profile is cancelled at once; one being measured (or finished) cannot be: 409."""
    get_profile(session, cluster_id, profile_id)  # 404 first
    # Locked (PostgreSQL), and read again: a scheduler's claim may be starting it right now.
    profile = session.execute(
        select(Profile).where(Profile.id == profile_id.lower()).with_for_update()
        .execution_options(populate_existing=True)
    ).scalars().one()
    if profile.state == "running":
        raise ConflictError("the profile is being measured; it cannot be stopped and finishes by itself",
                            field="profile_id", fix="wait for it (GET /v1/clusters/{id}/profiles/{profile_id})")
    if profile.state != "queued":
        raise ConflictError(f"the profile is {profile.state} already", field="profile_id", fix="nothing to cancel")
    profile.state = "cancelled"
    profile.finished_at = utcnow()
    return profile


def get_profile(session: Session, cluster_id: str, profile_id: str) -> Profile:
    profile = session.get(Profile, profile_id.lower())
    if profile is None or profile.cluster_id != cluster_id:
        raise NotFoundError(f"no profile {profile_id!r} of this cluster", field="profile_id",
                            fix="use an id from POST /v1/clusters/{id}/profile")
    return profile
