"""The machine to itself: a readers-writer lock between the pytest-xdist workers of one run.

A test unit that judges step times against each other (``tests/conftest.py``: ``SOLO_UNITS``)
holds the lock exclusively from its first test's setup to its last test's teardown; every other
test holds it shared for its own setup, call and teardown. So while the shaped cluster's tuning
job and its exhaustive check run, the other worker starts nothing. Why: in CI (stop 53) the job's
pick measured 7% faster than another candidate and then, in the exhaustive job and its re-timing,
30% slower; run alone here the two stayed close and the job picked the best. The likeliest cause,
not shown by the log, is the other worker's tests loading the 2-core VM.

Two ``flock`` files: ``gate`` is held by the writer while it waits and while it holds, and is
passed through by each reader before it takes ``machine`` shared, so that a reader coming back
for its next test cannot keep the writer waiting forever (Linux ``flock`` does not queue). A
process that dies releases its locks with its file descriptors.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path


class MachineLock:
    """The lock of one test run (``run_id``: xdist's ``testrunuid``, the same in every worker)."""

    def __init__(self, run_id: str, directory: Path | None = None) -> None:
        base = Path(directory or tempfile.gettempdir()) / f"pipette-tests-{run_id}"
        base.mkdir(exist_ok=True)
        self._gate_path, self._machine_path = base / "gate", base / "machine"
        self._gate: int | None = None
        self._machine: int | None = None

    @property
    def exclusive(self) -> bool:
        """Whether this process holds the machine alone (only ``own`` takes the gate and keeps it)."""
        return self._gate is not None

    def _open(self, path: Path) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def share(self) -> None:
        """Wait for no writer, then hold the machine shared (no-op where held already)."""
        if self._machine is not None:
            return
        gate = self._open(self._gate_path)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)  # waits while a writer waits or holds
        finally:
            os.close(gate)
        self._machine = self._open(self._machine_path)
        fcntl.flock(self._machine, fcntl.LOCK_SH)

    def own(self) -> None:
        """Hold the machine alone: wait for the readers' tests in flight to end (no-op where
        held already)."""
        if self.exclusive:
            return
        self.release()
        self._gate = self._open(self._gate_path)
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        self._machine = self._open(self._machine_path)
        fcntl.flock(self._machine, fcntl.LOCK_EX)

    def release(self) -> None:
        """Let go of whatever this process holds."""
        for fd in (self._machine, self._gate):
            if fd is not None:
                os.close(fd)  # closing the descriptor drops its flock
        self._machine = self._gate = None
