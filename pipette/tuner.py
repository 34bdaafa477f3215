"""The tuning loop: plan, trial the most promising candidate for real, learn, stop, emit.

``Tuner`` drives an Optuna study whose sampler is ``pipette.search.PerfModelSampler``;
trials run through a ``TrialRunner`` (the workers' Ray executor in a real job,
``workers.host.runner.RayTrialRunner``; recorded measurements in the replay benchmark). Every
finished attempt becomes a ``TrialRecord``; the records are the one source of truth: a
``Tuner`` built with ``history=`` rebuilds the same study (``optuna.trial.create_trial``)
and goes on, so a restarted service resumes a job without a second store.

Stop rule: stop searching when at least ``MIN_OK_TO_CONVERGE`` candidates ran ok and the
untried candidates together have less than ``stop_probability`` chance that one of them beats
the incumbent's measured step time by more than ``tolerance`` (and fits and runs) under the
learned model (``chance_any_beats``), or when every candidate still worth a trial was tried,
or at the trial or time budget.

Re-time before the verdict: before the tuner hands back its pick, it and the ``retime`` - 1
candidates tried so far that it is least sure to be within ``tolerance`` of are run again,
interleaved (each round runs every contender once, in alternating order, so that drift on
the machine hits them alike), until the pick is within ``tolerance`` of every contender with
probability ``confidence`` or the rounds or the budget run out (``max_trials // 4`` trials,
at least 2 and at most ``retime``, are kept from the search for this, or ``reserve``; on a
CPU cluster two rounds or more where the budget allows: ``TuneOptions.reserve_for``).
When the repeats show more trial-to-trial noise than the stop rule assumed, an untried
candidate may have a chance again: the search goes on, and re-times again before it stops.
The pick is the candidate with the best mean log step time over its ok trials, and the result
says how sure it is (``Tuner.confidence``): the probability, under the measured
trial-to-trial noise (Student-t while its repeats are few: ``Tuner._pairwise``), that the pick
is within ``tolerance`` of the best candidate tried; and
(``Tuner.confidence_overall``) that it is within ``tolerance`` of every candidate, the untried
ones under the learned model.
A trial that fails for another reason than memory (``failed``, ``timeout``) is retried
``retries`` times at most, then recorded as failed; the search goes on. A crash is retried
only while this job's retries of its kind (``crash_kind``: the status and the error's exception
line) ran at least as often as they crashed again (``retry_chance``): the first retry of a
kind that crashes again makes it the candidate's own failure, not the machine's, and it is
not retried again (in the replay every crash is the candidate's: Ultra-Scale's pipeline-16
runs). A trial that failed because the cluster lost a node (``Measurement.lost_nodes``)
is rerun without using a retry, ``LOST_NODE_RETRIES`` times at most: the runner waits for the
node before the rerun, and the rerun is not pruned (its first steps follow the node's restart).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import optuna
from optuna.trial import TrialState
from scipy.stats import t as student_t

from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError, SpecError
from pipette.feasibility import measured_need
from pipette.fits import default_prior, memory_headroom
from pipette.learned import NOISE_PRIOR_DOF, Observation
from pipette.measurement import Measurement, last_error_line
from pipette.model import ModelSpec
from pipette.options import check_values, default
from pipette.plan import Plan, Planned
from pipette.search import (
    RECORD_ATTR,
    IncumbentPruner,
    PerfModelSampler,
    Scored,
    candidate_params,
    measured_means,
    new_study,
    params_key,
    search_space,
)
from pipette.stacks import DEFAULT_STACK, Stack, get_stacks, stacks_key
from pipette.training import TrainingSpec
from pipette.trials import TrialRecord as TrialRecord  # re-exported: the records' home is pipette.trials
from pipette.trials import tensor_peak_bytes as tensor_peak_bytes

T = TypeVar("T")

#: beyond this many more trials of each, ``trials_to_decide`` says none would decide
MAX_TRIALS_TO_DECIDE = 50
#: reruns of one trial that failed because a node was lost (beyond ``TuneOptions.retries``)
LOST_NODE_RETRIES = 2
#: a crash is retried when the chance that a retry of its kind runs (``retry_chance``) is at
#: least this: a retry costs one trial, as the next candidate would, and is worth it when it
#: is at least as likely as not to run.
RETRY_MIN_CHANCE = 0.5
#: "converged" needs this many candidates that ran ok: with fewer, the learned model has too
#: little to fit and is over-confident (replay benchmark: on Ultra-Scale the tuner stopped
#: after one ok trial on a pick 2.7x slower than the best; mean regret at its stop 3.4% -> 0.7%
#: with 3). 4, with the hyperparameters averaged (``pipette.learned``): under a distorted prior
#: three ok trials in two tp regimes still called an untried one hopeless (vTrain groups on
#: 8 GPUs stopped with 8-27% regret, the best at the untried tp 4);
#: regret at stop 2.91 -> 2.11% and 3.95 -> 2.68% (seeds 1, 2), 0.17 -> 0.16% on the visible
#: tables, for one more trial at the median (docs/results.md, 2026-11-25).
MIN_OK_TO_CONVERGE = 4


def _option(name: str, kind: type[T]) -> T:
    """The default of option ``name`` (``pipette.options``) as a field of ``kind`` (None: unset)."""
    value = default(name)
    if value is not None and type(value) is not kind:
        raise TypeError(f"option {name} defaults to {value!r}, not a {kind.__name__}")
    return cast(T, value)


#: the most of a CPU job's budget ``TuneOptions.reserve_for`` keeps for re-timing rounds
NOISY_RESERVE_SHARE = 0.4


@dataclass(frozen=True)
class TuneOptions:
    """The search's options; their defaults, bounds and help are ``pipette.options``'."""

    max_trials: int = _option("max_trials", int)
    time_budget_s: float | None = _option("time_budget_s", float)
    tolerance: float = _option("tolerance", float)
    stop_probability: float = _option("stop_probability", float)
    prune: bool = _option("prune", bool)
    #: prune when even the trial's best step is this much slower than the incumbent
    prune_slower: float = _option("prune_slower", float)
    retries: int = _option("retries", int)
    seed: int = _option("seed", int)
    #: contenders re-timed before the verdict (0 or 1: no re-timing), and at most this many rounds
    retime: int = _option("retime", int)
    retime_rounds: int = _option("retime_rounds", int)
    #: stop re-timing once the pick is this sure to be within ``tolerance`` of the best tried
    confidence: float = _option("confidence", float)
    #: trials kept from the search for re-timing (None: ``retime_reserve``'s default)
    reserve: int | None = _option("reserve", int)

    def __post_init__(self) -> None:
        check_values({f.name: getattr(self, f.name) for f in fields(self)})
        if self.reserve is not None and not self.reserve < self.max_trials:
            raise SpecError(f"is {self.reserve} of max_trials {self.max_trials}", field="budget.reserve",
                            fix=f"keep 0 to {self.max_trials - 1} trials for re-timing (the rest search), "
                                "or raise max_trials")

    @classmethod
    def from_values(cls, values: Mapping[str, object]) -> TuneOptions:
        """The search's options among ``values`` (a job's budget, the command line's options);
        the others (``steps``, ``margin``, ...) are the runner's and the plan's."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})  # type: ignore[arg-type]  # __post_init__ checks

    @property
    def retime_reserve(self) -> int:
        """Trials kept from the search for re-timing on a GPU: ``reserve`` when given, else a
        quarter of the budget, at least 2 and at most one round (``retime``). A larger reserve
        costs the search: in the replay (trial noise 2%) a reserve of 5 of 20 trials (rounds of 3,
        at most 3 rounds) raised the regret at stop on distorted seeds 2 and 3 from 1.21 / 1.71%
        to 2.10 / 2.68%; on a noisy machine, ``for_search`` gives the rounds room on top instead."""
        if self.retime < 2 or self.retime_rounds < 1:
            return 0
        if self.reserve is not None:
            return self.reserve
        if self.max_trials < 4:
            return 0
        return min(self.retime, max(2, self.max_trials // 4))

    def reserve_for(self, device_kind: str) -> int:
        """``retime_reserve`` for trials on ``device_kind``, or the rounds ``noisy_rounds`` keeps where
        they are more."""
        size, rounds = self.noisy_rounds(device_kind)
        return max(self.retime_reserve, size * rounds)

    def round_size(self, device_kind: str) -> int:
        """Contenders a re-timing round takes at most (the pick among them)."""
        size, rounds = self.noisy_rounds(device_kind)
        return size if rounds else self.retime

    def noisy_rounds(self, device_kind: str) -> tuple[int, int]:
        """(contenders a round, rounds) the default keeps for re-timing on CPU devices, (0, 0) where
        it keeps ``retime_reserve`` (a GPU, a given ``reserve``, no re-timing). CPU trials share cores
        with everything else on the host and spread ~8% from run to run (GPU trials ~2%): one round
        cannot order candidates a few percent apart, so there the default keeps whole rounds of
        ``retime`` in up to ``NOISY_RESERVE_SHARE`` of the budget where that makes two rounds or
        more, else two rounds or more of the pick and one contender in up to half of it (budgets of
        8 to 14). Replays of the recorded CPU run behind both: docs/results.md (2026-11-28: budget
        24, 3.04% -> 1.64% mean regret at stop; 2026-12-02: budget 8, 4.87% -> 3.29%)."""
        if device_kind != "cpu" or self.reserve is not None or self.retime_reserve == 0:
            return 0, 0
        rounds = min(self.retime_rounds, int(NOISY_RESERVE_SHARE * self.max_trials) // self.retime)
        if rounds >= 2:
            return self.retime, rounds
        pairs = min(self.retime_rounds, self.max_trials // 2 // 2)
        return (2, pairs) if pairs >= 2 else (0, 0)

    @classmethod
    def for_search(cls, search_trials: int, **kwargs: Any) -> TuneOptions:
        """Options for a search of ``search_trials`` trials with every re-timing round on top
        (``retime`` x ``retime_rounds`` trials): the budget of a benchmark that counts the
        candidates tried, on a machine whose trial-to-trial noise needs the rounds."""
        probe = cls(**kwargs)
        reserve = probe.retime * probe.retime_rounds if probe.retime >= 2 else 0
        return cls(max_trials=search_trials + reserve, reserve=reserve, **kwargs)


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


@dataclass
class TuneResult:
    plan: Plan
    trials: tuple[TrialRecord, ...]
    stop_reason: str
    best: TrialRecord | None
    interrupted: bool = False
    unrunnable: Counter[str] = field(default_factory=Counter)
    #: probability that ``best`` is within the tolerance of the best candidate tried
    confidence: float | None = None
    #: probability that it is within the tolerance of every candidate, tried or not: ``confidence``
    #: times the chance that no untried candidate beats it by more (``Tuner.confidence_overall``)
    confidence_overall: float | None = None
    #: how much the learned model trusted the analytic prior, and the noise it measured
    learned: dict[str, float | int] = field(default_factory=dict)
    tolerance: float = 0.02
    #: the confidence asked (``TuneOptions.confidence``): below it the verdict is undecided
    confidence_asked: float = 0.9
    #: the pick's measured step time as it was picked: the geometric mean (the mean of the log,
    #: ``measured_means``) over its ok trials, and how many there were
    pick_step_time: float | None = None
    pick_trials: int = 0
    #: per contender the pick is not yet ``confidence_asked`` sure against: more trials of each
    #: that would decide it at the noise measured (``Tuner.trials_to_decide``; None: none would)
    to_decide: dict[str, int | None] = field(default_factory=dict)
    #: what else ran on the machine during the trials (``pipette.cli.interference``)
    interference: dict[str, Any] = field(default_factory=dict)
    #: the candidates the trial backend (or the script) can run: those the search chose from
    runnable: int = 0
    #: how many of the likeliest untried candidates to try before the rest together have less than
    #: ``stop_probability`` chance to beat the pick (``Tuner.untried_to_try``); None before an ok trial
    untried_to_try: int | None = None
    #: the untried candidate likeliest to beat the pick by more than the tolerance, and that chance
    untried_likeliest: tuple[str, float] | None = None

    @property
    def decided(self) -> bool:
        return self.confidence is not None and self.confidence >= self.confidence_asked

    def to_dict(self) -> dict[str, Any]:
        """The result as data; ``pipette.result_text.result_dict`` adds its ``summary`` in words."""
        best = None
        if self.best is not None:
            b, m = self.best, self.best.measurement
            best = {
                **b.to_dict(),
                "side_by_side": {
                    "step_time_s": {"analytic": b.analytic_step_time, "learned": b.predicted_step_time,
                                    "measured": self.pick_step_time or m.step_time,
                                    "measured_trials": self.pick_trials or 1},
                    "tokens_per_s": {"analytic": b.perf.tokens_per_s, "measured": m.tokens_per_s},
                    # like with like: the estimate's tensors against the measured tensor peak; the
                    # process overhead (interpreter, CUDA context, fragmentation) apart
                    "peak_memory_bytes": {"predicted": b.memory.live_bytes, "measured": m.peak_memory_max,
                                          "predicted_overhead": b.memory.breakdown.get("overhead", 0)},
                },
            }
        return {
            "decided": self.decided, "confidence_asked": self.confidence_asked,
            "to_decide": dict(self.to_decide), "interference": dict(self.interference),
            "outcomes": trial_outcomes(self.trials),
            "stop_reason": self.stop_reason, "interrupted": self.interrupted,
            "trials_run": len({t.number for t in self.trials}), "attempts": len(self.trials),
            "candidates": len(self.plan.ranked), "enumerated": self.plan.enumerated,
            "unrunnable": dict(self.unrunnable), "confidence": self.confidence,
            "confidence_overall": self.confidence_overall, "tolerance": self.tolerance,
            "untried_to_try": self.untried_to_try,
            "untried_likeliest": None if self.untried_likeliest is None else
            {"label": self.untried_likeliest[0], "chance": self.untried_likeliest[1]},
            "learned": dict(self.learned),
            "retimed": sum(1 for t in self.trials if t.purpose == "retime"),
            "best": best, "trials": [t.to_dict() for t in self.trials],
            "memory_headroom": self.memory_headroom(),
            "out_of_memory_trials": sum(1 for t in self.trials if t.measurement.status == "oom"),
        }

    def launch_files(self, out_dir: str | Path) -> dict[str, Path]:
        """The best candidate's DeepSpeed config, hostfile, rank map and launch script."""
        from pipette.emit import write_launch_files

        if self.best is None:
            raise InfeasibleError(
                f"no trial succeeded ({self.stop_reason})", field="job",
                fix="look at the trials' errors; allow more trials or more memory headroom",
            )
        p = self.plan
        return write_launch_files(out_dir, p.model, p.training, self.best.config, p.cluster,
                                  stack=p.stack_of(self.best.config),
                                  extra={"tuning": {"stop_reason": self.stop_reason,
                                                    "best": self.to_dict()["best"]["side_by_side"]},
                                         "memory_headroom": self.memory_headroom()})

    def memory_headroom(self) -> dict[str, Any] | None:
        """How close to the device's memory the pick runs, from its trial's measured need."""
        if self.best is None:
            return None
        prior = self.plan.fits_prior or default_prior(self.plan.cluster.device_spec.kind)
        return memory_headroom(self.best.memory, prior, measured_need(self.best.memory, self.best.measurement))


#: The error of a trial the tuner stopped because it was told to (``should_stop``: Ctrl-C, SIGTERM,
#: a job's cancel); its status is ``pruned``, as Optuna counts it.
STOPPED = "cancelled"


def how_it_ended(m: Measurement) -> str:
    """A trial's status as said to a user: ``interrupted`` for one stopped from outside, which says
    nothing of its speed (it read "pruned", counted "stopped early (slower than the best)"); else
    its status."""
    return "interrupted" if m.status == "pruned" and m.error == STOPPED else m.status


def trial_outcomes(trials: Sequence[TrialRecord]) -> dict[str, int]:
    """Trials by how they ended (the last attempt of each; ``how_it_ended``), re-timing trials apart."""
    last: dict[int, TrialRecord] = {}
    for r in trials:
        if r.number not in last or r.attempt >= last[r.number].attempt:
            last[r.number] = r
    counts = Counter(("retime " if r.purpose == "retime" else "") + how_it_ended(r.measurement)
                     for r in last.values())
    return dict(sorted(counts.items()))


def job_key(model: ModelSpec, training: TrainingSpec,
            stack: str | Stack | Sequence[str | Stack] | None = None) -> str:
    """Identifies what is tuned (model, recipe and stack, or stacks: ``pipette,fsdp``): trials of the
    same key share the most. The default stack keeps the key it had before stacks existed, so its
    stored trials still match."""
    key = stacks_key(get_stacks(stack))
    what: dict[str, Any] = {"model": model.to_dict(), "training": training.to_dict()}
    if key != DEFAULT_STACK:
        what["stack"] = key
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
        self.unrunnable: Counter[str] = Counter()
        candidates: list[Planned] = []
        for p in plan.ranked:
            reasons = runnable(p.config) if runnable is not None else []
            self.unrunnable.update(reasons)
            if not reasons:
                candidates.append(p)
        if not candidates:
            raise InfeasibleError(
                f"none of the {len(plan.ranked)} candidates that fit can be run by the trial backend: "
                + "; ".join(f"{r} ({n})" for r, n in self.unrunnable.most_common(3)),
                field="training", fix="allow the schedules/ZeRO stages the backend runs (see the reasons)",
                reasons=dict(self.unrunnable),
            )
        self.candidates = candidates
        self.space = search_space([*plan.ranked, *(_as_planned(r) for r in history)])
        self.sampler = PerfModelSampler(
            # another stack's trials measure other code: they never teach this one
            candidates, job_key=self.job_key,
            prior=_prior_observations(prior, plan),
            tolerance=self.options.tolerance, seed=self.options.seed, space=self.space,
            fits_prior=plan.fits_prior or default_prior(plan.cluster.device_spec.kind),
        )
        pruner = IncumbentPruner(self.options.prune_slower) if self.options.prune else None
        self.study = new_study(self.sampler, pruner)
        self.records: list[TrialRecord] = []
        self._replay(history)
        self._replayed = len(self.records)  # the records before this run (``script_fault`` reads after them)
        #: re-timing done by this tuner so far (every ``retime`` call: the verdict names all)
        self._retimed: set[str] = {r.label for r in self.records if r.purpose == "retime"}
        self._rounds = 0
        self._started = time.monotonic()

    def stack_of(self, config: ParallelConfig) -> str:
        """The stack that runs ``config`` (its own in a plan over several): what its record says."""
        return self.plan.stack_of(config).key

    # ---- the study, rebuilt from records ------------------------------------------------
    def _replay(self, history: Sequence[TrialRecord]) -> None:
        by_number: dict[int, list[TrialRecord]] = {}
        for r in sorted(history, key=lambda r: (r.number, r.attempt)):
            by_number.setdefault(r.number, []).append(r)
        for number in sorted(by_number):
            if number != len(self.study.trials):
                raise SpecError(
                    f"trial records jump to number {number} after {len(self.study.trials)} trials",
                    field="history", fix="pass every finished trial of the job, numbered from 0",
                )
            attempts = by_number[number]
            final = attempts[-1]
            state, value, constraints = _outcome(final.measurement)
            steps = _intermediate(final.measurement)
            self.study.add_trial(optuna.trial.create_trial(
                state=state, value=value, params=candidate_params(final.config),
                distributions={k: self.space[k] for k in candidate_params(final.config)},
                user_attrs={RECORD_ATTR: final.to_dict()}, constraints=constraints, intermediate_values=steps,
            ))
            self.records.extend(attempts)

    # ---- state ----------------------------------------------------------------------
    @property
    def best(self) -> TrialRecord | None:
        """The pick: the candidate with the best mean log step time over its ok trials (its
        trial with the median step time stands for it)."""
        means = measured_means(self.study)
        if not means:
            return None
        label = min(means, key=lambda k: (means[k][0], k))
        ok = sorted((r for r in self._ok_records() if r.label == label),
                    key=lambda r: (r.measurement.step_time or math.inf, r.number))
        return ok[(len(ok) - 1) // 2]

    def _ok_records(self) -> list[TrialRecord]:
        return [r for r in self.records if r.measurement.status == "ok" and r.measurement.step_time]

    def _pairwise(self) -> dict[str, float]:
        """Per other tried candidate: the probability that the pick is within the tolerance
        of it (its mean log step time less than ``log(1 + tolerance)`` above the other's),
        under the measured trial-to-trial noise.

        That noise is itself estimated, from few repeats: its posterior (a scaled inverse-chi^2
        with the prior's and the repeats' degrees of freedom, ``learned.trial_noise``) makes the
        difference of two means Student-t, not normal (Gelman et al., *Bayesian Data Analysis*,
        3rd ed., sec. 3.2: the marginal posterior of a normal mean with unknown variance), with
        heavier tails while the repeats are few."""
        gaps, dof = self._gaps_to_pick()
        margin = math.log(1.0 + self.options.tolerance)
        return {label: float(student_t.cdf((gap + margin) / se, dof)) for label, (gap, se) in gaps.items()}

    def _faster_chance(self) -> dict[str, float]:
        """Per other tried candidate: the probability that it is faster than the pick at all
        (its true mean log step time below the pick's), under the noise of ``_pairwise``."""
        gaps, dof = self._gaps_to_pick()
        return {label: float(student_t.cdf(-gap / se, dof)) for label, (gap, se) in gaps.items()}

    def _gaps_to_pick(self) -> tuple[dict[str, tuple[float, float]], float]:
        """Per other tried candidate: its mean log step time minus the pick's, and the standard
        error of that difference under the measured trial-to-trial noise; and the noise's
        degrees of freedom (empty without a pick)."""
        pick = self.best
        if pick is None:
            return {}, float(NOISE_PRIOR_DOF)
        means = measured_means(self.study)
        learned = self.sampler.learned(self.study)
        mp, n_p = means[pick.label]
        return {label: (m - mp, learned.trial_noise_sd * math.sqrt(1.0 / n_p + 1.0 / n))
                for label, (m, n) in means.items() if label != pick.label}, NOISE_PRIOR_DOF + learned.noise_dof

    def confidence(self) -> float | None:
        """Probability that the pick is within the tolerance of the best candidate tried."""
        if self.best is None:
            return None
        return math.prod(self._pairwise().values())

    def untried_chance(self) -> float | None:
        """The chance that an untried candidate beats the pick by more than the tolerance (and
        fits and runs), under the learned model (``chance_any_beats``); None before an ok trial."""
        if self.best is None:
            return None
        return chance_any_beats([s.p_beat for s in self.ranking()])

    def untried_to_try(self) -> int | None:
        """How many more trials, of the untried candidates likeliest to beat the pick, would leave the
        others together under ``stop_probability`` (the stop rule's "converged") if none of them did
        beat it; each trial also teaches the model, so this is what to plan for, not a promise."""
        if self.best is None:
            return None
        chances = sorted((s.p_beat for s in self.ranking()), reverse=True)
        k = 0
        while k < len(chances) and chance_any_beats(chances[k:]) >= self.options.stop_probability:
            k += 1
        return k

    def untried_likeliest(self) -> tuple[str, float] | None:
        """The untried candidate likeliest to beat the pick by more than the tolerance, and that chance."""
        ranked = self.ranking() if self.best is not None else []
        if not ranked:
            return None
        top = max(ranked, key=lambda s: s.p_beat)
        return top.planned.config.label, top.p_beat

    def confidence_overall(self) -> float | None:
        """Probability that the pick is within the tolerance of the best candidate, tried or
        not: ``confidence`` (the tried ones, measured) times the chance that no untried one
        beats it (the learned model), as if the two were independent."""
        tried, untried = self.confidence(), self.untried_chance()
        if tried is None or untried is None:
            return None
        return tried * (1.0 - untried)

    def contenders(self) -> list[str]:
        """The pick and the candidates to re-time it against, ``retime`` at most. Until the
        pick was timed twice: the pick, and every candidate within ``prune_slower`` of it (the
        trial-to-trial noise is not measured yet: the prior may be over-confident); then those
        it is not yet ``confidence`` sure to be within the tolerance of, and those that may be
        faster than it (a chance of 1 - ``confidence`` or more: ``_faster_chance``). Either way the least
        sure first (``_pairwise``; then the best mean): a candidate timed once, as slow as one
        timed twice, is the likelier to beat the pick. By mean alone, a real CPU run (2026-11-26,
        run 3) never re-timed the best candidate after its one trial ran 26% slow."""
        pick = self.best
        if pick is None or self.options.retime < 2:
            return []
        means = measured_means(self.study)
        mp, n_p = means[pick.label]
        sure = self._pairwise()
        if n_p == 1:
            near = -math.log(1.0 - self.options.prune_slower) if self.options.prune_slower > 0 else math.inf
            others = [k for k, (m, _) in means.items() if k != pick.label and m - mp < near]
        else:
            # Those it is not sure to be within the tolerance of, and those with a chance of at
            # least 1 - ``confidence`` to be faster than it at all: sure to be within 2% of a
            # candidate that is 1% faster, the re-timing stopped and handed over the slower one
            # (replay, Ultra-Scale 8B on 8 nodes: the pick 0.9% slower than a candidate tried,
            # on every seed; docs/models.md, 2026-11-27).
            faster = self._faster_chance()
            others = [k for k, p in sure.items()
                      if p < self.options.confidence or faster[k] >= 1.0 - self.options.confidence]
        others.sort(key=lambda k: (sure[k], means[k][0], k))
        if n_p == 1:  # the pick is timed twice before any verdict: its repeat measures the noise
            return [pick.label, *others[: self.options.retime - 1]]
        return [pick.label, *others[: self.options.retime - 1]] if others else []

    def ranking(self) -> list[Scored]:
        return self.sampler.ranking(self.study)

    def stop_reason(self, elapsed_s: float = 0.0) -> str | None:
        """Why the search should stop now, or None to go on."""
        fault = self.script_fault()
        if fault is not None:
            return fault
        o = self.options
        n = len(self.study.trials)
        if n >= o.max_trials:
            return f"trial budget spent ({n} trials)"
        reserve = o.reserve_for(self.plan.cluster.device_spec.kind)
        if reserve and n >= o.max_trials - reserve and self.best is not None:
            return f"search budget spent ({n} trials; {o.max_trials - n} kept to re-time the best)"
        if o.time_budget_s is not None and elapsed_s >= o.time_budget_s:
            return f"time budget spent ({elapsed_s:.0f} s of {o.time_budget_s:.0f} s)"
        ranked = self.ranking()
        if not ranked:
            return self._nothing_left()
        best = self.best
        if best is not None and len(measured_means(self.study)) >= min(MIN_OK_TO_CONVERGE, len(self.candidates)):
            top = max(ranked, key=lambda s: s.p_beat)
            p_any = chance_any_beats([s.p_beat for s in ranked])
            if p_any < o.stop_probability:
                return (
                    f"converged: the {len(ranked)} untried candidates together have a {p_any:.1%} chance "
                    f"(< {o.stop_probability:.0%}) to beat {best.label} by more than {o.tolerance:.0%} "
                    f"(the likeliest, {top.planned.config.label}, {top.p_beat:.1%})"
                )
        return None

    def script_fault(self) -> str | None:
        """Why the search stops at a failure of the user's script that no layout explains
        (``pipette.script_faults``: a missing import, a command line it refuses, no step
        reported, ...), with its fix; None when this run had none. Only this run's trials: a
        stored record of an earlier script does not stop a new one."""
        for r in self.records[self._replayed:]:
            fix = r.measurement.details.script_fault
            if fix:
                said = (r.measurement.error.splitlines() or [""])[0]
                return (f"the script failed at trial #{r.number} in a way no layout explains, so every "
                        f"candidate would ({said}); fix: {fix}")
        return None

    def _nothing_left(self) -> str:
        """Why no candidate is left to try: all were tried, or the trials ruled the rest out.
        It said "every candidate predicted to fit was tried" when 5 of 16 were (issue 32, item 10)."""
        tried = {r.label for r in self.records} & {p.config.label for p in self.candidates}
        left = len(self.candidates) - len(tried)
        if left == 0:
            return f"every candidate predicted to fit was tried ({len(tried)})"
        if not tried:  # no trial of this job: the earlier jobs' trials decided (issue 43, item 25)
            return (f"no candidate is worth a trial: earlier trials on this cluster rule all {left} out (likely to "
                    "run out of memory or fail as those did); start without them (pipette tune --no-memory) to try "
                    "them anyway")
        return (f"no untried candidate is left worth a trial: {len(tried)} of {len(self.candidates)} tried; the other "
                f"{left} ruled out by what the trials taught (likely to run out of memory or fail as tried ones did)")

    def result(self, stop_reason: str, interrupted: bool = False) -> TuneResult:
        pick = self.best
        mean = measured_means(self.study).get(pick.label) if pick is not None else None
        return TuneResult(self.plan, tuple(self.records), stop_reason, pick, interrupted, self.unrunnable,
                          self.confidence(), self.confidence_overall(), self.sampler.learned(self.study).summary(),
                          self.options.tolerance, self.options.confidence,
                          math.exp(mean[0]) if mean else None, mean[1] if mean else 0, self.trials_to_decide(),
                          runnable=len(self.candidates), untried_to_try=self.untried_to_try(),
                          untried_likeliest=self.untried_likeliest())

    def trials_to_decide(self) -> dict[str, int | None]:
        """Per tried candidate the pick is not yet ``confidence`` sure to be within the tolerance
        of: how many more trials of each (the pick and it alike) would make it so, if the means
        and the noise stay as measured (the standard error of ``_pairwise`` shrinking as
        sqrt(1/n_p + 1/n)); None when no number would: its mean is the faster by more than the
        tolerance, so more trials would move the pick, not confirm it."""
        pick = self.best
        if pick is None:
            return {}
        means = measured_means(self.study)
        learned = self.sampler.learned(self.study)
        noise, dof = learned.trial_noise_sd, NOISE_PRIOR_DOF + learned.noise_dof
        quantile = float(student_t.ppf(self.options.confidence, dof))
        mp, n_p = means[pick.label]
        out: dict[str, int | None] = {}
        for label, sure in self._pairwise().items():
            if sure >= self.options.confidence:
                continue
            m, n = means[label]
            margin = m + math.log(1.0 + self.options.tolerance) - mp
            k = 0
            while margin > 0 and k <= MAX_TRIALS_TO_DECIDE and \
                    noise * math.sqrt(1.0 / (n_p + k) + 1.0 / (n + k)) * quantile > margin:
                k += 1
            out[label] = k if margin > 0 and k <= MAX_TRIALS_TO_DECIDE else None
        return out

    # ---- the loop -------------------------------------------------------------------
    def run(
        self,
        runner: TrialRunner,
        on_event: Callable[[TuneEvent], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> TuneResult:
        """Trial candidates until the stop rule says stop; Ctrl-C stops the running trial
        (the runner cleans up) and returns what was measured, with ``interrupted`` set."""
        emit = on_event or (lambda event: None)
        start = self._started = time.monotonic()
        reason: str | None = None
        interrupted = False
        try:
            while True:
                while True:
                    if should_stop is not None and should_stop():
                        reason = "cancelled"
                        break
                    reason = self.stop_reason(time.monotonic() - start)
                    if reason is not None:
                        break
                    if self.step(runner, emit, should_stop) == "cancelled":
                        reason = "cancelled"
                        break
                if reason is None or reason == "cancelled" or reason.startswith("time budget") \
                        or self.script_fault() is not None:
                    break
                before = len(self.study.trials)
                reason = self.retime(runner, reason, emit, should_stop)
                # The repeats measured the trial-to-trial noise: when it is larger than the
                # stop rule assumed, an untried candidate may again have a chance: search on.
                if reason == "cancelled" or len(self.study.trials) == before \
                        or self.stop_reason(time.monotonic() - start) is not None:
                    break
        except KeyboardInterrupt:
            interrupted = True
            reason = "interrupted (Ctrl-C); the running trial was stopped and not recorded"
        emit(TuneEvent("stopped", None, {"reason": reason, "best": None if self.best is None else self.best.label}))
        return self.result(reason or "stopped", interrupted)

    def retime(
        self,
        runner: TrialRunner,
        reason: str,
        emit: Callable[[TuneEvent], None] = lambda event: None,
        should_stop: Callable[[], bool] | None = None,
    ) -> str:
        """Re-time the contenders (module docstring) and return the stop reason with the
        verdict; "cancelled" when ``should_stop`` said so."""
        rounds = 0
        first_seen: list[str] = []  # the rounds' order: a contender keeps its place
        # Past ``retime_rounds``, rounds go on while the pick is below the confidence asked, the
        # budget has room and the search would not reopen: a load spike in the last round moved
        # a real pick to a candidate timed once, and the verdict said "23% sure" with trials
        # left (issue 32, item 9).
        while rounds < self.options.retime_rounds or (self._undecided() and self._search_closed()):
            if self._time_spent():
                break
            # A round takes the best contenders (the pick first) its size and the budget have room for: with
            # the reserve of 2 and 3 contenders, skipping the round left the pick timed once.
            # The pick alone is re-timed in the first round only (its repeat measures the noise).
            room = self.options.max_trials - len(self.study.trials)
            contenders = self.contenders()[:min(room, self.options.round_size(self.plan.cluster.device_spec.kind))]
            if not contenders or (len(contenders) == 1 and rounds > 0):
                break
            self._retimed.update(contenders)
            first_seen += [c for c in contenders if c not in first_seen]
            ordered = [c for c in first_seen if c in contenders]
            order = ordered if rounds % 2 == 0 else ordered[::-1]
            for label in order:
                if self._retime_trial(label, runner, emit, should_stop) == "cancelled":
                    return "cancelled"
            rounds += 1
            self._rounds += 1
        best, confidence = self.best, self.confidence()
        if best is None or confidence is None:
            return reason
        verdict = (f"pick {best.label}, {confidence:.0%} sure to be within {self.options.tolerance:.0%} "
                   "of the best tried")
        if len(measured_means(self.study)) == 1:  # a certainty of 1 over nothing compared (issue 43, item 29)
            verdict = (f"pick {best.label}, the only candidate that ran ok: no other measured to compare it with, "
                       "so how close it is to the best is not known")
        if self._retimed:  # this call's rounds and the earlier calls' (a search between them)
            rounds_text = f" in {self._rounds} round(s)" if self._rounds else ""
            verdict = f"re-timed {len(self._retimed)} contenders{rounds_text}: " + verdict
        return f"{reason}; {verdict}"

    def _undecided(self) -> bool:
        confidence = self.confidence()
        return confidence is not None and confidence < self.options.confidence

    def _search_closed(self) -> bool:
        """The search would not go on now (its budget spent, converged, nothing left to try)."""
        return self.stop_reason(time.monotonic() - self._started) is not None

    def _time_spent(self) -> bool:
        budget = self.options.time_budget_s
        return budget is not None and time.monotonic() - self._started >= budget

    def _retime_trial(
        self, label: str, runner: TrialRunner, emit: Callable[[TuneEvent], None],
        should_stop: Callable[[], bool] | None,
    ) -> str:
        """One re-timing trial of a candidate already tried: no retries, no pruning."""
        planned = next(p for p in self.candidates if p.config.label == label)
        prediction = self.sampler.learned(self.study).predict(planned.config, planned.perf)
        number = len(self.study.trials)
        cancelled = False
        emit(TuneEvent("trial_started", number, {
            "label": label, "config": planned.config.to_dict(), "attempt": 1, "purpose": "retime",
            "predicted_step_time": prediction.step_time, "analytic_step_time": planned.perf.step_time,
        }))

        def on_step(p: StepProgress) -> bool:
            nonlocal cancelled
            emit(TuneEvent("trial_step", number, {"step": p.step, "time": p.time, "warmup": p.warmup, "loss": p.loss}))
            cancelled = should_stop is not None and should_stop()
            return cancelled

        started = _now()
        m = runner(planned.config, on_step)
        if cancelled or _stopped_by(m, should_stop):
            return "cancelled"  # not recorded: a cut-short re-timing says nothing
        record = TrialRecord(number, planned.config, m, planned.perf, planned.memory, prediction.step_time,
                             prediction.sd, 1, self.job_key, "retime", self.stack_of(planned.config), started,
                             _now())
        state, value, constraints = _outcome(m)
        params = candidate_params(planned.config)
        self.study.add_trial(optuna.trial.create_trial(
            state=state, value=value, params=params, distributions={k: self.space[k] for k in params},
            user_attrs={RECORD_ATTR: record.to_dict()}, constraints=constraints, intermediate_values=_intermediate(m),
        ))
        self.records.append(record)
        emit(TuneEvent("trial_ended", number, record.to_dict(), record))
        return m.status

    def step(
        self,
        runner: TrialRunner,
        emit: Callable[[TuneEvent], None] = lambda event: None,
        should_stop: Callable[[], bool] | None = None,
    ) -> str:
        """Run one trial (with its retries); returns its final status, or "cancelled"."""
        learned = self.sampler.learned(self.study)
        trial = self.study.ask(fixed_distributions=self.space)
        try:
            planned = self.sampler.by_key[params_key(trial.params)]
        except KeyError:
            self.study.tell(trial, state=TrialState.FAIL)
            raise InfeasibleError("the sampler proposed no candidate", field="plan",
                                  fix="report this: the stop rule should have ended the search") from None
        prediction = learned.predict(planned.config, planned.perf)
        trial.set_user_attr("tokens_per_step", self.plan.training.tokens_per_step)
        cancelled = False
        reported = 0
        record: TrialRecord | None = None
        retries_left, lost_left = self.options.retries, LOST_NODE_RETRIES
        attempt = 0
        lost_before = False
        try:
            while True:
                attempt += 1
                emit(TuneEvent("trial_started", trial.number, {
                    "label": planned.config.label, "config": planned.config.to_dict(), "attempt": attempt,
                    "predicted_step_time": prediction.step_time, "analytic_step_time": planned.perf.step_time,
                }))

                # a rerun after a lost node is measured in full: its first steps follow the node's
                # restart, and pruning them against the incumbent would judge the cluster
                prunable = self.options.prune and not lost_before

                def on_step(p: StepProgress, number: int = trial.number, prunable: bool = prunable) -> bool:
                    nonlocal cancelled, reported
                    emit(TuneEvent("trial_step", number, {"step": p.step, "time": p.time, "warmup": p.warmup,
                                                          "loss": p.loss}))
                    if should_stop is not None and should_stop():
                        cancelled = True
                        return True
                    if p.warmup or p.time <= 0:
                        return False
                    trial.report(self.plan.training.tokens_per_step / p.time, step=reported)
                    reported += 1
                    return prunable and trial.should_prune()

                started = _now()
                m = runner(planned.config, on_step)
                cancelled = cancelled or _stopped_by(m, should_stop)
                if cancelled:
                    m = replace(m, status="pruned", error=STOPPED)
                crashed = not cancelled and m.status in ("failed", "timeout")
                lost = crashed and bool(m.lost_nodes) and lost_left > 0
                retry = crashed and not lost and retries_left > 0
                record = TrialRecord(trial.number, planned.config, m, planned.perf, planned.memory,
                                     prediction.step_time, prediction.sd, attempt, self.job_key,
                                     stack=self.stack_of(planned.config), started_at=started, ended_at=_now())
                if retry and (m.details.script_fault or m.details.unsupported):  # a retry repeats it
                    retry = False
                    why = ("the script's own failure, which no layout explains" if m.details.script_fault else
                           "the script says it cannot run this candidate")
                    record = replace(record, measurement=replace(m, extra={**m.extra, "not_retried": (
                        f"{why}: a retry would repeat it")}))
                if retry:
                    kind = crash_kind(m)
                    chance = retry_chance([*self.records, record], kind)
                    if chance < RETRY_MIN_CHANCE:
                        retry = False  # said in the record, so the user sees why a retry was left out
                        record = replace(record, measurement=replace(m, extra={**m.extra, "not_retried": (
                            f"a retry of this kind of crash ({m.status}: {last_error_line(m.error or '')[:200]}) "
                            f"ran with chance {chance:.0%} "
                            f"in this job (< {RETRY_MIN_CHANCE:.0%}): its earlier retries crashed again")}))
                self.records.append(record)
                emit(TuneEvent("trial_ended", trial.number, record.to_dict(), record))
                if lost:
                    lost_left -= 1  # the cluster's failure, not the candidate's: rerun it
                    lost_before = True
                elif retry:
                    retries_left -= 1
                else:
                    break
        except BaseException:
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        if record is None:  # the loop always runs once; this keeps the type checker honest
            raise InfeasibleError("no attempt ran", field="budget.retries", fix="give 0 or more retries")
        state, value, constraints = _outcome(record.measurement)
        for key, v in constraints.items():
            trial.set_constraint(key, v)
        trial.set_user_attr(RECORD_ATTR, record.to_dict())
        self.study.tell(trial, value, state=state)
        return "cancelled" if cancelled else record.measurement.status


def _now() -> datetime:
    return datetime.now(UTC)


def _stopped_by(m: Measurement, should_stop: Callable[[], bool] | None) -> bool:
    """Whether the runner stopped the trial itself because ``should_stop`` said so (it may ask
    between steps: a trial with no step yet is cancelled too)."""
    return m.status == "pruned" and should_stop is not None and should_stop()


def crash_kind(m: Measurement) -> str:
    """What kind of crash a failed attempt was: its status and the line of its error that names
    the exception (``last_error_line``), numbers blanked, so that two crashes of one kind on
    other ranks, ports or sizes are the same kind."""
    blanked = re.sub(r"0x[0-9a-fA-F]+|\d+", "#", last_error_line(m.error or ""))
    return f"{m.status}: {blanked[:200]}"


def retry_chance(records: Sequence[TrialRecord], kind: str) -> float:
    """The chance that a retry of a crash of ``kind`` runs, by Laplace's rule of succession
    over this job's retries of that kind so far: (runs + 1) / (retries + 2); 1/2 before any.

    A retry that crashed again is evidence that the crash is the candidate's (a pipeline depth
    the model does not split evenly, a kernel that fails), not the machine's (a timed-out
    collective, a lost peer): one such and the chance is 1/3, and the kind is not retried
    again in this job (a resumed job counts its stored records the same way). Reruns after a
    lost node are not retries."""
    ran = tried = 0
    by_number: dict[int, list[TrialRecord]] = {}
    for r in records:
        by_number.setdefault(r.number, []).append(r)
    for attempts in by_number.values():
        own = [r.measurement for r in sorted(attempts, key=lambda r: r.attempt)
               if not r.measurement.lost_nodes]
        for before, after in pairwise(own):
            if before.status in ("failed", "timeout") and crash_kind(before) == kind:
                tried += 1
                ran += after.status not in ("failed", "timeout")
    return (ran + 1) / (tried + 2)


def chance_any_beats(p_beats: Sequence[float]) -> float:
    """The chance that at least one of the untried candidates beats the incumbent, from each
    one's own chance, as if they were independent: 1 - prod(1 - p).

    The stop rule once compared the likeliest candidate's chance alone with
    ``stop_probability``; forty candidates at 4% each would pass as "converged" though one of
    them beats the pick with probability 1 - 0.96^40 = 80%. Under a wrong analytic prior that stopped early on
    a slow pick (replay benchmark, distorted prior: regret at the tuner's own stop 4.4-4.7%,
    its "90% sure" right about the best overall in 70-75% of runs). The candidates' errors are
    correlated (one learned model), so independence overstates the chance: the rule errs
    towards another trial."""
    miss = 1.0
    for p in p_beats:
        miss *= 1.0 - min(max(p, 0.0), 1.0)
    return 1.0 - miss


def _outcome(m: Measurement) -> tuple[TrialState, float | None, dict[str, float]]:
    """Optuna state, value (tokens/s) and constraints (positive = infeasible) of a trial."""
    if m.status == "pruned":
        return TrialState.PRUNED, None, {}
    if m.status == "ok":
        return TrialState.COMPLETE, float(m.tokens_per_s or 0.0), {"memory": 0.0, "runs": 0.0}
    if m.status == "oom":
        return TrialState.COMPLETE, 0.0, {"memory": 1.0, "runs": 0.0}
    return TrialState.COMPLETE, 0.0, {"memory": 0.0, "runs": 1.0}


def _intermediate(m: Measurement) -> dict[int, float]:
    return {i: m.tokens_per_step / t for i, t in enumerate(m.step_times) if t > 0}


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
