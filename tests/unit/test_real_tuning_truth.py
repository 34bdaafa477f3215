"""``tests/benchmarks/real_tuning.py``'s yardstick: how sure its exhaustive ground truth is."""

from __future__ import annotations

import pytest

from tests.benchmarks.real_tuning import ground_truth_certainty


def test_clearly_separated_candidates_give_a_sure_verdict() -> None:
    medians = {"fast": [1.00, 1.01, 0.99, 1.00], "slow": [1.20, 1.22, 1.19], "close": [1.02, 1.03, 1.02]}
    within, best = ground_truth_certainty(medians, ["slow", "close", "slow"], resamples=500)
    assert within == {"slow": 0.0, "close": 1.0}  # a pick shared by runs is counted once per resample
    assert best == {"fast": 1.0}


def test_noisy_trials_leave_the_verdict_open() -> None:
    """Two candidates whose trials overlap (30% spread, like the 2-core machine's): each is
    the best in a fair share of resamples, and the slower-looking one is within 5% in part."""
    medians = {"a": [0.125, 0.130, 0.140, 0.160], "b": [0.120, 0.138, 0.150, 0.165]}
    within, best = ground_truth_certainty(medians, ["b"], resamples=2000, seed=1)
    assert 0.2 < best["a"] < 0.8 and best["a"] + best["b"] == pytest.approx(1.0)
    assert 0.3 < within["b"] < 1.0


def test_candidates_without_an_ok_trial_are_left_out() -> None:
    within, best = ground_truth_certainty({"a": [1.0], "gone": []}, ["a"], resamples=10)
    assert within == {"a": 1.0} and best == {"a": 1.0}
