"""Jobs: submit, read, list (filters, cursor pages), cancel, and the scheduler's transitions."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, TypeAlias

from sqlalchemy import Row, Select, Text, and_, cast, func, or_, select, update
from sqlalchemy.orm import Session

from service.errors import ConflictError, NotFoundError
from service.models import FINAL_STATES, Cluster, Job, Lease, utcnow
from service.repositories.events import add_event


def create_job(
    session: Session, *, tenant: str, cluster: Cluster, name: str, model: dict[str, Any],
    training: dict[str, Any], options: dict[str, Any],
) -> Job:
    now = utcnow()
    job = Job(
        id=str(uuid.uuid4()), tenant=tenant, name=name, cluster_id=cluster.id, state="queued",
        model=model, training=training, options=options, created_at=now, updated_at=now,
        cancel_requested=False, attempts=0, tuning_s=0.0,
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, "state", {"state": "queued", "previous": None})
    return job


def get_job(session: Session, tenant: str, job_id: str) -> Job:
    job = session.get(Job, job_id.lower())  # ids are lower-case UUIDs; the path accepts either case
    if job is None or job.tenant != tenant:
        # Another tenant's job answers exactly like a missing one.
        raise NotFoundError(f"no job {job_id!r}", field="job_id", fix="use an id from GET /v1/jobs")
    return job


#: A row (and a select) of columns whose types differ per column
AnyRow: TypeAlias = Row[*tuple[Any, ...]]
AnySelect: TypeAlias = Select[*tuple[Any, ...]]

#: The columns a job's answer (``service.views.job_out``) is made of; the JSON ones are read as
#: their text, so a row can key the answer cache (``service.answers``) before anything is decoded.
JOB_PLAIN = (Job.id, Job.tenant, Job.name, Job.cluster_id, Job.state, Job.created_at, Job.updated_at,
             Job.started_at, Job.finished_at, Job.cancel_requested, Job.attempts, Job.tuning_s, Job.stop_reason)
JOB_JSON = (Job.model, Job.training, Job.options, Job.progress, Job.best, Job.error)
JOB_ROW = (*JOB_PLAIN, *(cast(c, Text).label(c.key) for c in JOB_JSON))
JOB_WIDTH = len(JOB_ROW)


#: What a queued job's notice (``service.views.unserved_notice``) reads of its cluster and of the
#: lease of the cluster's devices: read with the job's row, so ``GET /v1/jobs/{id}`` is one query
SERVED_BY = (Cluster.kind.label("cluster_kind"), Cluster.address.label("cluster_address"),
             Cluster.resource.label("cluster_resource"), Lease.holder.label("lease_holder"),
             Lease.expires_at.label("lease_expires_at"), Lease.served_at.label("lease_served_at"))


def job_row(session: Session, tenant: str, job_id: str) -> AnyRow:
    """A job's answer columns (``JOB_ROW``, its first ``len(JOB_ROW)``), as ``get_job`` finds it,
    then its cluster's and lease's (``SERVED_BY``; None where there is none), in one query."""
    row = session.execute(
        select(*JOB_ROW, *SERVED_BY).outerjoin(Cluster, Cluster.id == Job.cluster_id)
        .outerjoin(Lease, Lease.resource == Cluster.resource).where(Job.id == job_id.lower())
    ).first()
    if row is None or row.tenant != tenant:
        # Another tenant's job answers exactly like a missing one.
        raise NotFoundError(f"no job {job_id!r}", field="job_id", fix="use an id from GET /v1/jobs")
    return row


def served_by(row: AnyRow) -> tuple[Cluster | None, Lease | None]:
    """The cluster and lease of a ``job_row`` row, as transient objects (not in any session)."""
    data = row._mapping
    if data["cluster_kind"] is None:
        return None, None
    cluster = Cluster(kind=data["cluster_kind"], address=data["cluster_address"], resource=data["cluster_resource"])
    # no lease row reads as one never held nor served, which is what the notice makes of it
    return cluster, Lease(resource=data["cluster_resource"], holder=data["lease_holder"],
                          expires_at=data["lease_expires_at"], served_at=data["lease_served_at"])


def job_of_row(row: AnyRow) -> Job:
    """A transient job of a ``JOB_ROW`` row (its JSON decoded), for ``service.views.job_out``."""
    data = row._mapping
    return Job(**{c.key: data[c.key] for c in JOB_PLAIN},
               **{c.key: None if data[c.key] is None else json.loads(data[c.key]) for c in JOB_JSON})


def list_job_rows(
    session: Session, tenant: str, *, states: Sequence[str] = (), cluster_id: str | None = None,
    limit: int = 50, cursor: str | None = None,
) -> tuple[Sequence[AnyRow], str | None]:
    """A tenant's jobs, newest first, a page of ``JOB_ROW`` rows and the next page's cursor (the
    polled list: answers come from their rows, ``service.answers``)."""
    query = _page(session, select(*JOB_ROW), tenant, states, cluster_id, cursor)
    rows = session.execute(query.limit(limit + 1)).all()
    page = rows[:limit]
    after = page[-1].id if len(rows) > limit else None
    return page, after


def _page(session: Session, query: AnySelect, tenant: str, states: Sequence[str], cluster_id: str | None,
          cursor: str | None) -> AnySelect:
    query = query.where(Job.tenant == tenant)
    if states:
        query = query.where(Job.state.in_(list(states)))
    if cluster_id:
        query = query.where(Job.cluster_id == cluster_id)
    if cursor:
        last = session.execute(select(Job.id, Job.tenant, Job.created_at).where(Job.id == cursor.lower())).first()
        if last is None or last.tenant != tenant:
            raise NotFoundError(f"no job {cursor!r} to continue after", field="cursor",
                                fix="pass next_cursor from the previous page, or no cursor")
        query = query.where(or_(Job.created_at < last.created_at,
                                and_(Job.created_at == last.created_at, Job.id < last.id)))
    return query.order_by(Job.created_at.desc(), Job.id.desc())


def request_cancel(session: Session, tenant: str, job_id: str) -> Job:
    """A queued job is cancelled at once; a running one is flagged and its driver stops it
    (the running trial is pruned) within a step."""
    job = get_job(session, tenant, job_id)
    if job.state in FINAL_STATES:
        raise ConflictError(f"the job is {job.state} already", field="job_id", fix="nothing to cancel")
    job.cancel_requested = True
    job.updated_at = utcnow()
    if job.state == "queued":
        set_state(session, job, "cancelled", stop_reason="cancelled")
    else:
        add_event(session, job.id, "cancel_requested", {"state": job.state})
    return job


def set_state(session: Session, job: Job, state: str, **fields: Any) -> None:
    previous = job.state
    now = utcnow()
    job.state = state
    job.updated_at = now
    if state in FINAL_STATES:
        job.finished_at = now
    for key, value in fields.items():
        setattr(job, key, value)
    if previous != state:
        add_event(session, job.id, "state", {"state": state, "previous": previous})


def update_job(session: Session, job_id: str, **fields: Any) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(updated_at=utcnow(), **fields))


def counts_by_state(session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.state, func.count()).group_by(Job.state)).all()
    return {str(state): int(n) for state, n in rows}
