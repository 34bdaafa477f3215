"""The tuning loop: plan, trial the most promising candidate for real, learn, stop, emit.

``Tuner`` drives an Optuna study whose sampler is ``pipette.search.PerfModelSampler``; trials run
through a ``TrialRunner`` (the workers' Ray executor in a real job, ``workers.host.runner.RayTrialRunner``;
recorded measurements in the replay benchmark). Every finished attempt becomes a ``TrialRecord``;
the records are the one source of truth: a ``Tuner`` built with ``history=`` rebuilds the same study
(``optuna.trial.create_trial``) and goes on, so a restarted service resumes a job without a second store.

The Tuner composes parts with one job each, in the spirit of Optuna's samplers, pruners and
terminators: the search step (``pipette.search_step``: one attempt of a trial, its events, its
Optuna trial), the stop rule (``pipette.stop_rule``), re-timing before the verdict
(``pipette.retiming``), the retry policy (``pipette.retry``), and how sure the pick is
(``pipette.verdict``); its options are ``pipette.tune_options.TuneOptions`` and what it hands back
``pipette.tune_result.TuneResult``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import optuna
from optuna.trial import TrialState

from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError
from pipette.fits import default_prior
from pipette.learned import NOISE_PRIOR_DOF, Observation, Prediction, noise_floor_sd
from pipette.model import ModelSpec
from pipette.plan import Plan, Planned
from pipette.registry import job_key_fields
from pipette.retiming import RetimeBudget, contenders, round_order
from pipette.retry import RETRY, RetryPolicy, deferred, retries_of
from pipette.search import (
    RECORD_ATTR,
    IncumbentPruner,
    PerfModelSampler,
    Scored,
    candidate_params,
    incumbent_step_time,
    measured_means,
    new_study,
    params_key,
    search_space,
)
from pipette.search_step import OnStep as OnStep
from pipette.search_step import Reporter, attempt_record, finished_trial, outcome, replay, run_attempt
from pipette.search_step import StepProgress as StepProgress
from pipette.search_step import TrialRunner as TrialRunner
from pipette.search_step import TuneEvent as TuneEvent
from pipette.stacks import Stack, get_stacks
from pipette.stop_rule import StopRule, Untried, script_fault
from pipette.stop_rule import chance_any_beats as chance_any_beats  # re-exported: the API the tests know
from pipette.training import TrainingSpec
from pipette.trials import TrialRecord as TrialRecord  # re-exported: the records' home is pipette.trials
from pipette.trials import tensor_peak_bytes as tensor_peak_bytes
from pipette.tune_options import TuneOptions as TuneOptions
from pipette.tune_result import STOPPED
from pipette.tune_result import TuneResult as TuneResult
from pipette.tune_result import how_it_ended as how_it_ended  # re-exported: the CLI says how trials ended
from pipette.tune_result import trial_outcomes as trial_outcomes  # re-exported: result_text counts them
from pipette.verdict import Tried, first_predictions, pick, verdict

Emit = Callable[[TuneEvent], None]


def job_key(model: ModelSpec, training: TrainingSpec,
            stack: str | Stack | Sequence[str | Stack] | None = None) -> str:
    """Identifies what is tuned (model, recipe and stack, or stacks: ``pipette,fsdp``): trials of the
    same key share the most. The default stack keeps the key it had before stacks existed, so its
    stored trials still match."""
    what: dict[str, Any] = {"model": model.to_dict(), "training": training.to_dict(),
                            **job_key_fields(get_stacks(stack))}
    text = json.dumps(what, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cluster_key(plan: Plan) -> str:
    """Identifies a cluster across profiles (its nodes and devices, not the noisy links)."""
    c = plan.cluster
    text = json.dumps([c.name, [n.name for n in c.nodes], [(d.node, d.local_index, d.spec.name) for d in c.devices]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Tuner:
    """One job's search (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        options: TuneOptions | None = None,
        *,
        history: Sequence[TrialRecord] = (),
        prior: Sequence[TrialRecord] = (),
        runnable: Callable[[ParallelConfig], list[str]] | None = None,
    ) -> None:
        self.plan = plan
        self.options = options or TuneOptions()
        self.job_key = job_key(plan.model, plan.training, plan.all_stacks)
        self.stack = plan.stack_key
        self.candidates, self.unrunnable = _runnable_candidates(plan, runnable)
        self.space = search_space([*plan.ranked, *(_as_planned(r) for r in history)])
        self.sampler = PerfModelSampler(
            # another stack's trials measure other code: they never teach this one
            self.candidates, job_key=self.job_key,
            prior=_prior_observations(prior, plan),
            tolerance=self.options.tolerance, seed=self.options.seed, space=self.space,
            fits_prior=plan.fits_prior or default_prior(plan.cluster.device_spec.kind),
            noise_floor=noise_floor_sd(plan.cluster.device_spec.kind),
        )
        pruner = IncumbentPruner(self.options.prune_slower) if self.options.prune else None
        self.study = new_study(self.sampler, pruner)
        self.budget = RetimeBudget(self.options, plan.cluster.device_spec.kind)
        self.stop_rule = StopRule(self.options, self.budget.reserve, self.candidates)
        self.records = replay(self.study, history, self.space)
        self._replayed = len(self.records)  # the records before this run (``script_fault`` reads after them)
        #: re-timing done by this tuner so far (every ``retime`` call: the verdict names all)
        self._retimed: set[str] = {r.label for r in self.records if r.purpose == "retime"}
        self._rounds = 0
        self._started = time.monotonic()

    def stack_of(self, config: ParallelConfig) -> str:
        """The stack that runs ``config`` (its own in a plan over several): what its record says."""
        return self.plan.stack_of(config).key

    # ---- state ----------------------------------------------------------------------
    @property
    def best(self) -> TrialRecord | None:
        """The pick (``verdict.pick``): the best mean log step time over its ok trials."""
        return pick(self.records, measured_means(self.study))

    def tried(self) -> Tried | None:
        """The tried candidates against the pick under the measured noise; None without a pick."""
        pick = self.best
        if pick is None:
            return None
        learned = self.sampler.learned(self.study)
        return Tried(pick.label, measured_means(self.study), learned.trial_noise_sd,
                     NOISE_PRIOR_DOF + learned.noise_dof, self.options.tolerance, first_predictions(self.records))

    def confidence(self) -> float | None:
        """Probability that the pick is within the tolerance of the best candidate tried."""
        tried = self.tried()
        return None if tried is None else tried.confidence()

    def untried(self) -> Untried | None:
        """The untried candidates against the pick (``stop_rule.Untried``); None before an ok trial."""
        return None if self.best is None else Untried(self.ranking())

    def confidence_overall(self) -> float | None:
        """Probability that the pick is within the tolerance of the best candidate, tried or not:
        ``confidence`` times the chance that no untried one beats it, as if independent."""
        tried, untried = self.confidence(), self.untried()
        return None if tried is None or untried is None else tried * (1.0 - untried.chance())

    def contenders(self) -> list[str]:
        """The pick and the candidates to re-time it against (``pipette.retiming.contenders``)."""
        return contenders(self.tried(), self.options)

    def ranking(self) -> list[Scored]:
        return self.sampler.ranking(self.study)

    def stop_reason(self, elapsed_s: float = 0.0) -> str | None:
        """Why the search should stop now (``pipette.stop_rule``), or None to go on."""
        spent = self.script_fault() or self.stop_rule.budget_spent(
            len(self.study.trials), self.best is not None, elapsed_s)
        if spent is not None:
            return spent
        ranked, best = self.ranking(), self.best
        stop = (self.stop_rule.nothing_left(self.records) if not ranked else
                self.stop_rule.converged(ranked, None if best is None else best.label, len(measured_means(self.study))))
        return None if stop is not None and _due_retry(self, not ranked) is not None else stop  # retry first

    def script_fault(self) -> str | None:
        """A failure of the user's script in this run (not a stored record's) that stops the search."""
        return script_fault(self.records[self._replayed:])

    def result(self, stop_reason: str, interrupted: bool = False) -> TuneResult:
        pick, untried = self.best, self.untried()
        mean = measured_means(self.study).get(pick.label) if pick is not None else None
        return TuneResult(self.plan, tuple(self.records), stop_reason, pick, interrupted, self.unrunnable,
                          self.confidence(), self.confidence_overall(), self.sampler.learned(self.study).summary(),
                          self.options.tolerance, self.options.confidence,
                          math.exp(mean[0]) if mean else None, mean[1] if mean else 0, self.trials_to_decide(),
                          runnable=len(self.candidates),
                          untried_to_try=None if untried is None else untried.to_try(self.options.stop_probability),
                          untried_likeliest=None if untried is None else untried.likeliest())

    def trials_to_decide(self) -> dict[str, int | None]:
        """Per tried candidate the pick is not yet sure against: more trials of each that would
        decide it (``verdict.Tried.trials_to_decide``)."""
        tried = self.tried()
        return {} if tried is None else tried.trials_to_decide(self.options.confidence)

    # ---- the loop -------------------------------------------------------------------
    def run(self, runner: TrialRunner, on_event: Emit | None = None,
            should_stop: Callable[[], bool] | None = None) -> TuneResult:
        """Trial candidates until the stop rule says stop, re-time, and search on while the repeats
        reopen the search; Ctrl-C stops the running trial (the runner cleans up) and returns what was
        measured, with ``interrupted`` set."""
        emit = on_event or (lambda event: None)
        self._started = time.monotonic()
        reason: str | None = None
        interrupted = False
        try:
            while True:
                reason = self._search(runner, emit, should_stop)
                if reason == "cancelled" or reason.startswith("time budget") \
                        or self.script_fault() is not None:
                    break
                before = len(self.study.trials)
                reason = self.retime(runner, reason, emit, should_stop)
                # The repeats measured the trial-to-trial noise: when it is larger than the
                # stop rule assumed, an untried candidate may again have a chance: search on.
                if reason == "cancelled" or len(self.study.trials) == before \
                        or self.stop_reason(self._elapsed()) is not None:
                    break
        except KeyboardInterrupt:
            interrupted = True
            reason = "interrupted (Ctrl-C); the running trial was stopped and not recorded"
        emit(TuneEvent("stopped", None, {"reason": reason, "best": None if self.best is None else self.best.label}))
        return self.result(reason or "stopped", interrupted)

    def _search(self, runner: TrialRunner, emit: Emit, should_stop: Callable[[], bool] | None) -> str:
        """Search steps until the stop rule says stop, or "cancelled"."""
        while True:
            if should_stop is not None and should_stop():
                return "cancelled"
            reason = self.stop_reason(self._elapsed())
            if reason is not None:
                return reason
            if self.step(runner, emit, should_stop) == "cancelled":
                return "cancelled"

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def retime(self, runner: TrialRunner, reason: str, emit: Emit = lambda event: None,
               should_stop: Callable[[], bool] | None = None) -> str:
        """Re-time the contenders (``pipette.retiming``) and return the stop reason with the
        verdict; "cancelled" when ``should_stop`` said so."""
        rounds = 0
        first_seen: list[str] = []
        # Past ``retime_rounds``, rounds go on while the pick is below the confidence asked, the budget
        # has room and the search would not reopen: a load spike in the last round once moved a real
        # pick to a candidate timed once, "23% sure" with trials left (issue 32, item 9).
        while rounds < self.options.retime_rounds or self._undecided():
            budget = self.options.time_budget_s
            if budget is not None and self._elapsed() >= budget:
                break
            # The best contenders (the pick first) the round's size and the budget have room for; the
            # pick alone is re-timed in the first round only (its repeat measures the noise).
            room = self.options.max_trials - len(self.study.trials)
            round_ = self.contenders()[:min(room, self.budget.round_size)]
            if not round_ or (len(round_) == 1 and rounds > 0):
                break
            self._retimed.update(round_)
            for label in round_order(first_seen, round_, rounds):
                if self._retime_trial(label, runner, emit, should_stop) == "cancelled":
                    return "cancelled"
            rounds += 1
            self._rounds += 1
        return verdict(reason, self.tried(), len(self._retimed), self._rounds)

    def _undecided(self) -> bool:
        """The pick is below the confidence asked, and the search would not reopen."""
        return ((confidence := self.confidence()) is not None and confidence < self.options.confidence
                and self.stop_reason(self._elapsed()) is not None)

    def _retime_trial(self, label: str, runner: TrialRunner, emit: Emit,
                      should_stop: Callable[[], bool] | None) -> str:
        """One re-timing trial of a candidate already tried: no retries, no pruning."""
        planned = next(p for p in self.candidates if p.config.label == label)
        prediction = self.sampler.learned(self.study).predict(planned.config, planned.perf)
        number = len(self.study.trials)
        m, cancelled, started = run_attempt(runner, planned, prediction, number, 1, "retime", emit, should_stop,
                                            lambda p: False)
        if cancelled:
            return "cancelled"  # not recorded: a cut-short re-timing says nothing
        record = attempt_record(number, planned, prediction, m, 1, self.job_key, self.stack_of(planned.config),
                                started, "retime")
        self.study.add_trial(finished_trial(record, self.space))
        self.records.append(record)
        emit(TuneEvent("trial_ended", number, record.to_dict(), record))
        return m.status

    def step(self, runner: TrialRunner, emit: Emit = lambda event: None,
             should_stop: Callable[[], bool] | None = None) -> str:
        """Run one trial, or a crash's retry that is due (``pipette.retry``); its final status or "cancelled"."""
        learned = self.sampler.learned(self.study)
        if (retry := _due_retry(self)) is not None:
            self.study.enqueue_trial(candidate_params(retry.config))
        trial = self.study.ask(fixed_distributions=self.space)
        try:
            planned = self.sampler.by_key[params_key(trial.params)]
        except KeyError:
            self.study.tell(trial, state=TrialState.FAIL)
            raise InfeasibleError("the sampler proposed no candidate", field="plan",
                                  fix="report this: the stop rule should have ended the search") from None
        prediction = learned.predict(planned.config, planned.perf)
        trial.set_user_attr("tokens_per_step", self.plan.training.tokens_per_step)
        try:
            record, cancelled = self._attempts(trial, planned, prediction, runner, emit, should_stop,
                                               "search" if retry is None else RETRY)
        except BaseException:
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        state, value, constraints = outcome(record.measurement)
        for key, v in constraints.items():
            trial.set_constraint(key, v)
        trial.set_user_attr(RECORD_ATTR, record.to_dict())
        self.study.tell(trial, value, state=state)
        return "cancelled" if cancelled else record.measurement.status

    def _attempts(self, trial: optuna.Trial, planned: Planned, prediction: Prediction, runner: TrialRunner,
                  emit: Emit, should_stop: Callable[[], bool] | None, purpose: str) -> tuple[TrialRecord, bool]:
        """A trial's attempts until the retry policy says done: its last record, and whether cancelled."""
        policy = RetryPolicy(self.options.retries - retries_of(self.records, planned.config.label))
        report = Reporter(trial, self.plan.training.tokens_per_step, self.options.prune)
        attempt = 0
        while True:
            attempt += 1
            m, cancelled, started = run_attempt(runner, planned, prediction, trial.number, attempt, purpose, emit,
                                                should_stop, report)
            if cancelled:
                m = replace(m, status="pruned", error=STOPPED)
            record = attempt_record(trial.number, planned, prediction, m, attempt, self.job_key,
                                    self.stack_of(planned.config), started, purpose)
            after, record = policy.after(record, self.records, cancelled)
            self.records.append(record)
            emit(TuneEvent("trial_ended", trial.number, record.to_dict(), record))
            if after == "done":
                return record, cancelled
            report.prune = report.prune and after != "rerun"


def _due_retry(tuner: Tuner, nothing_left: bool | None = None) -> TrialRecord | None:
    """The crash whose retry is due now (``pipette.retry``): a trial of another candidate ran since
    (or nothing else is left: ``not tuner.ranking()`` where not given), and its candidate, if it
    runs, is predicted faster than the best measured (any, before one)."""
    pending = deferred(tuner.records)
    if pending and nothing_left is None and not all(ran_since for _, ran_since in pending):
        nothing_left = not tuner.ranking()
    waiting = [r for r, ran_since in pending if ran_since or nothing_left]
    if not waiting:
        return None
    learned, best = tuner.sampler.learned(tuner.study), incumbent_step_time(tuner.study)
    for r in waiting:
        planned = tuner.sampler.by_key.get(params_key(candidate_params(r.config)))
        # a resumed job's record may name a candidate this plan no longer holds: not retried
        if planned is not None and (best is None or learned.predict(planned.config, planned.perf).step_time < best):
            return r
    return None


def _runnable_candidates(
    plan: Plan, runnable: Callable[[ParallelConfig], list[str]] | None
) -> tuple[list[Planned], Counter[str]]:
    """The plan's candidates the trial backend can run, and why the others cannot."""
    unrunnable: Counter[str] = Counter()
    candidates: list[Planned] = []
    for p in plan.ranked:
        reasons = runnable(p.config) if runnable is not None else []
        unrunnable.update(reasons)
        if not reasons:
            candidates.append(p)
    if not candidates:
        raise InfeasibleError(
            f"none of the {len(plan.ranked)} candidates that fit can be run by the trial backend: "
            + "; ".join(f"{r} ({n})" for r, n in unrunnable.most_common(3)),
            field="training", fix="allow the schedules/ZeRO stages the backend runs (see the reasons)",
            reasons=dict(unrunnable),
        )
    return candidates, unrunnable


def _prior_observations(prior: Sequence[TrialRecord], plan: Plan) -> list[Observation]:
    """Other jobs' trials on this cluster that teach this plan: those of its stacks only (another
    stack's trials measure other code). Each is the candidate of the stack it ran on: named in a
    plan over several stacks (the learned model's stack task), unnamed in a plan of one."""
    several = len(plan.all_stacks) > 1
    keys = {s.key for s in plan.all_stacks}
    out = []
    for r in prior:
        if r.job_key == "" or r.stack not in keys or r.measurement.details.script_fault:
            continue  # a fault of the script says nothing of its candidate
        o = r.observation()
        out.append(replace(o, config=replace(o.config, stack=r.stack if several else None)))
    return out


def _as_planned(r: TrialRecord) -> Planned:
    return Planned(r.config, r.memory, r.perf, r.perf.step_time)
