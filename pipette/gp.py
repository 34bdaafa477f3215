"""Gaussian-process regression, the parts both learned models share (``pipette.learned`` for
the step time, ``pipette.feasibility`` for memory): the squared-exponential kernel, the
Cholesky factor of the training covariance, the log marginal likelihood and the posterior at
new points (Rasmussen & Williams 2006, "Gaussian Processes for Machine Learning", alg. 2.1,
eq. 2.25-2.26 and 2.30); and the step-time model's kernel (``step_time_kernel``: an offset, an RBF
over the candidate's features, an additive regime term and the coregionalization of stacks; the
terms are described in ``pipette.learned``) with its priors and the grids of its hyperparameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# ---- the step-time kernel's priors ---------------------------------------------------------
#: Prior standard deviation of the common log offset (a factor of e^1 either way).
PRIOR_OFFSET_SD = 1.0
#: Prior standard deviation of the candidate-specific log correction: about the analytic
#: model's measured error (vTrain MAPE 7.5%, Ultra-Scale healthy rows 34%; docs/results.md).
PRIOR_RESIDUAL_SD = 0.3
#: RBF length scale over the features (each is O(1) per doubling or per mode).
LENGTH_SCALE = 1.5
#: Prior standard deviation of the per-regime log correction (the regime term).
PRIOR_REGIME_SD = 0.5
#: The grids the residual sd and length scale are averaged over once enough trials are timed.
RESIDUAL_SD_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
LENGTH_SCALE_GRID = (0.75, 1.5, 3.0)
#: The regime sd's grid values and their prior weights (relative; R&W sec. 5.2). 1 : 4 against
#: switching the term off (a = 0): with 3-5 agreeing trials the likelihood alone chose a = 0 and
#: was sure of regimes it had not tried. 8 : 1 for a = 1 over a = 0.5: four regimes share a^2, and
#: the 80B runs were 2-7x slow per regime (issue 15). Replays: docs/results.md, "Evidence behind the tuner's constants".
REGIME_SD_PRIOR: dict[float, float] = {0.0: 0.25, 0.5: 1.0, 1.0: 8.0}
REGIME_SD_GRID = tuple(REGIME_SD_PRIOR)
#: The regime term's pairwise interactions (a (tp, pp), (tp, ZeRO), ... cell of its own), weighed
#: against its main effects; the term's prior variance stays ``a^2``, shared between the two: a tp
#: can be slow at one pp only (the replays behind the weight: docs/models.md).
REGIME_INTERACTION = 1.0
#: Correlation of the candidate-specific correction between two different jobs.
CROSS_JOB_CORRELATION = 0.5
#: Correlation of the correction (offset included) between two stacks' candidates of one plan: the
#: off-diagonal of the coregionalization matrix. Both stacks train one model on the same devices,
#: with other code and constants: one stack's trials move the other's predictions by half as much.
CROSS_STACK_CORRELATION = 0.5


def squared_distances(xa: FloatArray, xb: FloatArray) -> FloatArray:
    """``|a - b|^2`` for every pair of rows."""
    return np.asarray(((xa[:, None, :] - xb[None, :, :]) ** 2).sum(-1), dtype=np.float64)


def rbf(xa: FloatArray, xb: FloatArray, length_scale: float) -> FloatArray:
    """The squared-exponential kernel with unit variance (R&W eq. 2.16)."""
    return np.asarray(np.exp(-squared_distances(xa, xb) / (2 * length_scale**2)), dtype=np.float64)


@dataclass(frozen=True)
class Factor:
    """The training covariance ``K + noise`` as its lower Cholesky factor, and
    ``alpha = (K + noise)^-1 y`` (R&W alg. 2.1, lines 2-3)."""

    chol: FloatArray
    alpha: FloatArray
    y: FloatArray

    def log_marginal_likelihood(self) -> float:
        """R&W eq. 2.30."""
        n = len(self.y)
        return float(-0.5 * self.y @ self.alpha - np.log(np.diag(self.chol)).sum() - 0.5 * n * math.log(2 * math.pi))

    def mean(self, k_star: FloatArray) -> FloatArray:
        """Posterior mean at new points, ``k_star`` their covariance with the training points
        (R&W eq. 2.25)."""
        return np.asarray(k_star @ self.alpha, dtype=np.float64)

    def variance(self, k_star: FloatArray, prior_variance: float | FloatArray) -> FloatArray:
        """Posterior variance at new points (R&W eq. 2.26), floored above zero."""
        v = np.linalg.solve(self.chol, k_star.T)
        return np.asarray(np.maximum(prior_variance - (v * v).sum(0), 1e-8), dtype=np.float64)


def factor(covariance: FloatArray, y: FloatArray) -> Factor:
    """Factor a training covariance (noise included) against the targets ``y``."""
    chol = np.asarray(np.linalg.cholesky(covariance), dtype=np.float64)
    return Factor(chol, solve_cholesky(chol, y), np.asarray(y, dtype=np.float64))


def solve_cholesky(chol: FloatArray, b: FloatArray) -> FloatArray:
    """Solve ``(L L^T) x = b`` given the lower Cholesky factor ``L``."""
    return np.asarray(np.linalg.solve(chol.T, np.linalg.solve(chol, b)), dtype=np.float64)


@dataclass(frozen=True)
class KernelInputs:
    """What the step-time kernel reads of a set of candidates: their features, their regimes
    (tp, pp, ZeRO stage, recompute; and cp, ep in a space that splits them), whether each is this
    job's, each one's stack, and the features of the degrees that split sequences and experts
    (``degrees``: log2 cp and log2 ep, ``pipette.feasibility.degree_features``; None: none)."""

    x: FloatArray
    regimes: IntArray
    own_job: list[bool]
    stacks: list[str]
    degrees: FloatArray | None = None


def step_time_kernel(a: KernelInputs, b: KernelInputs, s: float, ell: float, regime_sd: float) -> FloatArray:
    """The covariance of the log corrections of ``a`` and ``b``: ``PRIOR_OFFSET_SD^2 + (s^2 RBF(ell)
    + regime_sd^2 shared regimes) rho_job``, times the coregionalization of stacks where they differ
    (Bonilla, Chai & Williams 2008, eq. 2)."""
    near = rbf(a.x, b.x, ell)
    if a.degrees is not None and b.degrees is not None:
        # the RBF over the features and the degrees together, as the product of the two groups'
        # (exp(-(d1 + d2) / 2l^2) = exp(-d1 / 2l^2) exp(-d2 / 2l^2)): where every degree is 1 the
        # second factor is exactly 1, and a job without cp or ep keeps its kernel to the bit
        near = near * rbf(a.degrees, b.degrees, ell)
    eq = a.regimes[:, None, :] == b.regimes[None, :, :]
    # the regimes two candidates share, main effects and pairs (``REGIME_INTERACTION``)
    shared = (eq.mean(-1) + REGIME_INTERACTION * pairs_shared(eq)) / (1.0 + REGIME_INTERACTION)
    same = np.equal.outer(np.array(a.own_job), np.array(b.own_job))
    rho = np.where(same, 1.0, CROSS_JOB_CORRELATION)
    k = PRIOR_OFFSET_SD**2 + (s**2 * near + regime_sd**2 * shared) * rho
    if len(set(a.stacks) | set(b.stacks)) > 1:
        k = k * np.where(np.equal.outer(np.array(a.stacks, dtype=object), np.array(b.stacks, dtype=object)), 1.0,
                         CROSS_STACK_CORRELATION)
    return np.asarray(k, dtype=np.float64)


def step_time_prior_variance(s: float, regime_sd: float) -> float:
    """The step-time kernel's variance of one candidate with itself (its prior variance)."""
    return PRIOR_OFFSET_SD**2 + s**2 + regime_sd**2


def pairs_shared(eq: npt.NDArray[np.bool_]) -> FloatArray:
    """The share of the pairs of regimes two candidates share both of: the additive kernel's term
    of order 2 over the regimes (Duvenaud, Nickisch & Rasmussen 2011, "Additive Gaussian
    Processes", sec. 2), each regime's base kernel the equality of its category; ``eq`` is
    [A, B, D], whether candidate a and b share regime d."""
    d = eq.shape[-1]
    pairs = [eq[..., i] & eq[..., j] for i, j in combinations(range(d), 2)]
    return np.mean(pairs, axis=0, dtype=np.float64) if pairs else np.zeros(eq.shape[:-1])


def hyper_grid() -> list[tuple[float, float, float]]:
    """Every (residual sd, length scale, regime sd) setting the step-time model averages over."""
    return [(s, ell, a) for s in RESIDUAL_SD_GRID for ell in LENGTH_SCALE_GRID for a in REGIME_SD_GRID]


def log_hyperprior(s: float, ell: float, regime_sd: float) -> float:
    """The log prior of the step-time kernel's hyperparameters, up to a constant
    (``REGIME_SD_PRIOR``; flat over the residual sd and the length scale)."""
    return math.log(REGIME_SD_PRIOR[regime_sd])


__all__ = ["Factor", "FloatArray", "KernelInputs", "factor", "hyper_grid", "log_hyperprior", "pairs_shared", "rbf",
           "solve_cholesky", "squared_distances", "step_time_kernel", "step_time_prior_variance"]
