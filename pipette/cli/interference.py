"""What else ran on this machine during the trials: the CPU time of every process that is not
one of this job's ranks (they carry its ``PIPETTE_RANK_TAG``), read from ``/proc`` at each
trial's start and end (issue 32, item 9: a verdict on a machine with 26% trial-to-trial noise
said nothing of the load that caused it). Linux only; elsewhere nothing is reported."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds_by_pid() -> dict[int, float]:
    """CPU seconds (user + system) of every process, by pid."""
    out: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            continue  # gone between the listing and the read
    return out


def is_ours(pid: int, tag: str) -> bool:
    if pid == os.getpid():
        return True
    try:
        return f"PIPETTE_RANK_TAG={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False  # not ours to read: another user's


class Interference:
    """Other processes' CPU use per trial: ``start`` at a trial's start, ``end`` at its end."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.before: tuple[float, dict[int, float]] | None = None
        self.others_cores: list[float] = []
        self.load_1m: list[float] = []

    def start(self) -> None:
        self.before = (time.monotonic(), cpu_seconds_by_pid())

    def end(self) -> None:
        if self.before is None:
            return
        start, before = self.before
        elapsed = time.monotonic() - start
        after = cpu_seconds_by_pid()
        used = sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items() if not is_ours(pid, self.tag))
        if elapsed > 0:
            self.others_cores.append(used / elapsed)
        self.load_1m.append(os.getloadavg()[0])
        self.before = None

    def summary(self) -> dict[str, Any]:
        if not self.others_cores:
            return {}
        return {"cores": os.cpu_count(), "others_cores": [round(x, 2) for x in self.others_cores],
                "load_1m": [round(x, 2) for x in self.load_1m]}
