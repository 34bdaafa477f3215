"""tests/machine_lock.py: a solo unit waits for the tests in flight, and none starts beside it.

flock conflicts between open file descriptions, so one process's threads stand for the workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.machine_lock import MachineLock


def _start(action: Callable[[], None]) -> threading.Event:
    done = threading.Event()

    def run() -> None:
        action()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_the_writer_waits_for_a_reader_and_then_holds_off_new_readers(tmp_path: Path) -> None:
    reader, writer, late = (MachineLock("run", tmp_path) for _ in range(3))
    reader.share()
    owned = _start(writer.own)
    assert not owned.wait(0.5), "the solo unit started beside a test in flight"
    # a reader back for its next test must not get in ahead of the waiting writer
    late_in = _start(late.share)
    assert not late_in.wait(0.5)
    reader.release()
    assert owned.wait(5) and writer.exclusive
    assert not late_in.wait(0.5), "a test started beside the solo unit"
    writer.release()
    assert late_in.wait(5)
    late.release()


def test_readers_share_and_the_calls_are_idempotent(tmp_path: Path) -> None:
    a, b = MachineLock("run", tmp_path), MachineLock("run", tmp_path)
    a.share()
    a.share()
    assert _start(b.share).wait(5)
    a.release()
    b.release()
    a.own()
    a.own()  # held already: no deadlock against itself
    assert a.exclusive
    a.release()
    assert _start(b.own).wait(5)
    b.release()


def test_other_runs_do_not_wait(tmp_path: Path) -> None:
    mine, other = MachineLock("run-1", tmp_path), MachineLock("run-2", tmp_path)
    mine.own()
    started = time.monotonic()
    assert _start(other.own).wait(5) and time.monotonic() - started < 5
    mine.release()
    other.release()
