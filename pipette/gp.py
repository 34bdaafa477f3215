"""Gaussian-process regression, the parts both learned models share (``pipette.learned`` for
the step time, ``pipette.feasibility`` for memory): the squared-exponential kernel, the
Cholesky factor of the training covariance, the log marginal likelihood and the posterior at
new points (Rasmussen & Williams 2006, "Gaussian Processes for Machine Learning", alg. 2.1,
eq. 2.25-2.26 and 2.30). Each model builds its own kernel from these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


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


__all__ = ["Factor", "FloatArray", "factor", "rbf", "solve_cholesky", "squared_distances"]
