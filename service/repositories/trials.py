"""Trials: one row per (job, number), written as the tuner reports, read back to resume.

A trial that was running when its service died is rerun under the same number, so the row is
replaced (``runs`` counts the starts), never duplicated. Its ended attempts' records are the
service's trial store (``SqlTrialStore``, the ``pipette.trials.TrialStore`` the CLI's JSON-lines
file implements too); the columns copy their figures for the lists.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import Text, cast, func, select
from sqlalchemy.orm import Session

from pipette.errors import PipetteError, StoreError
from pipette.trials import TrialRecord
from service.errors import NotFoundError
from service.models import Cluster, Job, Trial, utcnow
from service.repositories.jobs import AnyRow


def start_trial(
    session: Session, job_id: str, number: int, *, label: str, config: dict[str, Any],
    predicted_step_time: float | None, attempt: int = 1,
) -> Trial:
    """An attempt starts. Attempt 1 starts the trial over (a rerun after an interruption drops
    the unfinished run's attempts); a retry keeps the earlier attempts."""
    trial = get_row(session, job_id, number)
    now = utcnow()
    if trial is None:
        trial = Trial(job_id=job_id, number=number, runs=1, attempts=[])
        session.add(trial)
    else:
        trial.runs += 1
    if attempt <= 1:
        trial.attempts = []
    trial.state = "running"
    trial.label = label
    trial.config = config
    trial.predicted_step_time = predicted_step_time
    trial.attempt = attempt
    trial.measured_step_time = trial.analytic_step_time = trial.tokens_per_s = None
    trial.predicted_peak_bytes = trial.peak_memory_bytes = None
    trial.error = None
    trial.steps = []
    trial.record = None
    trial.started_at = now
    trial.ended_at = None
    trial.duration_s = None
    session.flush()
    return trial


def add_step(session: Session, job_id: str, number: int, step: dict[str, Any]) -> None:
    trial = get_row(session, job_id, number)
    if trial is not None:
        trial.steps = [*trial.steps, step]


def end_trial(session: Session, job_id: str, record: TrialRecord) -> Trial:
    """Keep an ended attempt (``SqlTrialStore.append``): its record, with every step time, joins
    the row's attempts, and the row's columns take its figures (a list reads no record)."""
    trial = get_row(session, job_id, record.number)
    now = utcnow()
    if trial is None:  # ended without a start report (a resumed job's replayed end)
        trial = Trial(job_id=job_id, number=record.number, runs=1, started_at=record.started_at or now, steps=[],
                      label=record.label, config=record.config.to_dict())
        session.add(trial)
    # the attempt's own times; the row's where the record has none (made outside the tuner)
    stored = replace(record, started_at=record.started_at or trial.started_at, ended_at=record.ended_at or now)
    m = stored.measurement
    trial.attempts = [*(trial.attempts or []), stored.to_dict()]
    trial.record = stored.to_dict()
    trial.state = m.status
    trial.measured_step_time = m.step_time
    trial.tokens_per_s = m.tokens_per_s
    trial.peak_memory_bytes = m.peak_memory_max
    trial.error = m.error or None
    trial.analytic_step_time = stored.analytic_step_time
    trial.predicted_peak_bytes = stored.predicted_peak_bytes
    trial.attempt = stored.attempt
    trial.predicted_step_time = stored.predicted_step_time
    trial.ended_at = now
    trial.duration_s = (now - trial.started_at).total_seconds()
    session.flush()
    return trial


def interrupt_trial(session: Session, job_id: str, number: int) -> None:
    trial = get_row(session, job_id, number)
    if trial is not None and trial.record is None:
        trial.state = "interrupted"
        trial.ended_at = utcnow()


def interrupt_running(session: Session, job_id: str) -> list[int]:
    """Mark the trials a dead holder left running as interrupted (they will be rerun)."""
    rows = session.execute(select(Trial).where(Trial.job_id == job_id, Trial.state == "running")).scalars().all()
    for trial in rows:
        trial.state = "interrupted"
        trial.ended_at = utcnow()
    return [t.number for t in rows]


def end_running(session: Session, job_id: str, state: str, error: str) -> list[int]:
    """End the trials of an ending job still marked running (its runner raised mid-trial, so
    the tuner never reported their end): no trial outlives its job."""
    rows = session.execute(select(Trial).where(Trial.job_id == job_id, Trial.state == "running")).scalars().all()
    now = utcnow()
    for trial in rows:
        trial.state, trial.error, trial.ended_at = state, error, now
        trial.duration_s = (now - trial.started_at).total_seconds()
    return [t.number for t in rows]


def interrupted_numbers(session: Session, job_id: str) -> list[int]:
    """The trials of the job that were stopped before their end and will run again."""
    return list(session.execute(
        select(Trial.number).where(Trial.job_id == job_id, Trial.state == "interrupted").order_by(Trial.number)
    ).scalars())


def get_row(session: Session, job_id: str, number: int) -> Trial | None:
    return session.execute(
        select(Trial).where(Trial.job_id == job_id, Trial.number == number)
    ).scalar_one_or_none()


def get_trial(session: Session, job_id: str, number: int) -> Trial:
    trial = get_row(session, job_id, number)
    if trial is None:
        raise NotFoundError(f"no trial {number} in this job", field="number",
                            fix="use a number from GET /v1/jobs/{id}/trials")
    return trial


def list_trials(session: Session, job_id: str) -> Sequence[Trial]:
    return session.execute(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)).scalars().all()


#: The columns a trial's line in a list (``service.views.trial_fields``) is made of, its config
#: as text: a row keys the answer cache (``service.answers``) before anything is decoded.
TRIAL_ROW = (Trial.job_id, Trial.number, Trial.state, Trial.label, cast(Trial.config, Text).label("config"),
             Trial.predicted_step_time, Trial.analytic_step_time, Trial.predicted_peak_bytes,
             Trial.measured_step_time, Trial.tokens_per_s, Trial.peak_memory_bytes, Trial.error, Trial.attempt,
             Trial.runs, Trial.started_at, Trial.ended_at, Trial.duration_s)


def list_tenant_trial_rows(session: Session, tenant: str, job_id: str) -> Sequence[AnyRow]:
    """The trials of ``tenant``'s job ``job_id`` (``TRIAL_ROW`` rows) in one query, without
    loading the job (the trials list is a hot read: the job row's JSON columns were decoded only to check its
    tenant); a job without trials costs one more query, to tell it from a missing job."""
    key = job_id.lower()  # ids are lower-case UUIDs; the path accepts either case
    rows = session.execute(
        select(*TRIAL_ROW).join(Job, Job.id == Trial.job_id).where(Job.id == key, Job.tenant == tenant)
        .order_by(Trial.number)
    ).all()
    if not rows and session.execute(select(Job.id).where(Job.id == key, Job.tenant == tenant)).first() is None:
        # Another tenant's job answers exactly like a missing one.
        raise NotFoundError(f"no job {job_id!r}", field="job_id", fix="use an id from GET /v1/jobs")
    return rows


def trial_of_row(row: AnyRow) -> Trial:
    """A transient trial of a ``TRIAL_ROW`` row (its config decoded), for ``service.views``."""
    data = dict(row._mapping)
    data["config"] = None if data["config"] is None else json.loads(data["config"])
    return Trial(**data)


class SqlTrialStore:
    """The service's trial store (``pipette.trials.TrialStore``): the ended attempts of one job,
    in its rows of the trials table, within the caller's session (its transaction).

    ``records`` is the job's history when it resumes: a trial that was running or interrupted
    is left out, so the tuner proposes it again under its number."""

    def __init__(self, session: Session, job_id: str) -> None:
        self.session = session
        self.job_id = job_id

    def append(self, record: TrialRecord) -> None:
        end_trial(self.session, self.job_id, record)

    def records(self, job_key: str | None = None) -> list[TrialRecord]:
        rows = self.session.execute(
            select(Trial.number, Trial.attempts, Trial.started_at, Trial.ended_at).where(
                Trial.job_id == self.job_id, Trial.record.is_not(None),
                Trial.state.not_in(("running", "interrupted")),
            ).order_by(Trial.number)
        ).all()
        out = [r for row in rows for r in _attempts(self.job_id, row.number, row.attempts or [], row.started_at,
                                                     row.ended_at)]
        return out if job_key is None else [r for r in out if r.job_key == job_key]

    def find(self, label: str, job_key: str | None = None) -> list[TrialRecord]:
        return [r for r in self.records(job_key) if r.label == label]

    def count(self) -> int:
        return len(self.records())


def row_record(trial: Trial) -> TrialRecord | None:
    """The record of a trial row's last ended attempt (None while it runs or after an interruption)."""
    if trial.record is None:
        return None
    return _parse(trial.record, trial.job_id, trial.number, trial.started_at, trial.ended_at)


def prior_records(session: Session, resource: str, exclude_job: str, limit: int = 500) -> list[TrialRecord]:
    """Recorded trials of other jobs (of Pipette's runner) on the same devices, newest first:
    what the tuner learns from before this job's first trial."""
    rows = session.execute(
        select(Trial.job_id, Trial.number, Trial.record, Trial.started_at, Trial.ended_at)
        .join(Job, Trial.job_id == Job.id).join(Cluster, Job.cluster_id == Cluster.id)
        .where(Cluster.resource == resource, Trial.job_id != exclude_job, Trial.record.is_not(None),
               Job.script.is_(None))  # a user's script's trials measure that script, not Pipette's runner
        .order_by(Trial.ended_at.desc()).limit(limit)
    ).all()
    return [_parse(r.record, r.job_id, r.number, r.started_at, r.ended_at) for r in rows if r.record]


def _attempts(job_id: str, number: int, attempts: list[dict[str, Any]], started: datetime | None,
              ended: datetime | None) -> list[TrialRecord]:
    last = len(attempts) - 1
    return [_parse(a, job_id, number, started if i == last else None, ended if i == last else None, attempt=i + 1)
            for i, a in enumerate(attempts)]


def _parse(data: dict[str, Any], job_id: str, number: int, started: datetime | None, ended: datetime | None,
           attempt: int | None = None) -> TrialRecord:
    """A stored record, typed; the row's times stand for the last attempt's where a record
    written before records kept their own has none."""
    try:
        record = TrialRecord.from_dict(data)
    except PipetteError as e:
        which = f"attempt {attempt} of trial {number}" if attempt is not None else f"trial {number}"
        why = e.message if e.field == "trial" else f"{e.field}: {e.message}"
        raise StoreError(
            f"the record of {which} is not a trial record ({why})", field=f"job {job_id}",
            fix=f"restore the trials row from a backup, or delete it (job_id '{job_id}', number {number}) so that "
                "the job reruns that trial when it resumes") from None
    return replace(record, started_at=record.started_at or started, ended_at=record.ended_at or ended)


def counts_by_state(session: Session) -> dict[str, int]:
    rows = session.execute(select(Trial.state, func.count()).group_by(Trial.state)).all()
    return {str(state): int(n) for state, n in rows}


def durations(session: Session) -> list[float]:
    rows = session.execute(select(Trial.duration_s).where(Trial.duration_s.is_not(None))).scalars().all()
    return [float(d) for d in rows if d is not None]
