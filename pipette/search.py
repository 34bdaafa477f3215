"""The search: an Optuna sampler that proposes the candidate with the best expected
improvement under the learned model, a pruner that stops a trial clearly slower than the
incumbent, and the stop rule's probabilities.

Free of I/O (like Optuna's own samplers): everything it knows comes from the study's
trials. A trial's parameters name one candidate of the plan (``PARAMS``); its value is the
measured throughput in tokens/s (maximised); a trial that ran out of memory or failed is
``COMPLETE`` with value 0 and a positive constraint (``memory`` or ``runs``), set with
``trial.set_constraint`` (Optuna 5; ``constraints_func`` is deprecated); its
``TrialRecord`` travels in the user attribute ``record``.

Expected improvement on the log step time ``y`` with incumbent ``y*`` and a Gaussian
prediction ``N(mu, sd^2)`` (Jones, Schonlau & Welch 1998, eq. 15):
``EI = (y* - mu) Phi(z) + sd phi(z)``, ``z = (y* - mu) / sd``, weighted by the chance that
the candidate fits and runs (constrained EI: Gardner et al. 2014, "Bayesian optimization
with inequality constraints", eq. 5) relative to that chance before any trial
(``pipette.feasibility``). The incumbent is the
candidate with the best mean log step time over its ok trials (a candidate re-timed several
times counts once, with its mean, not its luckiest trial).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.pruners import BasePruner
from optuna.samplers import BaseSampler, RandomSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState
from scipy.stats import norm

from pipette.config import ParallelConfig
from pipette.feasibility import P_FIT_MIN, P_RUNS_MIN, RUNS_PRIOR
from pipette.fits import CPU, KEEP_THRESHOLD, FitsPrior
from pipette.learned import NOISE_FLOOR_SD, LearnedModel, Observation, Prediction, collapse
from pipette.plan import Planned
from pipette.trials import TrialRecord

#: The parameters that name a candidate in the study: cp and ep beside tp, pp and dp (1 for a
#: candidate that splits no sequence and no expert; ep is carved out of dp x cp, so two candidates
#: of one world can differ in ep alone), the expert tensor-parallel degree, an MoE candidate's routing
#: and token dispatcher (``pipette.routing``) in ``variant``.
PARAMS: tuple[str, ...] = ("tp", "pp", "dp", "cp", "ep", "mbs", "zero_stage", "recompute", "schedule", "variant")
#: What a trial's parameters from before cp and ep were parameters mean by them.
_DEFAULTS: dict[str, Any] = {"cp": 1, "ep": 1}
#: The user attribute holding a trial's record (``pipette.tuner.TrialRecord.to_dict``).
RECORD_ATTR = "record"
#: Until a trial has run, the search proposes the fastest candidate (by expected step time, as
#: the plan ranks) among those at least this sure to fit and run (``first_trials``), so that a user
#: who stops after the first trials has one that ran. Chosen on the Ultra-Scale replay by
#: leave-one-model-size-out (docs/results.md, "First trials that run").
FIRST_SURE_TO_FIT = 0.8


def candidate_params(config: ParallelConfig) -> dict[str, Any]:
    sched = "1f1b" if config.schedule == "1f1b" else f"interleaved-{config.virtual_stages}"
    # the stack of a plan over several, FSDP2's HSDP shard degree, CPU offload, an expert
    # tensor-parallel degree other than tp, an MoE routing and dispatcher of the candidate's own:
    # "" for a DeepSpeed candidate of a one-stack plan
    variant = "/".join(part for part in (
        config.stack or "", "" if config.dp_shard is None else f"hsdp{config.dp_shard}",
        "offload" if config.offload else "", "" if config.etp is None else f"etp{config.etp}",
        config.routing or "", config.dispatcher or "") if part)
    return {
        "tp": config.tp, "pp": config.pp, "dp": config.dp, "cp": config.cp, "ep": config.ep, "mbs": config.mbs,
        "zero_stage": config.zero_stage, "recompute": config.recompute, "schedule": sched, "variant": variant,
    }


def params_key(params: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(params[p] if p in params else _DEFAULTS[p] for p in PARAMS)


def names_candidate(params: dict[str, Any]) -> bool:
    """Whether a trial's parameters name a candidate (all of ``PARAMS``; cp and ep may be left out)."""
    return all(p in params or p in _DEFAULTS for p in PARAMS)


def search_space(candidates: Sequence[Planned]) -> dict[str, BaseDistribution]:
    """One categorical per parameter over the values the candidates take."""
    values: dict[str, list[Any]] = {p: [] for p in PARAMS}
    for c in candidates:
        for name, value in candidate_params(c.config).items():
            if value not in values[name]:
                values[name].append(value)
    return {name: CategoricalDistribution(sorted(v, key=str)) for name, v in values.items()}


@dataclass(frozen=True)
class Scored:
    """An untried candidate under the learned model."""

    planned: Planned
    prediction: Prediction
    expected_improvement: float
    #: probability of beating the incumbent's step time by more than the tolerance, and of
    #: fitting and running (all three are needed to beat it)
    p_beat: float
    p_fit: float = 1.0
    p_runs: float = 1.0


def observations(
    study: Study, by_key: dict[tuple[Any, ...], Planned], job_key: str
) -> list[Observation]:
    """The study's finished trials as the learned model's observations."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        record = study_record(t)
        planned = by_key.get(params_key(t.params)) if names_candidate(t.params) else None
        if record is None or planned is None:
            continue
        # the study keeps a trial's last attempt; the attempts before it failed (a retry
        # follows a failure; a rerun after a lost node is counted too, a slight over-count)
        out.append(Observation(planned.config, planned.perf, planned.memory, record.measurement, job_key,
                               record.attempt))
    return out


def study_record(t: FrozenTrial) -> TrialRecord | None:
    """The record the tuner kept with a study's trial (None while it runs)."""
    raw = t.user_attrs.get(RECORD_ATTR)
    return None if raw is None else TrialRecord.from_dict(raw)


def tried_keys(study: Study) -> set[tuple[Any, ...]]:
    """Candidates already tried or running (never proposed twice)."""
    return {
        params_key(t.params) for t in study.get_trials(deepcopy=False)
        if names_candidate(t.params) and t.state != TrialState.WAITING
    }


def _ok_records(study: Study) -> list[TrialRecord]:
    """The records of the study's trials that ran to the end."""
    records = (study_record(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    return [r for r in records if r is not None and r.status == "ok"]


def measured_means(study: Study) -> dict[str, tuple[float, int]]:
    """Per tried candidate (by label): the mean log step time of its ok trials and their number."""
    logs: dict[str, list[float]] = {}
    for r in _ok_records(study):
        t = r.measurement.step_time
        if t:
            logs.setdefault(r.label, []).append(math.log(t))
    return {label: (sum(v) / len(v), len(v)) for label, v in logs.items()}


def incumbent(study: Study) -> tuple[float, int] | None:
    """The best candidate's (mean log step time, ok trials), or None before any ok trial."""
    means = measured_means(study)
    return min(means.values()) if means else None


def incumbent_step_time(study: Study) -> float | None:
    best = incumbent(study)
    return math.exp(best[0]) if best else None


def incumbent_throughput(study: Study) -> float | None:
    """The best measured tokens/s (what trials report as intermediate values)."""
    values = [r.measurement.tokens_per_s for r in _ok_records(study) if r.measurement.tokens_per_s is not None]
    return max(values) if values else None


def score(
    candidates: Sequence[Planned],
    learned: LearnedModel,
    best: tuple[float, int] | None,
    tolerance: float,
) -> list[Scored]:
    """Every candidate still worth a trial (``LearnedModel.fits``), with its constrained EI
    and its chance to beat the incumbent ``best`` (mean log step time, trials) by more than
    ``tolerance``; best acquisition first."""
    feasible = learned.feasibility([c.config for c in candidates], [c.memory for c in candidates])
    kept = [(c, f) for c, f in zip(candidates, feasible, strict=True) if _worth_a_trial(c, *f)]
    configs, perfs = [c.config for c, _ in kept], [c.perf for c, _ in kept]
    weights, means, sds = learned.components(configs, perfs)
    preds = collapse(perfs, weights, means, sds)
    out = []
    for i, ((c, (p_fit, p_runs)), p) in enumerate(zip(kept, preds, strict=True)):
        # the chance it fits (the plan's before any trial, pipette.fits) times what the trials
        # taught about running at all (1 before any crash)
        taught = p_fit * min(1.0, p_runs / RUNS_PRIOR)
        if best is None:
            # Nothing measured yet: the expected step time ranks, as in the plan (the fastest
            # likely to fit first), a candidate the trials say may not run later.
            risk = c.expected_step_time / c.perf.step_time if c.expected_step_time > 0 else 1.0
            runs = min(1.0, p_runs / RUNS_PRIOR)
            out.append(Scored(c, p, -p.log_step_time - math.log(risk) + math.log(runs), taught, p_fit, p_runs))
            continue
        y_star, n = best
        # the incumbent's mean is itself measured with noise: compare the two
        incumbent_sd = learned.trial_noise_sd / math.sqrt(n)
        sd = math.hypot(p.sd, incumbent_sd)
        z = (y_star - p.log_step_time) / sd
        ei = ((y_star - p.log_step_time) * float(norm.cdf(z)) + sd * float(norm.pdf(z))) * taught * _lowered(c, p_fit)
        # The chance to beat it is the mixture's own: each hyperparameter setting's Gaussian
        # tail, weighted by its posterior (the acquisition integrated over the hyperparameters:
        # Snoek, Larochelle & Adams 2012, sec. 3.2), not the tail of the one Gaussian of the
        # mixture's mean and variance. A mixture of Gaussians of unequal spread has heavier
        # tails than that Gaussian, and the stop rule and ``Tuner.confidence_overall`` are
        # about the tails: a candidate that beats the incumbent only if the model is far off.
        # The EI (which candidate next) stays on the one Gaussian: integrated too, it found the
        # best later (replays of both: docs/results.md, "Evidence behind the tuner's constants").
        gap = y_star + math.log(1.0 - tolerance) - math.log(p.analytic) - means[:, i]
        p_beat = float(weights @ norm.cdf(gap / np.hypot(sds[:, i], incumbent_sd))) * taught
        out.append(Scored(c, p, ei, p_beat, p_fit, p_runs))
    out.sort(key=lambda s: (-s.expected_improvement, s.prediction.step_time, s.planned.config.label))
    return out if best is not None else first_trials(out)


def first_trials(ranked: list[Scored]) -> list[Scored]:
    """Before any trial ran: the candidates at least ``FIRST_SURE_TO_FIT`` sure to fit and run
    (``Scored.p_beat`` holds that chance then: the plan's chance to fit, lowered where a trial ran
    out of memory or crashed nearby) first, each part in the order it had."""
    return sorted(ranked, key=lambda s: s.p_beat < FIRST_SURE_TO_FIT)


def _lowered(candidate: Planned, p_fit: float) -> float:
    """How much the trials lowered a candidate's chance to fit from the plan's: a second weight
    of its expected improvement, on top of the chance itself (``score``). Next to a boundary a
    trial measured, constrained EI (the chance alone, Gardner et al.) over-proposes: the search
    proposes the candidate whose weighted EI is highest, so the chance of the one it proposes
    is biased up (the winner's curse). In the Ultra-Scale replay (3 seeds, budget 20, ten groups)
    16 of the 18 proposals after the first trial at a chance under 0.8 ran out of memory, where
    their chances (mean 0.43) expected about 10; 12 of the 16 had been lowered by a trial.
    A chance the trials did not lower keeps power 1: the fastest candidates sit at the boundary
    at their plan chance, and the chance squared for all of them delayed the best (regret after
    3 trials 9.7 -> 11.1%; docs/models.md, "The boundary's open targets")."""
    if candidate.chance_to_fit <= 0.0:
        return 1.0
    return min(1.0, p_fit / candidate.chance_to_fit)


def _worth_a_trial(candidate: Planned, p_fit: float, p_runs: float) -> bool:
    """Likely enough to run, and to fit: above the plan's threshold while no trial lowered its
    chance, above ``P_FIT_MIN`` once one did (``pipette.feasibility``)."""
    lowered = p_fit < candidate.chance_to_fit - 1e-9
    return p_runs >= P_RUNS_MIN and p_fit >= KEEP_THRESHOLD and (p_fit >= P_FIT_MIN or not lowered)


class PerfModelSampler(BaseSampler):
    """Proposes the untried candidate with the best expected improvement under the model
    learned from the study's trials (DESIGN.md, data flow). Deterministic."""

    def __init__(
        self,
        candidates: Sequence[Planned],
        *,
        job_key: str = "",
        prior: Sequence[Observation] = (),
        tolerance: float = 0.02,
        seed: int = 0,
        space: dict[str, BaseDistribution] | None = None,
        fits_prior: FitsPrior = CPU,
        noise_floor: float = NOISE_FLOOR_SD,
    ) -> None:
        self.candidates = list(candidates)
        self.noise_floor = noise_floor
        self.fits_prior = fits_prior
        self.job_key = job_key
        self.prior = tuple(prior)
        self.tolerance = tolerance
        self.by_key = {params_key(candidate_params(c.config)): c for c in self.candidates}
        self.space = space if space is not None else search_space(self.candidates)
        self._fallback = RandomSampler(seed=seed)

    def learned(self, study: Study) -> LearnedModel:
        return LearnedModel([*self.prior, *observations(study, self.by_key, self.job_key)], job_key=self.job_key,
                            fits_prior=self.fits_prior, space=[c.config for c in self.candidates],
                            noise_floor=self.noise_floor)

    def ranking(self, study: Study) -> list[Scored]:
        """Untried candidates, best first, with the learned model of the study so far."""
        tried = tried_keys(study)
        untried = [c for k, c in self.by_key.items() if k not in tried]
        return score(untried, self.learned(study), incumbent(study), self.tolerance)

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.space)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        ranked = self.ranking(study)
        return candidate_params(ranked[0].planned.config) if ranked else {}

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)


class IncumbentPruner(BasePruner):
    """Prunes a trial whose measured steps are clearly slower than the incumbent: after
    ``min_steps`` timed steps, when even its best step's throughput is below the
    incumbent's by more than ``slower`` (a single slow step never prunes; a fast one keeps
    the trial alive)."""

    def __init__(self, slower: float = 0.25, min_steps: int = 2) -> None:
        self.slower = slower
        self.min_steps = min_steps

    def prune(self, study: Study, trial: FrozenTrial) -> bool:
        values = list(trial.intermediate_values.values())
        best = incumbent_throughput(study)
        if best is None or len(values) < self.min_steps:
            return False
        return max(values) < best * (1.0 - self.slower)


def new_study(sampler: BaseSampler, pruner: BasePruner | None = None, name: str = "pipette") -> Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        study_name=name, direction="maximize", sampler=sampler, pruner=pruner or optuna.pruners.NopPruner()
    )

