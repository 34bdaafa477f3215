"""``Measurement``: what a real trial observed; ``Details``: what its ranks said beyond the step
times, typed."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
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
    #: per step, what the script's own throughput says (the median of a skewed series of steps
    #: read under the HF Trainer's own figure, the mean agreed: docs/results.md, "Tuning a user's
    #: script")
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

    @property
    def details(self) -> Details:
        """The workers' extras, typed (``Details``)."""
        return Details.of(self)

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


@dataclass(frozen=True)
class Allocator:
    """The GPU caching allocator's figures of a trial, one entry per rank (``torch.cuda``'s
    memory stats, ``workers.rank.memory``); empty where none was measured (CPU devices)."""

    peak_allocated_bytes: tuple[int, ...] = ()
    peak_reserved_bytes: tuple[int, ...] = ()
    peak_inactive_split_bytes: tuple[int, ...] = ()
    #: the device memory in use beyond what the allocator reserved (CUDA context, NCCL, ...)
    outside_allocator_bytes: tuple[int, ...] = ()
    alloc_retries: tuple[int, ...] = ()
    allocator_ooms: tuple[int, ...] = ()


@dataclass(frozen=True)
class Details:
    """What a trial's ranks said beyond its step times, typed. The workers write these into
    ``Measurement.extra`` (its keys are their wire format); this is the one place that reads
    them back. Keys it does not name stay in ``Measurement.extra``."""

    #: the trial's wall time, from the placement of its ranks to their exit
    wall_s: float | None = None
    #: what ran the steps ("deepspeed+zero1", "script"); None where no rank got that far
    backend: str | None = None
    #: rank 0's wall time by phase (``workers.phases``: imports, ops, build, warmup, steps)
    phases: Mapping[str, float] = field(default_factory=dict)
    #: the phase the ranks were in when a failed or timed-out trial stopped
    stopped_in: str | None = None
    allocator: Allocator = field(default_factory=Allocator)
    #: each rank's peak resident set (the process, not only its tensors)
    peak_rss_bytes: tuple[int, ...] = ()
    #: the end of what rank 0 printed (a failed trial's reason is often there)
    output_tail: str = ""
    #: why a crashed attempt was not retried ("" where it was, or did not crash)
    not_retried: str = ""
    #: the fix of a failure of the user's script that no layout explains ("" for any other):
    #: the search stops at it (``pipette.script_faults``)
    script_fault: str = ""
    #: the fix when the user's script said it cannot run the candidate (not retried)
    unsupported: str = ""

    @classmethod
    def of(cls, m: Measurement) -> Details:
        x = m.extra
        wall = x.get("wall_s")
        return cls(
            wall_s=None if wall is None else float(wall), backend=_str_or_none(x.get("backend")),
            phases={str(k): float(v) for k, v in (x.get("phases") or {}).items()},
            stopped_in=_str_or_none(x.get("phase")),
            allocator=Allocator(**{name: _ints(x.get(name)) for name in Allocator.__dataclass_fields__}),
            peak_rss_bytes=_ints(x.get("peak_rss_bytes")),
            output_tail=str(x.get("output_tail") or ""), not_retried=str(x.get("not_retried") or ""),
            script_fault=str(x.get("script_fault") or ""), unsupported=str(x.get("unsupported") or ""),
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


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values or () if v is not None)
