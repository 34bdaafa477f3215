"""``Measurement``: what a real trial observed."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "oom", "failed", "timeout", "pruned"]
STATUSES: tuple[str, ...] = ("ok", "oom", "failed", "timeout", "pruned")


@dataclass(frozen=True)
class Measurement:
    status: Status
    step_times: tuple[float, ...] = ()
    tokens_per_step: int = 0
    peak_memory: tuple[int, ...] = ()
    losses: tuple[float, ...] = ()
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time(self) -> float | None:
        """Median step time (robust to a slow outlier step)."""
        return statistics.median(self.step_times) if self.step_times else None

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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        """Invert ``to_dict`` (derived keys such as ``step_time`` are recomputed)."""
        if d.get("status") not in STATUSES:
            from pipette.errors import SpecError

            raise SpecError(f"status {d.get('status')!r}", field="trial.measurement.status",
                            fix=f"use one of {', '.join(STATUSES)}")
        return cls(
            d["status"], tuple(float(x) for x in d.get("step_times", ())), int(d.get("tokens_per_step", 0)),
            tuple(int(x) for x in d.get("peak_memory", ())), tuple(float(x) for x in d.get("losses", ())),
            str(d.get("error", "")), dict(d.get("extra", {})),
        )
