"""Rows to API shapes (``service.schemas``): the one place a response's fields are filled."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter
from starlette.responses import Response

from pipette.stacks import DEFAULT_STACK
from service.answers import AnswerCache
from service.models import Cluster, Job, Lease, Profile, Trial, utcnow
from service.repositories.jobs import JOB_WIDTH, AnyRow, job_of_row
from service.repositories.leases import UNSERVED_AFTER_S
from service.repositories.trials import trial_of_row
from service.schemas import (
    BestSummary,
    ClusterOut,
    ErrorDetail,
    JobLinks,
    JobOut,
    LeaseOut,
    ProfileOut,
    Progress,
    TrialDetail,
    TrialOut,
)

API = "/v1"


def as_json(model: BaseModel, status_code: int = 200) -> Response:
    """A built response model, serialized once by pydantic-core: FastAPI would validate it again
    against the route's ``response_model`` (the reads are the hot path; the schema stays the
    route's ``response_model``, and the tests check the shapes)."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def json_bytes(body: bytes) -> Response:
    """An answer serialized already (``Answers``)."""
    return Response(body, media_type="application/json")


@dataclass
class Answers:
    """This process's answers of the polled reads, by row (``service.answers``): a job's
    ``JobOut`` with its JSON, and a trial's line of a trials list."""

    jobs: AnswerCache[tuple[JobOut, bytes]] = field(default_factory=AnswerCache)
    trials: AnswerCache[bytes] = field(default_factory=AnswerCache)

    def job(self, row: AnyRow) -> tuple[JobOut, bytes]:
        """The answer of a ``service.repositories.jobs.JOB_ROW`` row (without a notice). The
        ``JobOut`` is shared: copy it to change it."""
        def build() -> tuple[JobOut, bytes]:
            out = job_out(job_of_row(row))
            return out, out.model_dump_json().encode()

        return self.jobs.get(tuple(row)[:JOB_WIDTH], build)  # the job's columns only, not those after them

    def job_list(self, rows: Sequence[AnyRow], next_cursor: str | None) -> bytes:
        """``JobList`` of the rows, as pydantic serializes it (compact, in field order)."""
        items = b",".join(self.job(row)[1] for row in rows)
        return b'{"items":[' + items + b'],"next_cursor":' + _CURSOR.dump_json(next_cursor) + b"}"

    def trial_list(self, rows: Sequence[AnyRow]) -> bytes:
        """``TrialList`` of ``service.repositories.trials.TRIAL_ROW`` rows."""
        items = b",".join(self.trials.get(tuple(row), _trial_line(row)) for row in rows)
        return b'{"items":[' + items + b"]}"


def _trial_line(row: AnyRow) -> Callable[[], bytes]:
    return lambda: trial_out(trial_of_row(row)).model_dump_json().encode()


_CURSOR: TypeAdapter[str | None] = TypeAdapter(str | None)


def job_url(job_id: str) -> str:
    return f"{API}/jobs/{job_id}"


def cluster_url(cluster_id: str) -> str:
    return f"{API}/clusters/{cluster_id}"


def error(data: dict[str, Any] | None) -> ErrorDetail | None:
    if not data:
        return None
    return ErrorDetail(message=str(data.get("message", "")), field=data.get("field"), fix=data.get("fix"))


def job_out(job: Job) -> JobOut:
    url = job_url(job.id)
    progress = dict(job.progress or {})
    progress.setdefault("max_trials", int(job.options.get("max_trials", 0)))
    progress["tuning_s"] = job.tuning_s
    return JobOut(
        id=job.id, url=url, name=job.name, state=job.state,  # type: ignore[arg-type]
        cluster_id=job.cluster_id, model=job.model, training=job.training,
        budget={k: v for k, v in job.options.items() if k != "stack"}, stack=job.options.get("stack", DEFAULT_STACK),
        created_at=job.created_at, updated_at=job.updated_at, started_at=job.started_at,
        finished_at=job.finished_at, cancel_requested=job.cancel_requested, attempts=job.attempts,
        progress=Progress(**progress), best=BestSummary(**job.best) if job.best else None,
        stop_reason=job.stop_reason, error=error(job.error),
        links=JobLinks(self=url, trials=f"{url}/trials", best=f"{url}/best", plan=f"{url}/plan",
                       events=f"{url}/events", cancel=f"{url}/cancel"),
    )


def trial_fields(trial: Trial) -> dict[str, Any]:
    """A trial's figures from its columns (its record is read only for one trial)."""
    measured, predicted = trial.measured_step_time, trial.predicted_step_time
    return {
        "number": trial.number, "state": trial.state, "label": trial.label, "config": trial.config,
        "predicted_step_time": predicted, "analytic_step_time": trial.analytic_step_time,
        "predicted_peak_bytes": trial.predicted_peak_bytes, "measured_step_time": measured,
        "tokens_per_s": trial.tokens_per_s, "peak_memory_bytes": trial.peak_memory_bytes,
        "prediction_error": (measured - predicted) / predicted if measured and predicted else None,
        "error": trial.error, "attempt": trial.attempt, "runs": trial.runs,
        "started_at": trial.started_at, "ended_at": trial.ended_at, "duration_s": trial.duration_s,
    }


def trial_out(trial: Trial) -> TrialOut:
    return TrialOut(**trial_fields(trial))


def trial_detail(trial: Trial) -> TrialDetail:
    return TrialDetail(**trial_fields(trial), steps=list(trial.steps or []), record=trial.record,
                       attempts=list(trial.attempts or []))


def profile_out(profile: Profile) -> ProfileOut:
    return ProfileOut(
        id=profile.id, cluster_id=profile.cluster_id, url=f"{cluster_url(profile.cluster_id)}/profiles/{profile.id}",
        state=profile.state,  # type: ignore[arg-type]
        created_at=profile.created_at, started_at=profile.started_at, finished_at=profile.finished_at,
        error=error(profile.error), profile=profile.profile,
    )


def lease_out(lease: Lease | None) -> LeaseOut:
    busy = bool(lease and lease.holder and lease.expires_at and lease.expires_at > utcnow())
    return LeaseOut(
        busy=busy, job_id=lease.job_id if busy and lease else None,
        profile_id=lease.profile_id if busy and lease else None,
        expires_at=lease.expires_at if busy and lease else None,
        served_at=lease.served_at if lease else None,
    )


def unserved_notice(job_state: str, cluster: Cluster | None, lease: Lease | None) -> str | None:
    """Why a queued job does not start, when the reason is that no scheduler serves its
    cluster's devices: none holds their lease and none has polled it for a while."""
    if job_state != "queued" or cluster is None:
        return None
    now = utcnow()
    if lease is not None and lease.holder and lease.expires_at and lease.expires_at > now:
        return None  # busy: the job waits its turn
    if lease is not None and lease.served_at and (now - lease.served_at).total_seconds() < UNSERVED_AFTER_S:
        return None
    seen = "never" if lease is None or lease.served_at is None else f"not in the last {UNSERVED_AFTER_S:.0f} s"
    how = ("run `pipette serve` on this host" if cluster.kind == "local" else
           f"run `RAY_ADDRESS=ray://HEAD:10001 pipette-admin worker` (or `pipette serve`) with RAY_ADDRESS naming "
           f"this cluster's head ({cluster.address})")
    return (f"no scheduler serves this cluster's devices ({cluster.resource}): one looked for work on them {seen}; "
            f"{how}")


def cluster_out(cluster: Cluster, lease: Lease | None, latest: Profile | None) -> ClusterOut:
    return ClusterOut(
        id=cluster.id, url=cluster_url(cluster.id), name=cluster.name, kind=cluster.kind,  # type: ignore[arg-type]
        address=cluster.address, nodes=list(cluster.nodes or []), devices_per_node=cluster.devices_per_node,
        created_at=cluster.created_at, lease=lease_out(lease),
        latest_profile=profile_out(latest) if latest else None,
    )
