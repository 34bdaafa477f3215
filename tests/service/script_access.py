"""Let another user run this environment's Python for a test: the service starts tenants'
scripts as ``nobody``, and on CI the interpreter lives under root's home (mode 0700)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def python_open_to_others() -> Iterator[None]:
    """Add search (x, not read) for others to each folder above the interpreter and this
    environment that lacks it, for the test's duration; their modes are put back after."""
    changed: list[tuple[Path, int]] = []
    targets = {Path(os.path.realpath(sys.executable)), Path(sys.prefix).resolve(), Path(__file__).resolve()}
    folders = {p for t in targets for p in t.parents}
    try:
        for folder in sorted(folders):
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
                changed.append((folder, stat.S_IMODE(mode)))
        yield
    finally:
        for folder, mode in reversed(changed):
            folder.chmod(mode)
