"""Clusters: register (the embedded local one, or a Ray cluster's nodes), list, read with the
latest profile (inventory, link matrix, memory, compute), and start or cancel a profile."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from sqlalchemy.orm import Session

from service.deps import Caller, State
from service.errors import RequestError
from service.models import Cluster, Job, Lease, Profile
from service.repositories import clusters as repo
from service.repositories.leases import get_lease
from service.repositories.quotas import serialize_tenant
from service.routes import AUTHED, errors
from service.schemas import ID_PATTERN, NAME_PATTERN, ClusterIn, ClusterList, ClusterOut, ProfileOut
from service.settings import resource_key
from service.views import cluster_out, cluster_url, profile_out

router = APIRouter(prefix="/v1/clusters", tags=["clusters"])
ClusterRef = Annotated[str, Path(max_length=100, pattern=NAME_PATTERN, description="the cluster's id or name")]
ProfileId = Annotated[str, Path(max_length=36, pattern=ID_PATTERN)]


@router.post("", status_code=201, response_model=ClusterOut, responses=errors(*AUTHED, 409))
def register_cluster(body: ClusterIn, state: State, caller: Caller, response: Response) -> ClusterOut:
    if body.kind == "ray":
        if not body.address:
            raise RequestError("is required for a Ray cluster", field="address",
                               fix="give the Ray address, e.g. 10.0.0.1:6379 (the RAY_ADDRESS of its workers)")
        address = body.address
    else:
        if body.address or body.nodes:
            raise RequestError("a local cluster takes no address or nodes", field="address" if body.address
                               else "nodes", fix="drop them, or use kind: ray")
        # The embedded cluster is this host's local Ray: its lease is per host.
        address = state.settings.hostname
    nodes = [n.model_dump() for n in body.nodes]
    with state.db.write() as session:
        serialize_tenant(session, caller.tenant)  # two registrations at once: still one count
        repo.check_cluster_room(session, caller.tenant, state.settings.max_clusters_per_tenant)
        cluster = repo.create_cluster(
            session, tenant=caller.tenant, name=body.name, kind=body.kind, address=address,
            resource=resource_key(body.kind, address), nodes=nodes, devices_per_node=body.devices,
        )
        out = _out(session, cluster, caller.tenant)
    response.headers["Location"] = cluster_url(out.id)
    return out


@router.get("", response_model=ClusterList, responses=errors(*AUTHED))
def list_clusters(state: State, caller: Caller) -> ClusterList:
    with state.db.read() as session:
        return ClusterList(items=[_out(session, c, caller.tenant) for c in repo.list_clusters(session, caller.tenant)])


@router.get("/{cluster_id}", response_model=ClusterOut, responses=errors(*AUTHED, 404))
def read_cluster(cluster_id: ClusterRef, state: State, caller: Caller) -> ClusterOut:
    with state.db.read() as session:
        return _out(session, repo.get_cluster(session, caller.tenant, cluster_id), caller.tenant)


@router.delete("/{cluster_id}", status_code=204, response_class=Response, responses=errors(*AUTHED, 404, 409))
def delete_cluster(cluster_id: ClusterRef, state: State, caller: Caller) -> Response:
    """Delete a cluster of the tenant (its name and its place under the cap are free again). The
    jobs that ran on it stay readable; refused (409) while a job or profile of it is queued or runs."""
    with state.db.write() as session:
        serialize_tenant(session, caller.tenant)  # no job is queued on it while it goes
        repo.delete_cluster(session, caller.tenant, cluster_id)
    return Response(status_code=204)


@router.post("/{cluster_id}/profile", status_code=202, response_model=ProfileOut,
             responses=errors(*AUTHED, 404, 429))
def start_profile(cluster_id: ClusterRef, state: State, caller: Caller, response: Response) -> ProfileOut:
    """Queue a measurement of the cluster; it runs when the cluster's devices are free. While
    one is queued, this answers that one (same id): requests coalesce."""
    with state.db.write() as session:
        serialize_tenant(session, caller.tenant)  # a concurrent delete of the cluster ends first
        cluster = repo.get_cluster(session, caller.tenant, cluster_id)
        out = profile_out(repo.request_profile(session, cluster, max_queued=state.settings.max_queued_per_tenant))
    state.kick()
    response.headers["Location"] = out.url
    return out


@router.get("/{cluster_id}/profiles/{profile_id}", response_model=ProfileOut, responses=errors(*AUTHED, 404))
def read_profile(cluster_id: ClusterRef, profile_id: ProfileId, state: State, caller: Caller) -> ProfileOut:
    with state.db.read() as session:
        cluster = repo.get_cluster(session, caller.tenant, cluster_id)
        return profile_out(repo.get_profile(session, cluster.id, profile_id))


@router.post("/{cluster_id}/profiles/{profile_id}/cancel", status_code=202, response_model=ProfileOut,
             responses=errors(*AUTHED, 404, 409))
def cancel_profile(cluster_id: ClusterRef, profile_id: ProfileId, state: State, caller: Caller) -> ProfileOut:
    """A queued profile is cancelled at once; one being measured finishes by itself (409)."""
    with state.db.write() as session:
        cluster = repo.get_cluster(session, caller.tenant, cluster_id)
        return profile_out(repo.cancel_profile(session, cluster.id, profile_id))


def _out(session: Session, cluster: Cluster, tenant: str) -> ClusterOut:
    lease = get_lease(session, cluster.resource)
    out = cluster_out(cluster, lease, repo.latest_profile(session, cluster.id))
    # The devices may be busy with another tenant's work: say busy, but never whose.
    if lease is not None and out.lease.busy and _lease_tenant(session, lease) != tenant:
        out.lease.job_id = out.lease.profile_id = None
    return out


def _lease_tenant(session: Session, lease: Lease) -> str | None:
    if lease.job_id:
        job = session.get(Job, lease.job_id)
        return job.tenant if job else None
    profile = session.get(Profile, lease.profile_id) if lease.profile_id else None
    owner = session.get(Cluster, profile.cluster_id) if profile else None
    return owner.tenant if owner else None
