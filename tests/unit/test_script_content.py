"""A script's trial records are keyed to its content, not its command line (issue 43, item 25)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipette.script import ScriptSpec
from workers.host.script_content import script_content_key


def _spec(work: Path, *args: str) -> ScriptSpec:
    return ScriptSpec(argv=("python", "train.py", *args), kind="hf-trainer", workdir=str(work))


def test_the_key_follows_the_scripts_files_not_its_folder_or_its_outputs(tmp_path: Path) -> None:
    work = tmp_path / "a"
    (work / "lib").mkdir(parents=True)
    (work / "train.py").write_text("import lib.model\n")
    (work / "lib" / "model.py").write_text("LAYERS = 2\n")
    (work / "ds.json").write_text("{}")
    key = script_content_key(_spec(work, "--output_dir", "out"))
    assert script_content_key(_spec(work, "--output_dir", "out")) == key

    (work / "out").mkdir()
    (work / "out" / "trainer_state.json").write_text('{"step": 5}')  # what a run writes
    (work / "__pycache__").mkdir()
    (work / "__pycache__" / "x.py").write_text("cached")
    assert script_content_key(_spec(work, "--output_dir", "out")) == key

    moved = tmp_path / "b"
    shutil.copytree(work, moved)
    assert script_content_key(_spec(moved, "--output_dir", "out")) == key  # the same files elsewhere

    (work / "lib" / "model.py").write_text("LAYERS = 3\n")  # a fix in a module the script imports
    assert script_content_key(_spec(work, "--output_dir", "out")) != key
    assert script_content_key(_spec(moved, "--output_dir", "out", "--lr", "1")) != key  # another command
