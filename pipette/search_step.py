"""One step of the search, as the runner and Optuna see it: the progress a runner reports
(``StepProgress``), the events a tuner emits (``TuneEvent``), one attempt of a trial run through a
``TrialRunner`` (``run_attempt``), and a finished trial as Optuna stores it (``finished_trial``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.learned import Prediction
from pipette.measurement import Measurement
from pipette.plan import Planned
from pipette.search import RECORD_ATTR, candidate_params
from pipette.trials import TrialRecord


@dataclass(frozen=True)
class StepProgress:
    """One step of a running trial, as the runner sees it."""

    step: int
    time: float
    warmup: bool
    loss: float | None = None


#: Called by a runner after every step; returning True stops the trial (``pruned``).
OnStep = Callable[[StepProgress], bool]


class TrialRunner(Protocol):
    def __call__(self, config: ParallelConfig, on_step: OnStep) -> Measurement: ...


@dataclass(frozen=True)
class TuneEvent:
    kind: str  # trial_started | trial_step | trial_ended | stopped
    trial: int | None
    data: dict[str, Any]
    #: the attempt's record, on trial_ended (``data`` is its ``to_dict``)
    record: TrialRecord | None = None


Emit = Callable[[TuneEvent], None]
ShouldStop = Callable[[], bool] | None


def run_attempt(
    runner: TrialRunner, planned: Planned, prediction: Prediction, number: int, attempt: int, purpose: str,
    emit: Emit, should_stop: ShouldStop, report: OnStep,
) -> tuple[Measurement, bool, datetime]:
    """Run one attempt of trial ``number``, emitting its start and steps; ``report`` sees every step
    and may prune it. Returns the measurement, whether ``should_stop`` stopped it, and its start."""
    emit(TuneEvent("trial_started", number, {
        "label": planned.config.label, "config": planned.config.to_dict(), "attempt": attempt,
        **({"purpose": purpose} if purpose != "search" else {}),
        "predicted_step_time": prediction.step_time, "analytic_step_time": planned.perf.step_time,
    }))
    cancelled = False

    def on_step(p: StepProgress) -> bool:
        nonlocal cancelled
        emit(TuneEvent("trial_step", number, {"step": p.step, "time": p.time, "warmup": p.warmup, "loss": p.loss}))
        if should_stop is not None and should_stop():
            cancelled = True
            return True
        return report(p)

    started = now()
    m = runner(planned.config, on_step)
    # the runner may ask between steps and stop a trial with no step yet: cancelled too
    stopped = m.status == "pruned" and should_stop is not None and should_stop()
    return m, cancelled or stopped, started


def attempt_record(
    number: int, planned: Planned, prediction: Prediction, m: Measurement, attempt: int, job_key: str, stack: str,
    started: datetime, purpose: str = "search",
) -> TrialRecord:
    """The record of one ended attempt (its end: now)."""
    return TrialRecord(number, planned.config, m, planned.perf, planned.memory, prediction.step_time,
                       prediction.sd, attempt, job_key, purpose, stack, started, now())


class Reporter:
    """Reports a trial's timed steps to Optuna (tokens/s, numbered across its attempts) and asks
    its pruner; a rerun after a lost node is measured in full (its first steps follow the node's
    restart: pruning them against the incumbent would judge the cluster)."""

    def __init__(self, trial: optuna.Trial, tokens_per_step: float, prune: bool) -> None:
        self.trial, self.tokens_per_step, self.prune = trial, tokens_per_step, prune
        self.reported = 0

    def __call__(self, p: StepProgress) -> bool:
        if p.warmup or p.time <= 0:
            return False
        self.trial.report(self.tokens_per_step / p.time, step=self.reported)
        self.reported += 1
        return self.prune and self.trial.should_prune()


def outcome(m: Measurement) -> tuple[TrialState, float | None, dict[str, float]]:
    """Optuna state, value (tokens/s) and constraints (positive = infeasible) of a trial."""
    if m.status == "pruned":
        return TrialState.PRUNED, None, {}
    if m.status == "ok":
        return TrialState.COMPLETE, float(m.tokens_per_s or 0.0), {"memory": 0.0, "runs": 0.0}
    if m.status == "oom":
        return TrialState.COMPLETE, 0.0, {"memory": 1.0, "runs": 0.0}
    return TrialState.COMPLETE, 0.0, {"memory": 0.0, "runs": 1.0}


def finished_trial(record: TrialRecord, space: dict[str, BaseDistribution]) -> FrozenTrial:
    """The trial of ``record`` (its last attempt) as Optuna stores it, to add to a study."""
    m = record.measurement
    state, value, constraints = outcome(m)
    params = candidate_params(record.config)
    return optuna.trial.create_trial(
        state=state, value=value, params=params, distributions={k: space[k] for k in params},
        user_attrs={RECORD_ATTR: record.to_dict()}, constraints=constraints,
        intermediate_values={i: m.tokens_per_step / t for i, t in enumerate(m.step_times) if t > 0},
    )


def replay(
    study: optuna.Study, history: Sequence[TrialRecord], space: dict[str, BaseDistribution]
) -> list[TrialRecord]:
    """Add a job's finished trials (``history``: every attempt's record) to ``study``, as they were;
    returns the records in order."""
    by_number: dict[int, list[TrialRecord]] = {}
    for r in sorted(history, key=lambda r: (r.number, r.attempt)):
        by_number.setdefault(r.number, []).append(r)
    records: list[TrialRecord] = []
    for number in sorted(by_number):
        if number != len(study.trials):
            raise SpecError(f"trial records jump to number {number} after {len(study.trials)} trials",
                            field="history", fix="pass every finished trial of the job, numbered from 0")
        study.add_trial(finished_trial(by_number[number][-1], space))
        records.extend(by_number[number])
    return records


def now() -> datetime:
    return datetime.now(UTC)
