"""Will a candidate run? Memory and crashes learned per neighbourhood from the trials.

Memory. A Gaussian process (Rasmussen & Williams 2006, eq. 2.25-2.26) on the estimator's
log error ``r = log(measured peak / predicted peak)`` over the candidate's memory features
(its degrees, cp and ep included, micro-batch, ZeRO stage, recomputation and the shares of
its predicted memory breakdown), with a kernel of a small constant term (the estimator is off by a
common factor on this cluster) plus an RBF term (it is off differently for different
families of candidates). A trial that ran gives ``r`` from its measured peak (its tensors,
plus the estimate's ``overhead``, which no tensor counter sees). A trial that ran out of
memory says only ``peak >= capacity``: a censored observation, entered as the site of one
expectation-propagation step against the prior (``censored_point``, Rasmussen & Williams
ch. 3.6): sharp for a surprise, wide for an OOM the prior expected. The chance that a candidate fits is then
``p_fit = Phi((log(capacity / predicted) - mu) / sd)`` under the posterior ``N(mu, sd^2)``.

So an OOM moves the candidates like it (same layout, larger micro-batch or less
recomputation) and leaves unlike ones (another tp, pp, ZeRO stage or recompute mode) almost
where the estimator put them: it is not a global memory ceiling. The GP's prior is the stack's
measured error (``pipette.fits.FitsPrior``: a mean ``mu`` and a total sd, split between the
constant and the RBF term in the proportions below), so with no trials ``p_fit`` is the plan's
chance to fit, and the search weights every candidate by it (constrained expected improvement,
Gardner et al. 2014): a candidate next to the memory limit is tried when what it may gain is
worth its chance of a cheap out-of-memory trial.

A measured need is what the device held: on a GPU the allocator's peak reserved bytes plus
the memory outside it (``workers.rank.memory.allocator_record``), else the tensor peak plus the
estimate's ``overhead``.

Crashes that are not memory (``failed``, ``timeout`` after retries) are learned as a
probability of running per neighbourhood: a kernel-weighted Beta-Bernoulli estimate
(Nadaraya-Watson weights, a Beta(``RUNS_PRIOR_A``, ``RUNS_PRIOR_B``) prior) over the
candidate's layout features, an outcome at the same pipeline depth weighing at least
``RUNS_SAME_PP_WEIGHT`` (crashes cluster by pp); a trial that crashed in its first try and
its retries counts once per attempt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from pipette import gp
from pipette.config import ParallelConfig
from pipette.estimates import MEMORY_PARTS, MemoryEstimate
from pipette.fits import CPU, FitsPrior
from pipette.measurement import Measurement

FloatArray = gp.FloatArray

#: Prior sd of the estimator's common log error on a cluster (its MAPE is 4.6% on the H100
#: set, 11.5% on Ultra-Scale; docs/results.md, "Peak memory and fits").
MEMORY_OFFSET_SD = 0.1
#: Prior sd of a family's own log error (Ultra-Scale: measured / predicted 0.5-2.1x).
MEMORY_RESIDUAL_SD = 0.2
#: RBF length scale over the memory features (each O(1) per doubling or per mode).
MEMORY_LENGTH_SCALE = 1.5
#: Noise of one measured peak in log space (allocator rounding, fragmentation).
PEAK_NOISE_SD = 0.03
#: An out-of-memory trial enters as a peak this far (log) past the capacity, with this noise.
OOM_EXCESS_LOG = 0.05
OOM_NOISE_SD = 0.03
#: With this many memory observations the offset and residual sds are fitted (ML-II).
MEMORY_MIN_FOR_FIT = 3
MEMORY_OFFSET_GRID = (0.05, 0.1, 0.3, 0.6)
MEMORY_RESIDUAL_GRID = (0.1, 0.2, 0.4)
#: A candidate is excluded when the trials lowered its chance to fit below this (a chance the
#: plan gave it, however low, above ``pipette.fits.KEEP_THRESHOLD``, stands until a trial
#: speaks), or its chance to run at all below ``P_RUNS_MIN``.
P_FIT_MIN = 0.25
P_RUNS_MIN = 0.25
#: Beta prior of the chance that a candidate runs (mean 0.9, weight of 2 trials).
RUNS_PRIOR_A = 1.8
RUNS_PRIOR_B = 0.2
RUNS_PRIOR = RUNS_PRIOR_A / (RUNS_PRIOR_A + RUNS_PRIOR_B)
#: Length scale of the crash neighbourhood (layout features only).
RUNS_LENGTH_SCALE = 1.0
#: A crash (or a run) also counts with this weight for every candidate of the same pipeline
#: depth, however far its other features: crashes cluster by pp (Ultra-Scale set: 4 of 587
#: rows at pp 1 crashed, 55 of 206 at pp 16, 48 of 104 at pp 32; replay benchmark, 1B on 32
#: nodes: with the RBF alone and a retried crash counted once, 6 pp-16 candidates crashed one
#: after another, 12 attempts, to the end of the budget; with the attempts counted, fewer
#: failed+OOM trials: docs/results.md, "Evidence behind the tuner's constants").
RUNS_SAME_PP_WEIGHT = 1.0

_RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0}


def needs_at_least(config: ParallelConfig, other: ParallelConfig) -> bool:
    """Whether ``config`` needs at least the memory ``other`` needs, whatever the estimator's
    error: the same layout (degrees cp and ep included, schedule, FSDP sharding and offload) with a micro-batch no
    smaller (activations grow with it: Korthikanti et al. 2022, eq. 2), no more recomputation
    (none keeps every activation, selective all but attention's, full only the layer inputs)
    and a ZeRO stage no higher (each stage partitions one more of optimizer states, gradients,
    parameters across dp and keeps the rest whole: Rajbhandari et al. 2020, fig. 1). So an
    out-of-memory trial of ``other`` is one of ``config`` too: a monotonicity rule, not a
    neighbourhood."""
    same_layout = _layout(config) == _layout(other)
    recompute = _RECOMPUTE.get(config.recompute)
    other_recompute = _RECOMPUTE.get(other.recompute)
    return (same_layout and config.mbs >= other.mbs and config.zero_stage <= other.zero_stage
            and recompute is not None and other_recompute is not None and recompute <= other_recompute)


def _layout(config: ParallelConfig) -> tuple[object, ...]:
    return (config.tp, config.pp, config.dp, config.cp, config.ep, config.etp, config.schedule,
            config.virtual_stages, config.dp_shard, config.offload)


def layout_features(config: ParallelConfig) -> list[float]:
    """The candidate's shape: degrees, micro-batch, ZeRO stage and recomputation (the degrees that
    split sequences and experts: ``degree_features``)."""
    return [
        math.log2(config.tp), math.log2(config.pp), math.log2(config.dp), math.log2(config.mbs),
        config.zero_stage / 1.5, 2.0 * _RECOMPUTE.get(config.recompute, 0.0), math.log2(config.virtual_stages),
    ]


def degree_features(config: ParallelConfig) -> list[float]:
    """The degrees that split each sequence (cp) and the experts (ep), log2 as tp's and pp's: two
    more features of the candidate's shape, 0 for a candidate that splits neither. They are kept
    apart from ``layout_features`` and ``memory_features`` and enter every RBF as a factor of
    their own (``near``), which is the RBF over all the features together
    (exp(-(d1 + d2) / 2l^2) = exp(-d1 / 2l^2) exp(-d2 / 2l^2)) and leaves a job without cp or ep
    its kernels to the bit (appending two zero columns reorders numpy's pairwise sum)."""
    return [math.log2(config.cp), math.log2(config.ep)]


def degree_array(configs: Sequence[ParallelConfig]) -> FloatArray:
    """``degree_features`` of every candidate, one row each."""
    return np.array([degree_features(c) for c in configs], dtype=np.float64).reshape(len(configs), 2)


def near(xa: FloatArray, da: FloatArray, xb: FloatArray, db: FloatArray, length_scale: float) -> FloatArray:
    """The RBF over features ``x`` and degrees ``d`` together (``degree_features``)."""
    return np.asarray(gp.rbf(xa, xb, length_scale) * gp.rbf(da, db, length_scale), dtype=np.float64)


def memory_features(config: ParallelConfig, memory: MemoryEstimate) -> FloatArray:
    """Degrees and micro-batch plus where the estimator says the bytes go (two candidates whose
    peaks are both mostly activations err alike); cp and ep join them in the kernel
    (``degree_features``: a cp = 2 trial's error is its neighbours' more than a cp = 1 twin's).
    The ZeRO stage and the recomputation enter only through those shares: where they change no
    byte (ZeRO 0-2 under LoRA, selective recomputation with flash attention) the candidates need
    the same memory, and an OOM of one is an OOM of the other."""
    total = memory.peak_bytes if memory.peak_bytes > 0 else 1
    shares = [2.0 * memory.breakdown.get(k, 0) / total for k in MEMORY_PARTS]
    shape = [math.log2(config.tp), math.log2(config.pp), math.log2(config.dp), math.log2(config.mbs),
             math.log2(config.virtual_stages)]
    return np.array([*shape, *shares], dtype=np.float64)


@dataclass(frozen=True)
class MemoryPoint:
    """One trial as the memory model sees it."""

    config: ParallelConfig
    memory: MemoryEstimate
    measurement: Measurement


def measured_need(memory: MemoryEstimate, m: Measurement) -> int | None:
    """What a trial that ran needed of its device, in the estimate's terms (module docstring)."""
    allocator = m.details.allocator
    reserved, outside = allocator.peak_reserved_bytes, allocator.outside_allocator_bytes
    if reserved and outside:
        return max(int(r) + int(o) for r, o in zip(reserved, outside, strict=True))
    if m.peak_memory_max:
        return int(m.peak_memory_max) + memory.breakdown.get("overhead", 0)
    return None


class MemoryModel:
    """The estimator's error learned from measured peaks and OOMs (module docstring)."""

    def __init__(self, points: Sequence[MemoryPoint] = (), prior: FitsPrior = CPU) -> None:
        self.prior = prior
        xs, ys, noise, kept = [], [], [], []
        #: the candidates that ran out of memory (``needs_at_least``: what dominates one does too)
        self.out_of_memory: list[ParallelConfig] = [p.config for p in points if p.measurement.status == "oom"]
        for p in points:
            if p.memory.peak_bytes <= 0:
                continue
            m = p.measurement
            need = measured_need(p.memory, m) if m.status in ("ok", "pruned") else None
            if m.status == "oom":
                y, sd = censored_point(math.log(p.memory.capacity_bytes / p.memory.peak_bytes) - prior.mu, prior.sd)
            elif need:
                y, sd = math.log(need / p.memory.peak_bytes) - prior.mu, PEAK_NOISE_SD
            else:
                continue
            xs.append(memory_features(p.config, p.memory))
            ys.append(y)
            noise.append(sd)
            kept.append(p.config)
        self.n = len(ys)
        self._x = np.array(xs) if xs else np.zeros((0, 0))
        self._d = degree_array(kept)
        self._y = np.array(ys, dtype=np.float64)
        self._noise2 = np.array(noise, dtype=np.float64) ** 2
        self.offset_sd, self.residual_sd = _prior_sds(prior)
        if self.n >= MEMORY_MIN_FOR_FIT:
            self.offset_sd, self.residual_sd = max(
                ((b, s) for b in MEMORY_OFFSET_GRID for s in MEMORY_RESIDUAL_GRID),
                key=lambda h: self._factor(*h).log_marginal_likelihood(),
            )
        self._fit = self._factor(self.offset_sd, self.residual_sd) if self.n else None

    def _k(self, xa: FloatArray, da: FloatArray, b: float, s: float) -> FloatArray:
        """The covariance of points ``(xa, da)`` (memory and degree features) with the trials'."""
        return np.asarray(b**2 + s**2 * near(xa, da, self._x, self._d, MEMORY_LENGTH_SCALE), dtype=np.float64)

    def _factor(self, b: float, s: float) -> gp.Factor:
        return gp.factor(self._k(self._x, self._d, b, s) + np.diag(self._noise2), self._y)

    def error(
        self, configs: Sequence[ParallelConfig], memories: Sequence[MemoryEstimate]
    ) -> tuple[FloatArray, FloatArray]:
        """Posterior mean and sd of ``log(true peak / predicted peak)`` per candidate."""
        prior = self.offset_sd**2 + self.residual_sd**2
        if not configs:
            return np.zeros(0), np.zeros(0)
        if self._fit is None:
            return np.full(len(configs), self.prior.mu), np.full(len(configs), math.sqrt(prior + PEAK_NOISE_SD**2))
        x = np.array([memory_features(c, m) for c, m in zip(configs, memories, strict=True)])
        ks = self._k(x, degree_array(configs), self.offset_sd, self.residual_sd)
        var = self._fit.variance(ks, prior)
        return self._fit.mean(ks) + self.prior.mu, np.sqrt(var + PEAK_NOISE_SD**2)

    def p_fit(self, configs: Sequence[ParallelConfig], memories: Sequence[MemoryEstimate]) -> list[float]:
        """The chance that each candidate's true peak is within its capacity: 0 for one that
        needs at least what a candidate that ran out of memory needed (``needs_at_least``).
        Without the rule the Gaussian process left such a candidate above ``P_FIT_MIN`` when
        the out-of-memory trial was one the prior expected (a wide site) and the two differ in
        a feature it weighs: replay, Ultra-Scale 1B on 2 nodes, ZeRO-1 mbs 32 ran out of memory
        and its ZeRO-0 twin was tried next (docs/models.md, "The boundary's open targets")."""
        mean, sd = self.error(configs, memories)
        return [0.0 if any(needs_at_least(c, o) for o in self.out_of_memory) else float(norm.cdf((h - mu) / s))
                for c, h, mu, s in zip(configs, _headroom(memories), mean, sd, strict=True)]


def _headroom(memories: Sequence[MemoryEstimate]) -> list[float]:
    return [math.log(m.capacity_bytes / m.peak_bytes) if m.peak_bytes > 0 else math.inf for m in memories]


def censored_point(bound: float, prior_sd: float) -> tuple[float, float]:
    """An out-of-memory trial as a point for the GP, (value, noise sd): its error is past
    ``bound`` (centred on the prior's mean). The point is the site of one expectation-
    propagation step (Rasmussen & Williams sec. 3.6, eq. 3.58): the Gaussian that, multiplied
    with the prior, gives the mean and variance of the prior truncated at the bound. A
    surprise (an OOM the prior thought unlikely) is a sharp point past the bound; an OOM the
    prior expected is a wide one that changes little."""
    alpha = bound / prior_sd
    tail = float(norm.sf(alpha))
    hazard = float(norm.pdf(alpha)) / tail if tail > 1e-12 else alpha
    mean = prior_sd * hazard
    var = prior_sd**2 * max(1.0 + alpha * hazard - hazard**2, 1e-6)
    site_var = 1.0 / max(1.0 / var - 1.0 / prior_sd**2, 1e-6)
    return max(site_var * mean / var, bound + OOM_EXCESS_LOG), max(OOM_NOISE_SD, math.sqrt(site_var))


def _prior_sds(prior: FitsPrior) -> tuple[float, float]:
    """(offset sd, residual sd) of the GP whose total prior sd, with a peak's noise, is the
    prior's: split in the proportions of MEMORY_OFFSET_SD and MEMORY_RESIDUAL_SD."""
    kernel = math.sqrt(max(prior.sd**2 - PEAK_NOISE_SD**2, 1e-6))
    scale = kernel / math.hypot(MEMORY_OFFSET_SD, MEMORY_RESIDUAL_SD)
    return MEMORY_OFFSET_SD * scale, MEMORY_RESIDUAL_SD * scale


class RunsModel:
    """The chance that a candidate runs at all (does not crash for a reason other than memory)."""

    def __init__(self, outcomes: Sequence[tuple[ParallelConfig, Measurement, int]] = ()) -> None:
        """``outcomes``: (candidate, its trial's last attempt, the attempts it took). A trial
        that failed after its retries failed that many times: each attempt counts."""
        xs, ran, pps, weight, kept = [], [], [], [], []
        for config, m, attempts in outcomes:
            if m.status in ("failed", "timeout"):
                if m.lost_nodes:
                    continue  # the cluster's failure, not the candidate's
                outcome, times = 0.0, max(1, attempts)
            elif m.status in ("ok", "pruned", "oom"):  # it started and stepped (or ran out of memory)
                outcome, times = 1.0, 1
            else:
                continue
            xs.append(layout_features(config))
            kept.append(config)
            ran.append(outcome)
            pps.append(config.pp)
            weight.append(times)
        self.n_failed = int(sum(w for r, w in zip(ran, weight, strict=True) if r == 0.0))
        self._x = np.array(xs, dtype=np.float64) if xs else np.zeros((0, 0))
        self._d = degree_array(kept)
        self._ran = np.array(ran, dtype=np.float64)
        self._pp = np.array(pps, dtype=np.int64)
        self._weight = np.array(weight, dtype=np.float64)

    def p_runs(self, configs: Sequence[ParallelConfig]) -> list[float]:
        if self.n_failed == 0 or not configs:
            return [RUNS_PRIOR] * len(configs)
        x = np.array([layout_features(c) for c in configs], dtype=np.float64)
        w = near(x, degree_array(configs), self._x, self._d, RUNS_LENGTH_SCALE)
        same_pp = np.equal.outer(np.array([c.pp for c in configs], dtype=np.int64), self._pp)
        w = np.maximum(w, RUNS_SAME_PP_WEIGHT * same_pp) * self._weight
        ran = w @ self._ran
        total = w.sum(1)
        return [float(v) for v in (RUNS_PRIOR_A + ran) / (RUNS_PRIOR_A + RUNS_PRIOR_B + total)]


__all__ = [
    "P_FIT_MIN", "P_RUNS_MIN", "RUNS_PRIOR", "MemoryModel", "MemoryPoint", "RunsModel", "degree_array",
    "degree_features", "layout_features", "measured_need", "memory_features", "near", "needs_at_least",
]
