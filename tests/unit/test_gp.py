"""The shared Gaussian-process pieces (``pipette.gp``) against their textbook forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipette import gp


def test_the_posterior_interpolates_a_noiseless_point_and_returns_to_the_prior_far_away() -> None:
    x = np.array([[0.0], [1.0]])
    y = np.array([0.5, -0.25])
    fit = gp.factor(gp.rbf(x, x, 1.0) + np.diag([1e-10, 1e-10]), y)
    at = gp.rbf(x, x, 1.0)
    assert fit.mean(at) == pytest.approx(y, abs=1e-6)
    assert fit.variance(at, 1.0) == pytest.approx([1e-8, 1e-8], abs=1e-6)
    far = gp.rbf(np.array([[50.0]]), x, 1.0)
    assert fit.mean(far)[0] == pytest.approx(0.0, abs=1e-9)
    assert fit.variance(far, 1.0)[0] == pytest.approx(1.0)


def test_the_log_marginal_likelihood_is_the_multivariate_normal_density() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 2))
    y = rng.normal(size=5)
    k = 0.3 + 0.8 * gp.rbf(x, x, 1.3) + 0.01 * np.eye(5)
    sign, logdet = np.linalg.slogdet(k)
    direct = -0.5 * y @ np.linalg.solve(k, y) - 0.5 * logdet - 2.5 * math.log(2 * math.pi)
    assert sign > 0
    assert gp.factor(k, y).log_marginal_likelihood() == pytest.approx(direct, rel=1e-10)
