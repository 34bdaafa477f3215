"""Rank folders of killed actors are swept by the next actor (issue 43: ``/tmp/pipette-rank-*``
stayed behind when an actor was killed without ``RankProcess.kill``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from workers.host.rank_dirs import PREFIX, new_rank_dir, sweep_orphans


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_new_rank_folder_sweeps_the_folders_of_dead_actors_only(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{_dead_pid()}-abc"
    (dead / "job").mkdir(parents=True)
    (dead / "job" / "train.py").write_text("secret = 1\n")
    alive = tmp_path / f"{PREFIX}{os.getppid()}-def"  # this test's parent runs
    alive.mkdir()
    old_style = tmp_path / f"{PREFIX}xyz123"  # not named after a process: not ours to judge
    old_style.mkdir()
    other = tmp_path / "somebody-else-9"
    other.mkdir()

    made = Path(new_rank_dir(str(tmp_path)))

    assert not dead.exists()
    assert alive.is_dir() and old_style.is_dir() and other.is_dir()
    assert made.is_dir() and made.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert sweep_orphans(str(tmp_path)) == []  # nothing more to sweep: this process runs


def test_a_sweep_of_a_missing_folder_is_quiet(tmp_path: Path) -> None:
    assert sweep_orphans(str(tmp_path / "nope")) == []
