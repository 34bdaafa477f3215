"""``Measurement``: what a real trial observed."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "oom", "failed", "timeout", "pruned"]
STATUSES: tuple[str, ...] = ("ok", "oom", "failed", "timeout", "pruned")
Statistic = Literal["median", "mean"]


@dataclass(frozen=True)
class Measurement:
    status: Status
    step_times: tuple[float, ...] = ()
    tokens_per_step: int = 0
    peak_memory: tuple[int, ...] = ()
    losses: tuple[float, ...] = ()
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: how ``step_time`` sums up ``step_times``: the median for Pipette's runner, whose ranks
    #: start every step together (robust to a slow outlier step); the mean for a user's script,
    #: whose steps are the intervals between its ranks' reports: their mean is the run's time
    #: per step, what the script's own throughput says (measured: the median read 1.9-7.1%
    #: under the HF Trainer's train_samples_per_second, the mean within 0.3%;
    #: ``tests/benchmarks/script_tuning.py``, 2026-11-25)
    statistic: Statistic = "median"
    #: the addresses of the nodes the cluster lost during the trial: the failure is the
    #: cluster's, not the candidate's (the tuner retries it once they are back)
    lost_nodes: tuple[str, ...] = ()

    @property
    def step_time(self) -> float | None:
        """The trial's step time: the median or the mean of its timed steps (``statistic``)."""
        if not self.step_times:
            return None
        return statistics.fmean(self.step_times) if self.statistic == "mean" else statistics.median(self.step_times)

    @property
    def tokens_per_s(self) -> float | None:
        t = self.step_time
        return self.tokens_per_step / t if t else None

    @property
    def peak_memory_max(self) -> int | None:
        return max(self.peak_memory) if self.peak_memory else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "step_times": list(self.step_times),
            "step_time": self.step_time,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "peak_memory": list(self.peak_memory),
            "losses": list(self.losses),
            "error": self.error,
            "extra": dict(self.extra),
            "statistic": self.statistic,
            "lost_nodes": list(self.lost_nodes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        """Invert ``to_dict`` (derived keys such as ``step_time`` are recomputed)."""
        if d.get("status") not in STATUSES:
            from pipette.errors import SpecError

            raise SpecError(f"status {d.get('status')!r}", field="trial.measurement.status",
                            fix=f"use one of {', '.join(STATUSES)}")
        extra = dict(d.get("extra", {}))
        lost = d.get("lost_nodes") or extra.pop("lost_nodes", None) or ()  # records before the field
        return cls(
            d["status"], tuple(float(x) for x in d.get("step_times", ())), int(d.get("tokens_per_step", 0)),
            tuple(int(x) for x in d.get("peak_memory", ())), tuple(float(x) for x in d.get("losses", ())),
            str(d.get("error", "")), extra, "mean" if d.get("statistic") == "mean" else "median",
            tuple(str(x) for x in lost),
        )


def last_error_line(text: str) -> str:
    """The line of a process's output or a trial's error that says why it stopped (its
    exception, a ``[rank N]:`` prefix dropped), else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        text = line.split("]:", 1)[-1].strip() if line.startswith("[rank") else line
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt", "Exit")) and " " not in head:
            return text[:300]
    return lines[-1][:300] if lines else "(no output)"
