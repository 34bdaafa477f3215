"""The learned correction: the analytic models, corrected by what the trials measured.

Step time. A Gaussian process on the residual ``r = log(measured / analytic)`` (Rasmussen &
Williams 2006, *Gaussian Processes for Machine Learning*, eq. 2.25-2.26 for the posterior
mean and variance) with a kernel (``gp.step_time_kernel``; its priors and grids are ``pipette.gp``'s) made of

- a constant term ``b^2``: one offset shared by every candidate (the analytic model's
  efficiency on this cluster is off by a common factor; one trial learns it);
- an RBF term ``s^2 exp(-|x - x'|^2 / 2 l^2)`` over the candidate's features (its degrees,
  micro-batch, ZeRO stage, recomputation, and the shares of its predicted breakdown; log2 cp
  and log2 ep, ``pipette.feasibility.degree_features``), so a trial corrects its neighbours
  more than distant candidates: a cp = 2 trial its cp = 2 neighbours more than their cp = 1 twins;
- a regime term ``a^2 (1/D) sum_d [x_d = x'_d]`` over the candidate's tp, pp, ZeRO stage and
  recompute mode (an additive kernel over categorical dimensions, after Duvenaud, Nickisch &
  Rasmussen 2011, "Additive Gaussian Processes"): the analytic model is often wrong by a
  factor per regime (the 80B runs were 2-7x slow at tp 8-32 and pp 2-8), so one trial at tp 8
  moves every tp-8 candidate, however far its other features are; and its term of order 2
  (``gp.REGIME_INTERACTION``), one factor per pair of regimes (a tp at one pp, a pp at one ZeRO
  stage), so a slowness of tp 4 at pp 2 only is learned as that cell's. In a space that splits
  sequences or experts (a candidate or a trial with cp or ep above 1) cp and ep are regimes too
  (``split_degrees``): the ring's and the all-to-all's terms are new to the analytic model and
  may be off by a factor of their own; a space without them keeps the four regimes, and its
  kernel to the bit;
- observations from another job on the same cluster (``job_key`` differs) enter the RBF
  and regime terms scaled by ``gp.CROSS_JOB_CORRELATION``: they inform, but less than this job's own;
- a plan over several stacks (``ParallelConfig.stack``): the stack is a task of a multi-task GP
  (the intrinsic coregionalization model, Bonilla, Chai & Williams 2008, "Multi-task Gaussian
  Process Prediction", eq. 2: ``k((x, s), (x', s')) = B[s, s'] k(x, x')``) with ``B`` 1 on the
  diagonal and ``gp.CROSS_STACK_CORRELATION`` off it, over the whole kernel, offset included: each
  stack's analytic model is off by its own factor, and a DeepSpeed trial teaches an FSDP
  candidate only through that correlation. One stack: ``B = 1``, the kernel above unchanged.

Hyperparameters. The residual sd ``s``, length scale ``l`` and regime sd ``a`` are not fixed
at one value: every setting of a small grid is weighted by its posterior (the marginal
likelihood, Rasmussen & Williams eq. 2.30, times a prior, ``gp.REGIME_SD_PRIOR``, that holds
against switching the regime term off and leans to large regime factors, as the 80B runs had
them), and the prediction is that mixture (Bayesian model averaging over the hyperparameters:
Snoek, Larochelle & Adams 2012, "Practical Bayesian Optimization of Machine Learning
Algorithms", sec. 3.2, integrate them out for the acquisition; Rasmussen & Williams sec. 5.2):
``components`` gives each setting's posterior, ``predict_many`` one Gaussian of the mixture's
mean and variance, and the chance to beat the incumbent (``pipette.search.score``) is the
mixture's own, whose tails are heavier. With 3-5 trials the mode alone was
sure of regimes no trial had touched (three trials at tp 1 agreeing: an untried tp 8 at
sd 0.029); the mixture keeps the settings the few trials cannot rule out.

With no observations the posterior mean is 0: the prediction *is* the analytic model
(DESIGN.md: the learned part corrects, never replaces). A trial that was pruned still ran
some steps: its partial median enters with a larger noise.

Noise. A trial's observation noise is the spread of its own steps plus the trial-to-trial
spread of one candidate (load on the machine, clocks, placement of the processes) that its
own steps cannot show. That spread is measured: candidates timed more than once (the
re-timing before the verdict) give a pooled variance of their trials' log medians, shrunk
towards the device kind's prior (``noise_floor_sd``: ``NOISE_FLOOR_SD`` on GPUs,
``CPU_NOISE_FLOOR_SD`` on CPU devices) with ``NOISE_PRIOR_DOF`` degrees of freedom (a scaled
inverse-chi-squared prior; Gelman et al., *Bayesian Data Analysis*, 3rd ed., sec. 3.3).

Memory and crashes: ``pipette.feasibility`` (learned per neighbourhood, never as one global
ceiling): a candidate is proposed only when its chance to fit and to run are above
``P_FIT_MIN`` and ``P_RUNS_MIN``, and its acquisition is weighted by both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipette import gp
from pipette.config import ParallelConfig
from pipette.estimates import TIME_PARTS, MemoryEstimate, PerfEstimate
from pipette.feasibility import MemoryModel, MemoryPoint, RunsModel, degree_array, layout_features
from pipette.fits import CPU, FitsPrior
from pipette.measurement import Measurement

FloatArray = gp.FloatArray

#: Prior of the trial-to-trial spread of one candidate in log space (load on the machine,
#: clocks) that its own step times cannot show; measured from repeats (module docstring).
NOISE_FLOOR_SD = 0.03
#: The same prior for trials on CPU devices: four single-threaded ranks share two cores with the host
#: and spread ~8% from trial to trial (docs/results.md, "The machine's own noise").
CPU_NOISE_FLOOR_SD = 0.08
#: Weight of that prior in degrees of freedom (two repeats' worth).
NOISE_PRIOR_DOF = 2.0
#: A pruned trial's partial median is noisier: fewer steps, maybe still warming up.
PRUNED_NOISE_SD = 0.15
#: With this many timed trials, the residual sd, length scale and regime sd are learned (their
#: posterior on ``gp.hyper_grid``: the marginal likelihood times ``gp.log_hyperprior``); before,
#: the kernel's prior values (``gp.PRIOR_RESIDUAL_SD``, ``gp.LENGTH_SCALE``, ``gp.PRIOR_REGIME_SD``).
MIN_FOR_FIT = 3
#: The hyperparameters are averaged over their posterior on the grid, not fixed at its mode: every
#: setting up to this much of it (module docstring). With a few trials the posterior is flat over
#: the residual sd and length scale, and the 12 likeliest settings once kept carried as little as
#: 60% of it (replays: docs/results.md, "How the tuner got here").
HYPER_MASS = 0.99

#: A residual this far (log) above the median residual is an outlier run (a 3x slow run of a
#: candidate whose neighbours ran at 1.1x, in the Ultra-Scale set): it is trusted less.
OUTLIER_LOG = 0.4

@dataclass(frozen=True)
class Observation:
    """One trial as the learned model sees it: what was predicted and what was measured."""

    config: ParallelConfig
    perf: PerfEstimate
    memory: MemoryEstimate
    measurement: Measurement
    job_key: str = ""
    #: attempts the trial took, when the observation is a trial's last attempt only (the study
    #: keeps that one; the attempts before it failed); a record per attempt counts 1 each
    attempts: int = 1


@dataclass(frozen=True)
class Prediction:
    """Learned step time: ``analytic * exp(mean)``, with ``sd`` the log-space uncertainty."""

    analytic: float
    mean: float
    sd: float

    @property
    def step_time(self) -> float:
        return self.analytic * math.exp(self.mean)

    @property
    def log_step_time(self) -> float:
        return math.log(self.analytic) + self.mean


def features(config: ParallelConfig, perf: PerfEstimate) -> FloatArray:
    """What makes two candidates alike for the correction: their shape, and where the
    analytic model says their time goes."""
    total = perf.step_time if perf.step_time > 0 else 1.0
    shares = [perf.breakdown.get(k, 0.0) / total for k in TIME_PARTS]
    return np.array([*layout_features(config), *(2.0 * s for s in shares)], dtype=np.float64)


class LearnedModel:
    """The analytic estimates corrected by a set of observations (see the module docstring)."""

    def __init__(self, observations: Sequence[Observation] = (), *, job_key: str = "",
                 fits_prior: FitsPrior = CPU, space: Sequence[ParallelConfig] = (),
                 noise_floor: float = NOISE_FLOOR_SD) -> None:
        """``space``: the candidates it will predict (their cp and ep degrees make regimes,
        ``split_degrees``; without it, the observations' alone); ``noise_floor``: the trial
        noise's prior (``noise_floor_sd``)."""
        self.job_key = job_key
        self.observations = tuple(observations)
        #: cp and ep where the space or a trial splits sequences or experts: regimes of the kernel
        self.split = split_degrees([*(o.config for o in self.observations), *space])
        timed = [o for o in self.observations if _observed_time(o) is not None]
        self._keys = [o.job_key == job_key for o in timed]
        self._stacks = [o.config.stack or "" for o in timed]
        self._x = np.array([features(o.config, o.perf) for o in timed]) if timed else np.zeros((0, 0))
        self._r = np.array([regimes(o.config, self.split) for o in timed], dtype=np.int64) if timed \
            else np.zeros((0, 0), np.int64)
        self._inputs = gp.KernelInputs(self._x, self._r, self._keys, self._stacks,
                                       degree_array([o.config for o in timed]))
        self.trial_noise_sd, self.noise_dof = trial_noise(timed, noise_floor)
        self._noise = np.array([math.hypot(_step_noise_sd(o.measurement), self.trial_noise_sd) for o in timed])
        self._y = np.array([math.log(_observed_time(o) or 1.0) - math.log(o.perf.step_time) for o in timed])
        # Robustness: a run far slower than its peers (``outlier_distances``) gets a noise as
        # large as its distance, so one odd run (a glitch: load, a straggler) does not drag its
        # neighbours' predictions with it. Only slow ones: glitches do not make a run faster,
        # so a fast surprise is a discovery.
        for i, dist in enumerate(outlier_distances([o.config for o in timed], self._y)):
            self._noise[i] = max(self._noise[i], dist)
        self.residual_sd, self.length_scale, self.regime_sd = gp.PRIOR_RESIDUAL_SD, gp.LENGTH_SCALE, gp.PRIOR_REGIME_SD
        #: (weight, (s, ell, a), the GP's factor) per hyperparameter setting averaged over
        self._mixture: list[tuple[float, tuple[float, float, float], gp.Factor]] = []
        #: the share of the hyperparameters' posterior the mixture kept (1: a single setting)
        self.hyper_mass = 1.0
        if timed:
            grid = [(self.residual_sd, self.length_scale, self.regime_sd)]
            if len(timed) >= MIN_FOR_FIT:
                grid = gp.hyper_grid()
            self._mixture = self._posterior(grid)
            self.residual_sd, self.length_scale, self.regime_sd = (
                sum(w * h[i] for w, h, _ in self._mixture) for i in range(3))
        own = [o for o in self.observations if o.job_key == job_key]  # another job's memory teaches nothing here
        self._own, self._fits_prior = own, fits_prior
        self.memory = MemoryModel([MemoryPoint(o.config, o.memory, o.measurement) for o in own], fits_prior)
        self.runs = RunsModel([(o.config, o.measurement, o.attempts) for o in own])
        #: per stack of a plan over several: what its own trials taught about memory and crashes
        self._by_stack: dict[str, tuple[MemoryModel, RunsModel]] = {}

    def _factor(self, s: float, ell: float, a: float) -> gp.Factor:
        k = gp.step_time_kernel(self._inputs, self._inputs, s, ell, a)
        return gp.factor(k + np.diag(self._noise**2), self._y)

    def _posterior(
        self, grid: Sequence[tuple[float, float, float]]
    ) -> list[tuple[float, tuple[float, float, float], gp.Factor]]:
        """The hyperparameter settings of ``grid`` weighted by their posterior (marginal
        likelihood times ``_log_hyperprior``), the likeliest first, as many as carry
        ``HYPER_MASS`` of it, weights renormalised (``hyper_mass``: the share kept)."""
        scored = []
        for h in grid:
            fit = self._factor(*h)
            scored.append((fit.log_marginal_likelihood() + gp.log_hyperprior(*h), h, fit))
        scored.sort(key=lambda t: -t[0])  # stable: ties keep the grid's order
        weights = np.exp(np.array([t[0] for t in scored]) - scored[0][0])
        weights /= weights.sum()
        kept, mass = [], 0.0
        for w, (_, h, fit) in zip(weights, scored, strict=True):
            kept.append((float(w), h, fit))
            mass += float(w)
            if mass >= HYPER_MASS:
                break
        self.hyper_mass = mass
        return [(w / mass, h, fit) for w, h, fit in kept]

    @property
    def n_timed(self) -> int:
        return len(self._y)

    def components(
        self, configs: Sequence[ParallelConfig], perfs: Sequence[PerfEstimate]
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """The posterior of every hyperparameter setting kept (Rasmussen & Williams eq.
        2.25-2.26): ``(weights [K], means [K, N], sds [K, N])`` of the log correction, K settings
        and N candidates. Before any timed trial, the prior: one setting, mean 0."""
        n = len(configs)
        if self.n_timed == 0 or n == 0:
            prior_sd = math.sqrt(gp.step_time_prior_variance(self.residual_sd, self.regime_sd))
            return np.ones(1), np.zeros((1, n)), np.full((1, n), prior_sd)
        x = np.array([features(c, p) for c, p in zip(configs, perfs, strict=True)])
        r = np.array([regimes(c, self.split) for c in configs], dtype=np.int64)
        new = gp.KernelInputs(x, r, [True] * n, [c.stack or "" for c in configs], degree_array(configs))
        weights, means, sds = [], [], []
        for w, (s, ell, a), fit in self._mixture:
            ks = gp.step_time_kernel(new, self._inputs, s, ell, a)
            weights.append(w)
            means.append(fit.mean(ks))
            sds.append(np.sqrt(fit.variance(ks, gp.step_time_prior_variance(s, a))))
        return np.array(weights), np.array(means), np.array(sds)

    def predict_many(self, configs: Sequence[ParallelConfig], perfs: Sequence[PerfEstimate]) -> list[Prediction]:
        """Predictions of this job's candidates: the mixture over hyperparameter settings
        (``components``) as one Gaussian with its mean and variance."""
        if not configs:
            return []
        return collapse(perfs, *self.components(configs, perfs))

    def predict(self, config: ParallelConfig, perf: PerfEstimate) -> Prediction:
        return self.predict_many([config], [perf])[0]

    def feasibility(
        self, configs: Sequence[ParallelConfig], memories: Sequence[MemoryEstimate]
    ) -> list[tuple[float, float]]:
        """``(p_fit, p_runs)`` per candidate: its chance to fit in memory and to run at all; in a
        plan over several stacks, from the trials of the candidate's own stack only (another
        stack's estimator errs otherwise, and its crashes are its code's)."""
        stacks = {c.stack for c in configs} | {o.config.stack for o in self._own}
        if len(stacks) <= 1:
            return list(zip(self.memory.p_fit(configs, memories), self.runs.p_runs(configs), strict=True))
        out: list[tuple[float, float]] = [(0.0, 0.0)] * len(configs)
        for stack in {c.stack or "" for c in configs}:
            index = [i for i, c in enumerate(configs) if (c.stack or "") == stack]
            memory, runs = self._stack_models(stack)
            mine = [configs[i] for i in index]
            for i, p_fit, p_runs in zip(index, memory.p_fit(mine, [memories[i] for i in index]), runs.p_runs(mine),
                                        strict=True):
                out[i] = (p_fit, p_runs)
        return out

    def _stack_models(self, stack: str) -> tuple[MemoryModel, RunsModel]:
        if stack not in self._by_stack:
            own = [o for o in self._own if (o.config.stack or "") == stack]
            self._by_stack[stack] = (
                MemoryModel([MemoryPoint(o.config, o.memory, o.measurement) for o in own], self._fits_prior),
                RunsModel([(o.config, o.measurement, o.attempts) for o in own]),
            )
        return self._by_stack[stack]

    def summary(self) -> dict[str, float | int]:
        """How much the model trusts the analytic prior, and the noise it measured."""
        return {"timed_trials": self.n_timed, "residual_sd": self.residual_sd, "length_scale": self.length_scale,
                "regime_sd": self.regime_sd, "hyper_settings": len(self._mixture),
                "hyper_mass": self.hyper_mass,
                "trial_noise_sd": self.trial_noise_sd, "noise_dof": self.noise_dof,
                "memory_offset_sd": self.memory.offset_sd, "memory_residual_sd": self.memory.residual_sd,
                "memory_points": self.memory.n, "crashes": self.runs.n_failed}


def collapse(
    perfs: Sequence[PerfEstimate], weights: FloatArray, means: FloatArray, sds: FloatArray
) -> list[Prediction]:
    """The mixture of ``LearnedModel.components`` as one Gaussian per candidate, of the
    mixture's mean and variance."""
    first = weights @ means
    var = np.maximum(weights @ (sds**2 + means**2) - first**2, 1e-8)
    return [Prediction(p.step_time, float(m), float(math.sqrt(v))) for p, m, v in zip(perfs, first, var, strict=True)]


def outlier_distances(configs: Sequence[ParallelConfig], residuals: FloatArray) -> list[float]:
    """Per timed run: how far (log) its residual lies above its peers', when that is more than
    ``OUTLIER_LOG`` (an outlier run, trusted less: its noise becomes that distance), else 0.

    Peers are the runs of its regime cell (same tp and pp, two at least); without those, the
    runs of its row and of its column (same tp at another pp, same pp at another tp, one at
    least of each); every peer splits sequences and experts as it does (same cp and ep: a cp = 2
    run slower than its cp = 1 mates is the ring's cost until another cp = 2 run says otherwise,
    not an odd run), when it is slower than both by more than ``OUTLIER_LOG``: the regime term is
    additive over tp and pp (``gp.step_time_kernel``), so a run slower than its tp-mates and
    its pp-mates alike is one no regime factor explains, and taken at face value it moves every
    candidate of its tp by its whole residual. Replay, Ultra-Scale 8B on 1 node: the first
    trial, tp1-pp2-dp4, ran 2.7x its prediction (its pp-mates at tp 2-4 and its tp-mate at pp 8
    near theirs); the additive fit put the tp-1 factor at +0.9 (the best, tp1-pp4-dp2, predicted
    44 s against its 17 s at sd 0.13) and the search converged with the best untried, 5.1% slower,
    on every seed (docs/models.md, "The boundary's open targets"). A whole tp or pp slower than predicted is what
    the regime term must learn: its mates are slow too, and nothing is discounted.

    An odd run is one run: a slowness another run repeats is the cluster's, not a glitch, and is
    not discounted (``_confirmed``): a mate of its cell as slow, or a run of its tp at another pp
    as much slower than that pp's other runs (or of its pp at another tp, than that tp's): the
    tp's factor then depends on the pp, an interaction the additive term cannot show but the
    trials must. Replay, Ultra-Scale 8B on 16 nodes: tp4-pp2 ran 2.8x the best and tp4-pp4 7.9x,
    tp 4 at pp 1 and pp 2-4 at tp 1-2 as predicted; both discounted, the search tried a third
    tp-4 pipeline and found the best at trial 19, after its stop (docs/models.md, "Interactions of regimes")."""
    excess = [_row_column_excess(configs, residuals, i) for i in range(len(configs))]
    out = [0.0] * len(configs)
    for i, c in enumerate(configs):
        others = [j for j in range(len(configs)) if j != i]
        cell = [residuals[j] for j in others if _cell(configs[j]) == _cell(c)]
        if len(cell) >= 2:
            dist = float(residuals[i] - np.median(cell))
        elif _confirmed(configs, residuals, excess, i):
            continue
        else:
            row, column = excess[i]
            if row is None or column is None:
                continue
            dist = min(row, column)
        if dist > OUTLIER_LOG:
            out[i] = dist
    return out


def _row_column_excess(
    configs: Sequence[ParallelConfig], residuals: FloatArray, i: int
) -> tuple[float | None, float | None]:
    """How far run ``i``'s residual lies above the median of its row (same tp, another pp) and of
    its column (same pp, another tp); None where it has no such mate."""
    c = configs[i]
    mates = [(j, o) for j, o in enumerate(configs) if _splits(o) == _splits(c)]
    row = [residuals[j] for j, o in mates if o.tp == c.tp and o.pp != c.pp]
    column = [residuals[j] for j, o in mates if o.pp == c.pp and o.tp != c.tp]
    return (float(residuals[i] - np.median(row)) if row else None,
            float(residuals[i] - np.median(column)) if column else None)


def _confirmed(configs: Sequence[ParallelConfig], residuals: FloatArray,
               excess: Sequence[tuple[float | None, float | None]], i: int) -> bool:
    """Whether another run repeats run ``i``'s slowness (``outlier_distances``): a run of its cell
    within ``OUTLIER_LOG`` of it or slower, a run of its tp at another pp more than
    ``OUTLIER_LOG`` above its own column, or one of its pp at another tp above its own row."""
    c = configs[i]
    for j, o in enumerate(configs):
        if j == i or _splits(o) != _splits(c):
            continue
        row, column = excess[j]
        if (o.tp, o.pp) == (c.tp, c.pp):
            if residuals[j] > residuals[i] - OUTLIER_LOG:
                return True
        elif o.tp == c.tp and column is not None and column > OUTLIER_LOG:
            return True
        elif o.pp == c.pp and row is not None and row > OUTLIER_LOG:
            return True
    return False


def _splits(config: ParallelConfig) -> tuple[int, int]:
    """cp and ep: a run's peers (``outlier_distances``) split sequences and experts as it does."""
    return config.cp, config.ep


def _cell(config: ParallelConfig) -> tuple[int, int, int, int]:
    return config.tp, config.pp, *_splits(config)


def regimes(config: ParallelConfig, split: Sequence[str] = ()) -> tuple[int, ...]:
    """The categorical regimes of the regime term: tp, pp, ZeRO stage, recompute mode, and the
    degrees of ``split`` (``split_degrees``)."""
    return (config.tp, config.pp, config.zero_stage, _RECOMPUTE_CODE.get(config.recompute, len(_RECOMPUTE_CODE)),
            *(int(getattr(config, d)) for d in split))


#: The degrees that split sequences (context parallelism) and experts (expert parallelism).
SPLIT_DEGREES: tuple[str, ...] = ("cp", "ep")


def split_degrees(configs: Sequence[ParallelConfig]) -> tuple[str, ...]:
    """The ``SPLIT_DEGREES`` some of ``configs`` take above 1: regimes of the kernel in a space
    that has them. Only there: a regime every candidate shares would still change the kernel
    (the share of regimes two candidates have in common, ``gp.step_time_kernel``), and a job
    without cp or ep keeps the four regimes it was tuned with."""
    return tuple(d for d in SPLIT_DEGREES if any(getattr(c, d) != 1 for c in configs))


_RECOMPUTE_CODE = {"none": 0, "selective": 1, "full": 2}


def _observed_time(o: Observation) -> float | None:
    m = o.measurement
    if m.status in ("ok", "pruned") and m.step_times:
        return m.step_time
    return None


def _step_noise_sd(m: Measurement) -> float:
    """The log-space standard error of a trial's step time from its own steps' spread."""
    if m.status == "pruned":
        return PRUNED_NOISE_SD
    logs = np.log(np.asarray(m.step_times, dtype=np.float64))
    return float(logs.std(ddof=1) / math.sqrt(len(logs))) if len(logs) > 1 else 0.0


def noise_floor_sd(device_kind: str) -> float:
    """The prior of the trial-to-trial spread on ``device_kind``'s trials."""
    return CPU_NOISE_FLOOR_SD if device_kind == "cpu" else NOISE_FLOOR_SD


def trial_noise(observations: Sequence[Observation], floor_sd: float = NOISE_FLOOR_SD) -> tuple[float, float]:
    """The trial-to-trial sd of one candidate's log step time, pooled over candidates timed
    more than once (ok trials of this job), shrunk to the prior ``floor_sd``: ``(sd, degrees of
    freedom)``."""
    by_config: dict[str, list[float]] = {}
    for o in observations:
        t = _observed_time(o)
        if o.measurement.status == "ok" and t is not None:
            by_config.setdefault(f"{o.job_key}/{o.config.label}", []).append(math.log(t))
    ss, dof = 0.0, 0
    for logs in by_config.values():
        if len(logs) > 1:
            ss += float(((np.array(logs) - np.mean(logs)) ** 2).sum())
            dof += len(logs) - 1
    var = (NOISE_PRIOR_DOF * floor_sd**2 + ss) / (NOISE_PRIOR_DOF + dof)
    return math.sqrt(var), float(dof)
