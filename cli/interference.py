"""What else ran on this machine during the trials: the CPU time of every process that is not
one of this job's ranks (they carry its ``PIPETTE_RANK_TAG``), read from ``/proc`` at each
trial's start and end (issue 32, item 9: a verdict on a machine with 26% trial-to-trial noise
said nothing of the load that caused it), and the processes on this machine's GPUs that are
not this job's (NVML's list of compute processes). Linux only; elsewhere nothing is reported."""

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


def foreign_gpu_processes(tag: str) -> list[tuple[int, int, int]] | None:
    """(device index, pid, bytes it holds) of each compute process on this machine's GPUs that
    is not one of this job's ranks; None where NVML cannot answer (no GPU or no driver: NVML
    raises ``NVMLError_LibraryNotFound``). A pid this process cannot see (another container's
    pid namespace) is skipped: it cannot be told apart from one of the job's ranks."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # pynvml missing, or NVMLError_LibraryNotFound / DriverNotLoaded
        return None
    try:
        found: list[tuple[int, int, int]] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                pid = int(proc.pid)
                if Path(f"/proc/{pid}").exists() and not is_ours(pid, tag):
                    found.append((index, pid, int(proc.usedGpuMemory or 0)))
        return found
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


class Interference:
    """Other processes' CPU use per trial: ``start`` at a trial's start, ``end`` at its end."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.before: tuple[float, dict[int, float]] | None = None
        self.others_cores: list[float] = []
        self.load_1m: list[float] = []
        #: per trial, the other processes on the GPUs (pid -> bytes), seen at its start or end
        self.gpu_others: list[dict[int, int]] = []
        self._gpu_start: list[tuple[int, int, int]] | None = None

    def start(self) -> None:
        self.before = (time.monotonic(), cpu_seconds_by_pid())
        self._gpu_start = foreign_gpu_processes(self.tag)

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
        seen = [x for x in (self._gpu_start, foreign_gpu_processes(self.tag)) if x is not None]
        if seen:
            held: dict[int, int] = {}
            for _, pid, used in (p for sample in seen for p in sample):
                held[pid] = max(held.get(pid, 0), used)
            self.gpu_others.append(held)
        self.before = None

    def summary(self) -> dict[str, Any]:
        if not self.others_cores:
            return {}
        out: dict[str, Any] = {"cores": os.cpu_count(), "others_cores": [round(x, 2) for x in self.others_cores],
                               "load_1m": [round(x, 2) for x in self.load_1m]}
        if self.gpu_others:
            out["gpu_others"] = [len(held) for held in self.gpu_others]
            out["gpu_others_bytes"] = [sum(held.values()) for held in self.gpu_others]
        return out
