"""Jobs: submit (202), list with filters and cursor pages, read, cancel, trials, the best
result (JSON and downloadable launch files) and the full plan."""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse
from sqlalchemy.orm import Session

from pipette.clusterfile import cluster_from_dict
from pipette.config import ParallelConfig
from pipette.emit import deepspeed_config, hostfile, rank_map
from pipette.model import ModelSpec
from pipette.plan import check_recipe
from pipette.registry import TrialKind, check_job_runs, job_kind, script_from_record
from pipette.stacks import Stack, stacks_key
from pipette.training import TrainingSpec
from service.deps import AppState, Caller, State
from service.errors import NotFoundError
from service.models import Cluster, Job, Profile
from service.repositories import clusters as cluster_repo
from service.repositories import jobs as repo
from service.repositories import trials as trial_repo
from service.repositories.jobs import AnyRow
from service.repositories.quotas import check_room, serialize_tenant
from service.routes import AUTHED, errors, json_errors
from service.schemas import (
    ID_PATTERN,
    NAME_PATTERN,
    BestOut,
    JobAccepted,
    JobIn,
    JobList,
    JobOut,
    TrialDetail,
    TrialList,
)
from service.scripts import check_allowed, script_parts, stored
from service.specs import model_spec, training_spec, tune_options
from service.views import as_json, job_out, job_url, json_bytes, trial_detail, trial_out, unserved_notice

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
T = TypeVar("T")

JobState = Literal["queued", "profiling", "planning", "running", "succeeded", "failed", "cancelled"]
FileName = Literal["ds_config.json", "hostfile", "launch.sh", "rank_map.json", "candidate.json",
                   "accelerate_config.yaml", "launch-deepspeed.sh", "launch-torchrun.sh", "launch-accelerate.sh",
                   "fsdp_config.json", "torchtitan.toml"]
JobId = Annotated[str, Path(max_length=36, pattern=ID_PATTERN, description="the job's id")]
TrialNumber = Annotated[int, Path(ge=0, le=2**31 - 1)]


@router.post("", status_code=202, response_model=JobAccepted, responses=errors(*AUTHED, 404, 429))
def submit_job(body: JobIn, state: State, caller: Caller, response: Response) -> JobAccepted:
    """Queue a tuning job; it runs when its cluster's devices are free (see the job's state)."""
    model = model_spec(body.model)
    training = training_spec(body.training)
    check_recipe(model, training)  # at submit, not when planning starts (issue 17, item 14)
    tune_options(body.budget.model_dump())  # what the schema cannot check (a reserve below max_trials)
    script, files = script_parts(body.script)
    kind = job_kind(body.stack, script)
    with state.db.write() as session:
        # First, so the cluster read next is not one a concurrent delete is taking away.
        serialize_tenant(session, caller.tenant)
        cluster = cluster_repo.get_cluster(session, caller.tenant, body.cluster)
        check_allowed(cluster, caller.tenant, kind)
        check_job_runs(model, training, _device_kind(session, cluster), kind.script, script_hint="`script:`",
                       plan_hint="`POST /v1/plan`")
        check_room(session, caller.tenant, state.settings.max_queued_per_tenant)
        job = repo.create_job(
            session, tenant=caller.tenant, cluster=cluster, name=body.name, model=model.to_dict(),
            training=training.to_dict(), options={**body.budget.model_dump(), "stack": stacks_key(kind.stacks)},
        )
        job.script, job.script_files = stored(kind.script), files
        accepted = JobAccepted(id=job.id, url=job_url(job.id), state=job.state)
    state.kick()
    response.headers["Location"] = accepted.url
    return accepted


def _device_kind(session: Session, cluster: Cluster) -> str | None:
    """The kind of the cluster's devices as last measured (None before its first profile)."""
    latest = cluster_repo.latest_profile(session, cluster.id)
    devices = (latest.profile or {}).get("devices") if latest is not None else None
    if not devices or not isinstance(devices[0], dict):
        return None
    return str((devices[0].get("spec") or {}).get("kind", "gpu"))


@router.get("", response_model=JobList, responses=errors(*AUTHED, 404))
async def list_jobs(
    state: State,
    caller: Caller,
    job_state: Annotated[list[JobState] | None, Query(alias="state", description="repeat to allow several")] = None,
    cluster: Annotated[str | None, Query(max_length=200, pattern=NAME_PATTERN,
                                         description="a cluster id or name")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=36, pattern=ID_PATTERN,
                                        description="next_cursor of the previous page")] = None,
) -> Response:
    # Polled: answered from memory while no job or cluster of the tenant changed (service.changes)
    key = ("jobs", caller.tenant, tuple(job_state or ()), cluster, limit, cursor)
    return json_bytes(await _polled(state, key, _list_jobs, state, caller.tenant, key, job_state or (), cluster,
                                    limit, cursor))


async def _polled(state: AppState, key: tuple[Any, ...], load: Callable[..., T], *args: Any) -> T:
    """A polled read's answer from memory (``service.changes``), else ``load(*args)`` in a worker
    thread (it queries, and keeps what it built under ``key``)."""
    found: T | None = state.reads.get(key)
    return found if found is not None else await run_in_threadpool(load, *args)


def _list_jobs(state: AppState, tenant: str, key: tuple[Any, ...], states: Sequence[str], cluster: str | None,
               limit: int, cursor: str | None) -> bytes:
    stamp = state.feed.stamp((f"tenant:{tenant}", f"clusters:{tenant}"))
    with state.db.read() as session:
        cluster_id = cluster_repo.get_cluster(session, tenant, cluster).id if cluster else None
        page, after = repo.list_job_rows(session, tenant, states=states, cluster_id=cluster_id, limit=limit,
                                         cursor=cursor)
    body = state.answers.job_list(page, after)
    state.reads.put(key, stamp, body)
    return body


@router.get("/{job_id}", response_model=JobOut, responses=errors(*AUTHED, 404))
async def read_job(job_id: JobId, state: State, caller: Caller) -> Response:
    key = ("job", caller.tenant, job_id.lower())
    out, body, row = await _polled(state, key, _read_job, state, caller.tenant, job_id, key)
    # a queued job's notice depends on the clock too: worked out per read, from the cached lease
    notice = unserved_notice(row.state, *repo.served_by(row)) if row.state == "queued" else None
    return json_bytes(body) if notice is None else as_json(out.model_copy(update={"notice": notice}))


def _read_job(state: AppState, tenant: str, job_id: str, key: tuple[str, ...]) -> tuple[JobOut, bytes, AnyRow]:
    # the lease's key is stamped before the query too, whatever the job's state turns out to be
    stamp = state.feed.stamp((f"job:{job_id.lower()}", "leases"))
    with state.db.read() as session:
        row = repo.job_row(session, tenant, job_id)
    out, body = state.answers.job(row)
    if stamp is not None and row.state != "queued":  # only a queued job's notice reads the lease
        stamp = stamp.only(1)
    state.reads.put(key, stamp, (out, body, row))
    return out, body, row


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut, responses=errors(*AUTHED, 404, 409))
def cancel_job(job_id: JobId, state: State, caller: Caller) -> JobOut:
    """A queued job is cancelled at once; a running one stops within a step (its trial is pruned)."""
    with state.db.write() as session:
        job = repo.request_cancel(session, caller.tenant, job_id)
        return job_out(job)


@router.get("/{job_id}/trials", response_model=TrialList, responses=errors(*AUTHED, 404))
async def list_trials(job_id: JobId, state: State, caller: Caller) -> Response:
    key = ("trials", caller.tenant, job_id.lower())
    return json_bytes(await _polled(state, key, _list_trials, state, caller.tenant, job_id, key))


def _list_trials(state: AppState, tenant: str, job_id: str, key: tuple[str, ...]) -> bytes:
    stamp = state.feed.stamp((f"trials:{job_id.lower()}", f"job:{job_id.lower()}"))
    with state.db.read() as session:
        rows = trial_repo.list_tenant_trial_rows(session, tenant, job_id)
    body = state.answers.trial_list(rows)
    state.reads.put(key, stamp, body)
    return body


@router.get("/{job_id}/trials/{number}", response_model=TrialDetail, responses=errors(*AUTHED, 404))
def read_trial(job_id: JobId, number: TrialNumber, state: State, caller: Caller) -> Response:
    with state.db.read() as session:
        job = repo.get_job(session, caller.tenant, job_id)
        return as_json(trial_detail(trial_repo.get_trial(session, job.id, number)))


@router.get("/{job_id}/plan", response_model=dict[str, Any], responses=errors(*AUTHED, 404))
def read_plan(job_id: JobId, state: State, caller: Caller) -> Response:
    """Every candidate with its estimates, and every dropped one with its reason."""
    with state.db.read() as session:
        job = repo.get_job(session, caller.tenant, job_id)
        if job.plan is None:
            raise NotFoundError(f"the job has no plan yet (it is {job.state})", field="job_id",
                                fix="wait until the job is past planning (GET /v1/jobs/{id})")
        return JSONResponse(job.plan)


@router.get("/{job_id}/best", response_model=BestOut, responses=errors(*AUTHED, 404))
def read_best(job_id: JobId, state: State, caller: Caller) -> BestOut:
    """The best configuration so far: its DeepSpeed config, launch command and placement."""
    with state.db.read() as session:
        job = repo.get_job(session, caller.tenant, job_id)
        best = _best_parts(session, job)
    url = job_url(job_id)
    kind: TrialKind = best["kind"]
    stack = _best_stack(kind, best)
    names = _file_names(best, kind, stack)
    ds: dict[str, Any] | None = None  # none for a job that runs no DeepSpeed (the fsdp stack, an FSDP script)
    if "ds_config.json" in names:
        ds = kind.ds_config(deepspeed_config(best["training"], best["config"], model=best["model"]))
    command = kind.launch_command(best["config"], best["cluster"], stack, names)
    return BestOut(
        job_id=job_id, trial=trial_out(best["trial"]), config=best["config"].to_dict(), ds_config=ds,
        launch_command=command,
        hostfile=hostfile(best["config"], best["cluster"]), rank_map=rank_map(best["config"], best["cluster"]),
        files={name: f"{url}/best/files/{name}" for name in names},
    )


def _best_stack(kind: TrialKind, best: dict[str, Any]) -> Stack:
    """The stack that ran the best candidate (its own, in a job over several stacks)."""
    return next((s for s in kind.stacks if s.key == best["config"].stack), kind.stack)


def _file_names(best: dict[str, Any], kind: TrialKind, stack: Stack) -> tuple[str, ...]:
    """The launch files of the best configuration (``pipette.registry``: the trial kind's)."""
    return kind.launch_files(best["model"], best["training"], best["config"], best["cluster"], stack)


@router.get("/{job_id}/best/files/{name}", response_class=PlainTextResponse, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}, "application/json": {"schema": {}}},
          "description": "the file, as an attachment (JSON for the .json files)"},
    **json_errors(*AUTHED, 404),
})
def download_best_file(job_id: JobId, name: FileName, state: State, caller: Caller) -> PlainTextResponse:
    """One launch file of the best configuration, exactly as ``pipette plan --out`` writes it."""
    with state.db.read() as session:
        job = repo.get_job(session, caller.tenant, job_id)
        best = _best_parts(session, job)
    kind: TrialKind = best["kind"]
    stack = _best_stack(kind, best)
    if name not in _file_names(best, kind, stack):
        raise NotFoundError(f"{name} is not a file of {kind.what}", field="name",
                            fix="use a name from the files of GET /v1/jobs/{id}/best")
    extra = {"job_id": job_id, "trial": best["trial"].number}
    with tempfile.TemporaryDirectory(prefix="pipette-best-") as tmp:
        written = kind.write_launch_files(tmp, best["model"], best["training"], best["config"], best["cluster"],
                                          stack, extra)
        text = pathlib.Path(written[name]).read_text()
    media = "application/json" if name.endswith(".json") else "text/plain"
    return PlainTextResponse(text, media_type=media,
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})


def _best_parts(session: Session, job: Job) -> dict[str, Any]:
    if not job.best:
        raise NotFoundError(f"the job has no successful trial yet (it is {job.state})", field="job_id",
                            fix="wait for a trial to end ok (GET /v1/jobs/{id}/trials)")
    profile = session.get(Profile, job.profile_id) if job.profile_id else None
    if profile is None or profile.profile is None:
        raise NotFoundError("the job's cluster profile is gone", field="job_id", fix="rerun the job")
    trial = trial_repo.get_trial(session, job.id, int(job.best["trial"]))
    return {
        "trial": trial, "config": ParallelConfig.from_dict(job.best["config"]),
        "model": ModelSpec.from_dict(job.model), "training": TrainingSpec.from_dict(job.training),
        "cluster": cluster_from_dict(profile.profile),
        # the launches run the script where the user's copy is: its working directory's name
        "kind": job_kind(job.options.get("stack"), script_from_record(job.script, workdir=None)),
    }
