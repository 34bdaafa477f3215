"""What a script's trial records are keyed to: the script as it is now, not its command line.

The records of ``pipette tune --script`` teach the next run of the same script (its failures
rule candidates out, its step times correct the model). Keyed to the command alone, a fixed
script kept its past failures: after the fix, the same command stopped in 13 s with every
candidate "ruled out by what the trials taught" (issue 43, item 25). So the key is the content:
the Python sources and small config files of the working directory (and the program, and any
file the command names), with the script's settings (knobs, kind, ...). Edit any of them and the
next run starts afresh; a training run's outputs (checkpoints, logs) are not sources and do not
change the key.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipette.script import ScriptSpec

#: files that make up a script: its sources and the configs it reads
SOURCE_SUFFIXES = (".py", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh", ".txt")
#: folders that are no part of a script: tools' state, caches, environments
SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules",
             ".venv", "venv", ".tox", "wandb", "mlruns", "runs", "checkpoints", "outputs", "trainer_output"}
#: a bigger file counts by its size and name only (a dataset or weights, not code)
MAX_FILE_BYTES = 1 << 20
#: the most files read; past it the rest count by name and size
MAX_FILES = 2000


def script_content_key(script: ScriptSpec) -> str:
    """A short hash of ``script``'s settings (without its folder's path: the same files moved
    keep their records) and the content of its files (``content_digest``)."""
    settings = script.to_dict()
    settings.pop("workdir", None)
    text = json.dumps({"script": settings, "content": content_digest(script)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def content_digest(script: ScriptSpec) -> str:
    """The SHA-256 of the working directory's source files (``SOURCE_SUFFIXES``, outside
    ``SKIP_DIRS`` and Python environments), the program, and files the command names, each by
    its path relative to the folder and its bytes."""
    root = Path(script.workdir or ".").resolve()
    named = [(root / word.split("=", 1)[-1]).resolve() for word in script.argv]
    # a folder the command names is where it writes (--output_dir out) or reads data: not sources
    files = set(_sources(root, {p for p in named if p.is_dir() and p != root}))
    files |= {p for p in named if p.is_file()}
    digest = hashlib.sha256()
    for n, path in enumerate(sorted(files)):
        name = os.path.relpath(path, root)
        try:
            size = path.stat().st_size
            body = path.read_bytes() if size <= MAX_FILE_BYTES and n < MAX_FILES else f"size {size}".encode()
        except OSError:
            continue  # unreadable: the script cannot read it either
        digest.update(f"{name}\0{len(body)}\0".encode())
        digest.update(body)
    return digest.hexdigest()


def _sources(root: Path, skip: set[Path]) -> list[Path]:
    out: list[Path] = []
    for folder, dirs, names in os.walk(root):
        # a Python environment in the folder (pyvenv.cfg) holds installed packages, not the script
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")
                         and Path(folder) / d not in skip and not (Path(folder) / d / "pyvenv.cfg").exists())
        out += [Path(folder) / n for n in names if n.endswith(SOURCE_SUFFIXES)]
        if len(out) > 10 * MAX_FILES:
            break  # a huge tree (the home folder as workdir): enough to key on
    return out
