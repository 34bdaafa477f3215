"""Let another user run this environment's Python for a test: the service starts tenants'
scripts as ``nobody``, and on CI the interpreter lives under root's home (mode 0700).

The pytest workers share the folders, so the change is counted across processes: the modes go
back only when the last holder leaves. (Each worker restoring its own change let one test close
root's home under another test's running ranks: their trial failed before its first step.)"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE = Path(tempfile.gettempdir()) / f"pipette-python-open-{os.getuid()}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict[str, list[Any]]]:
    """The shared state under an exclusive lock: the holders' pids and the modes to put back."""
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            state = {}
        state.setdefault("holders", [])
        state.setdefault("changed", [])
        yield state
        path.write_text(json.dumps(state))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _open(state: dict[str, list[Any]], targets: list[Path]) -> None:
    changed = state["changed"]
    for folder in sorted({p for t in targets for p in t.parents}):
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
            changed.append([str(folder), stat.S_IMODE(mode)])


@contextlib.contextmanager
def python_open_to_others(targets: list[Path] | None = None, shared: Path = STATE) -> Iterator[None]:
    """Add search (x, not read) for others to each folder above the interpreter and this
    environment that lacks it, for the test's duration; their modes are put back when no test
    of any worker holds them open."""
    me = os.getpid()
    if targets is None:
        targets = [Path(os.path.realpath(sys.executable)), Path(sys.prefix).resolve(), Path(__file__).resolve()]
    with _locked(shared) as state:
        holders: list[int] = [p for p in state["holders"] if _alive(p)]
        _open(state, targets)
        state["holders"] = [*holders, me]
    try:
        yield
    finally:
        with _locked(shared) as state:
            rest = [p for p in state["holders"] if p != me and _alive(p)]
            state["holders"] = rest
            if not rest:
                for folder, mode in reversed(state["changed"]):
                    Path(folder).chmod(mode)
                state["changed"] = []
