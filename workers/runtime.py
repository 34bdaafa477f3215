"""This node's runtime files (the zygote's socket, pid, lock and log; the CPU probe's answer) in
a folder of this user's own, mode 0700, under the temp folder (``TMPDIR`` honoured).

Why: the shared /tmp is writable by every user of the node. With the files there, another user
could plant a ``.pid`` naming any process of ours (the service SIGKILLed it) or a symlink in
place of a ``.lock`` or ``.err`` (opened through it: the linked file was truncated). A folder
only we can enter holds nothing planted; the files are still opened without following a link
(``O_NOFOLLOW``), in case the folder was made by an older Pipette or by hand.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from pipette.errors import PipetteError


def runtime_dir() -> Path:
    """``$TMPDIR/pipette-<uid>``: created 0700 if absent; refused if it is a link, another
    user's, or open to others (one line saying how to fix it)."""
    path = Path(tempfile.gettempdir()) / f"pipette-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise _unsafe(path, "is not a folder (a link or a file)")
    if info.st_uid != os.getuid():
        raise _unsafe(path, f"belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, made with a looser umask (an older Pipette, by hand): close it
    return path


def _unsafe(path: Path, why: str) -> PipetteError:
    return PipetteError(f"Pipette's runtime folder {path} {why}", field="TMPDIR",
                        fix=f"remove {path} (when nothing of Pipette runs), or set TMPDIR to a folder of yours")


def open_private(path: str | Path, flags: int) -> int:
    """``os.open`` of a runtime file that never follows a symlink (refused in one line) and
    is created readable by this user only."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise PipetteError(f"Pipette's runtime file {path} is a symbolic link; it is not opened through it",
                           field="TMPDIR", fix=f"remove {path} (it is recreated)") from None


def write_private(path: str | Path, text: str) -> None:
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_private(path: str | Path) -> str:
    fd = open_private(path, os.O_RDONLY)
    with os.fdopen(fd) as f:
        return f.read()
