"""Every step-time constant says where it came from (issue 45): pipette.constant_sources names it,
the set and how many rows fitted it; a constant calibrated on one published figure says which."""

from __future__ import annotations

import importlib
from pathlib import Path

from pipette.constant_sources import CALIBRATED, COUNTED, FITTED, SOURCES, calibrated_rows
from tests.benchmarks.calibration import DATA_FILES

REPO = Path(__file__).resolve().parents[2]


def _resolve(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{name} does not resolve")


def test_every_source_names_a_constant_that_exists() -> None:
    for s in SOURCES:
        value = _resolve(s.constant)
        assert isinstance(value, (int, float, bool)), s.constant


def test_fitted_constants_name_their_data_and_row_count() -> None:
    for s in SOURCES:
        assert s.how in (FITTED, COUNTED, CALIBRATED)
        if s.how == FITTED:
            assert s.rows > 0 and s.data, s.constant
            named = [f for f in DATA_FILES if f in s.data]
            path = s.data.split()[0]
            assert named or (REPO / path).exists() or (REPO / "tests" / "benchmarks" / path).exists(), s.constant


def test_the_megatron_fp8_overlap_is_labelled_calibrated_on_mlperfs_figure() -> None:
    assert any("MLPerf Training v4.0 Llama-2-70B LoRA" in row for row in calibrated_rows())
