"""The folders of rank processes (``RankProcess``): one per actor under the temporary directory,
named after the actor's process, and swept when that process is gone.

``RankProcess.kill`` removes its folder, but an actor that is killed (``ray.kill``, a driver that
died, an OOM kill of the worker) runs no code on its way out, and its folder stayed in ``/tmp``
for good, with the candidate's files and a script's unpacked working directory. The name carries
the actor's pid, so the next actor on the node removes the folders of actors that no longer run.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

PREFIX = "pipette-rank-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def new_rank_dir(root: str | None = None) -> str:
    """A new folder for this process's rank, after sweeping the folders of dead ones."""
    base = root or tempfile.gettempdir()
    sweep_orphans(base)
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)


def sweep_orphans(root: str) -> list[str]:
    """Remove the rank folders under ``root`` whose actor process is gone; returns their names.
    Folders of other users that cannot be removed are left (``ignore_errors``)."""
    removed: list[str] = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return removed
    for entry in entries:
        found = _NAME.match(entry.name)
        if found is None or _alive(int(found.group(1))) or not entry.is_dir():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: another user's process, alive
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
