"""The x bit for others given for tenants' scripts stays while any pytest worker still needs it."""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.service.script_access import python_open_to_others
    with python_open_to_others([Path({target!r})], Path({shared!r})):
        print("open", flush=True)
        sys.stdin.readline()
""")


def _holder(target: Path, shared: Path) -> subprocess.Popen[str]:
    code = HOLD.format(root=str(ROOT), target=str(target), shared=str(shared))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "open\n"
    return proc


def _leave(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(30) == 0


def _mode(folder: Path) -> int:
    return stat.S_IMODE(folder.stat().st_mode)


def test_the_folder_stays_open_until_the_last_worker_leaves(tmp_path: Path) -> None:
    closed = tmp_path / "home"
    (closed / "env").mkdir(parents=True)
    target = closed / "env" / "python"
    target.touch()
    closed.chmod(0o700)
    shared = tmp_path / "state.json"
    first = _holder(target, shared)
    second = _holder(target, shared)
    assert _mode(closed) == 0o701
    _leave(first)
    assert _mode(closed) == 0o701, "the first worker to leave closed the folder under the second's scripts"
    _leave(second)
    assert _mode(closed) == 0o700


def test_a_crashed_holder_does_not_keep_the_folder_open(tmp_path: Path) -> None:
    closed = tmp_path / "home"
    closed.mkdir()
    target = closed / "python"
    target.touch()
    closed.chmod(0o700)
    shared = tmp_path / "state.json"
    crashed = _holder(target, shared)
    crashed.kill()
    crashed.wait(30)
    _leave(_holder(target, shared))
    assert _mode(closed) == 0o700
