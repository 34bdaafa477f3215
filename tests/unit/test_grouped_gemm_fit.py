"""The shipped grouped-GEMM constant is what the carried data fits (a clone reproduces it)."""

from __future__ import annotations

import pytest

from pipette.perf_moe import DEFAULT_MOE
from tests.benchmarks.grouped_gemm_fit import fit


def test_the_shipped_half_tokens_is_the_fit_of_the_carried_rows() -> None:
    share, half, rows = fit()
    assert rows == 108
    assert half == pytest.approx(DEFAULT_MOE.grouped_half_tokens, abs=0.5)
    assert share == pytest.approx(0.485, abs=0.0005)
