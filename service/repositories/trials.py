"""Trials: one row per (job, number), written as the tuner reports, read back to resume.

A trial that was running when its service died is rerun under the same number, so the row is
replaced (``runs`` counts the starts), never duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.errors import NotFoundError
from service.models import Cluster, Job, Trial, utcnow


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


def end_trial(session: Session, job_id: str, number: int, record: dict[str, Any]) -> Trial:
    """Store the tuner's ``TrialRecord`` dict (measurement with every step time)."""
    trial = get_row(session, job_id, number)
    now = utcnow()
    config = record.get("config") or {}
    if trial is None:  # ended without a start report (a resumed job's replayed end)
        trial = Trial(job_id=job_id, number=number, runs=1, started_at=now, steps=[],
                      label=str(record.get("label", "")), config=config)
        session.add(trial)
    measurement = record.get("measurement") or {}
    trial.attempts = [*(trial.attempts or []), record]
    trial.record = record
    trial.state = str(measurement.get("status", "failed"))
    trial.measured_step_time = _number(measurement.get("step_time"))
    trial.tokens_per_s = _number(measurement.get("tokens_per_s"))
    peaks = [int(x) for x in measurement.get("peak_memory") or []]
    trial.peak_memory_bytes = max(peaks) if peaks else None
    trial.error = str(measurement.get("error") or "") or None
    trial.analytic_step_time = _number(record.get("analytic_step_time"))
    peak = record.get("predicted_peak_bytes")
    trial.predicted_peak_bytes = int(peak) if peak is not None else None
    trial.attempt = int(record.get("attempt", trial.attempt or 1))
    if record.get("predicted_step_time") is not None:
        trial.predicted_step_time = float(record["predicted_step_time"])
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


def finished_records(session: Session, job_id: str) -> list[dict[str, Any]]:
    """Every attempt of the job's ended trials, in order: the tuner's history when it resumes.
    A trial that was running or interrupted is left out, so the tuner proposes it again."""
    rows = session.execute(
        select(Trial.attempts).where(
            Trial.job_id == job_id, Trial.record.is_not(None), Trial.state.not_in(("running", "interrupted"))
        ).order_by(Trial.number)
    ).scalars().all()
    return [dict(a) for attempts in rows for a in (attempts or [])]


def prior_records(session: Session, resource: str, exclude_job: str, limit: int = 500) -> list[dict[str, Any]]:
    """Recorded trials of other jobs (of Pipette's runner) on the same devices, newest first:
    what the tuner learns from before this job's first trial."""
    rows = session.execute(
        select(Trial.record).join(Job, Trial.job_id == Job.id).join(Cluster, Job.cluster_id == Cluster.id)
        .where(Cluster.resource == resource, Trial.job_id != exclude_job, Trial.record.is_not(None),
               Job.script.is_(None))  # a user's script's trials measure that script, not Pipette's runner
        .order_by(Trial.ended_at.desc()).limit(limit)
    ).scalars().all()
    return [dict(r) for r in rows if r]


def counts_by_state(session: Session) -> dict[str, int]:
    rows = session.execute(select(Trial.state, func.count()).group_by(Trial.state)).all()
    return {str(state): int(n) for state, n in rows}


def durations(session: Session) -> list[float]:
    rows = session.execute(select(Trial.duration_s).where(Trial.duration_s.is_not(None))).scalars().all()
    return [float(d) for d in rows if d is not None]


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
