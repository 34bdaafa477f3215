"""The repo carries the measured data its models are fitted on (``data/calibration``): every file
the loaders read, complete, each with its source and license, found by one helper, so a clone
reproduces the fits and the accuracy tables instead of skipping them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pipette.errors import PipetteError
from tests.benchmarks.calibration import (
    DATA_DIR,
    DATA_FILES,
    STACK_SETS,
    calibration_dir,
    load_h100_single_gpu,
    load_ultrascale,
    load_vtrain,
)

REPO = Path(__file__).resolve().parents[2]


def test_the_calibration_data_is_found_inside_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPETTE_CALIBRATION_DIR", raising=False)
    assert calibration_dir() == REPO / "data" / "calibration" == DATA_DIR


def test_the_repo_carries_exactly_the_files_the_loaders_read() -> None:
    assert set(STACK_SETS) <= set(DATA_FILES)
    assert sorted(p.name for p in DATA_DIR.glob("*.csv")) == sorted(DATA_FILES)
    # the measured tables only, not the large kernel tables nothing reads
    assert sum((DATA_DIR / n).stat().st_size for n in DATA_FILES) < 1024 * 1024
    if (REPO / ".git").exists():  # tracked, so a clone has them
        tracked = subprocess.run(["git", "ls-files", "data/calibration"], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.split()
        assert {f"data/calibration/{n}" for n in DATA_FILES} | {"data/calibration/README.md"} <= set(tracked)


def test_each_file_names_its_source_and_license() -> None:
    readme = (DATA_DIR / "README.md").read_text()
    # a file's entry starts at its heading or its bullet and runs to the next entry
    starts = {n: re.search(rf"^(## {re.escape(n)}$|- `{re.escape(n)}`)", readme, re.M) for n in DATA_FILES}
    assert all(starts.values()), [n for n, m in starts.items() if m is None]
    positions = [*sorted(m.start() for m in starts.values() if m), len(readme)]
    for name, m in starts.items():
        assert m is not None
        entry = readme[m.start():positions[positions.index(m.start()) + 1]]
        assert "Source:" in entry and "License:" in entry, name


def test_the_copies_are_complete() -> None:
    """Row counts as data/calibration/README.md states them."""
    assert len(load_vtrain(DATA_DIR)) == 1440
    assert len(load_ultrascale(DATA_DIR)) == 2483
    assert len(load_h100_single_gpu(DATA_DIR)) == 16


def test_a_missing_override_folder_is_an_error_not_a_skip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PIPETTE_CALIBRATION_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(PipetteError, match="unset PIPETTE_CALIBRATION_DIR"):
        calibration_dir()
