"""``workers.host.rank_output.RankOutput``: a rank's exit is reported only once what it wrote
before it has been read, so a script's last line (its ``done`` event) is never lost to a
reader that is behind; a pipe held open by a child the rank left behind delays it a bounded
time only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator

import pytest

from pipette.contract import EVENT_PREFIX
from workers.host import rank_output
from workers.host.rank_output import RankOutput


def _slowly(lines: Iterable[str], seconds: float) -> Iterator[str]:
    """A reader that is behind: each line reaches it ``seconds`` late."""
    for line in lines:
        time.sleep(seconds)
        yield line


def _until_exit(out: RankOutput, code: int | None, limit_s: float = 20.0) -> tuple[list[str], int | None, float]:
    events: list[str] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        got, seen = out.take(code)
        events += got
        if seen is not None:
            return events, seen, time.monotonic() - t0
        time.sleep(0.02)
    return events, None, time.monotonic() - t0


def test_the_exit_waits_for_the_last_lines_before_it() -> None:
    script = f"print('warming up'); print({EVENT_PREFIX!r} + '{{\"event\": \"done\"}}')"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    out = RankOutput()
    out.follow(_slowly(proc.stdout or (), 0.3))
    code = proc.wait()
    first, held = out.take(code)
    assert held is None and first == []  # exited, but its lines are not read yet: not reported
    events, seen, _ = _until_exit(out, code)
    assert seen == 0
    assert [e.strip() for e in events] == ['{"event": "done"}']
    assert out.text() == "warming up"


def test_a_pipe_held_open_by_a_leftover_child_delays_the_exit_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_output, "DRAIN_S", 0.5)
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & echo started"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out = RankOutput()
        out.follow(proc.stdout or ())
        code = proc.wait()
        events, seen, waited = _until_exit(out, code)
        assert seen == 0 and events == []
        assert 0.4 < waited < 5.0
        assert out.text() == "started"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
