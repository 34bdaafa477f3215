"""Trial records and the stores that keep them.

A ``TrialRecord`` is one ended attempt of one trial: the candidate, what the models predicted,
what the trial measured, which job and stack it belongs to, and when it ran. The tuner makes
them; a ``TrialStore`` keeps them. Two stores implement the protocol: the CLI's JSON-lines file
(``JsonlTrialStore``, here: ``pipette tune`` learns from it) and the service's database
(``service.repositories.trials.SqlTrialStore``: a job resumes from it). Both hold the JSON of
``TrialRecord.to_dict``; nothing else reads a stored record by its keys (the workers' extras of
its measurement are read typed by ``Measurement.details``).

``TrialRecord.from_dict`` reads every format written since the first (2026-11-21): a key added
since (``purpose``, ``stack``, ``hfu``, ``statistic``, the timestamps) takes the value that an
older record meant; the derived keys (``label``, ``error_pct``, ...) are recomputed, never
read; a key it does not know is kept in ``extra`` and written back, so a newer file survives
an older reader. ``tests/unit/fixtures/trials/`` holds lines of the old formats.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipette.config import ParallelConfig
from pipette.errors import PipetteError, SpecError, StoreError
from pipette.estimates import MemoryEstimate, PerfEstimate
from pipette.measurement import Details, Measurement
from pipette.stacks import DEFAULT_STACK

if TYPE_CHECKING:
    from pipette.learned import Observation

#: the keys ``to_dict`` writes from fields; with ``DERIVED``, every key it writes
FIELDS = ("number", "attempt", "job_key", "stack", "purpose", "config", "measurement", "perf", "memory",
          "predicted_step_time", "predicted_sd", "started_at", "ended_at")
#: written for readers of the JSON (the API, the dashboard), recomputed when read
DERIVED = ("label", "analytic_step_time", "predicted_peak_bytes", "error_pct")


def tensor_peak_bytes(memory: MemoryEstimate) -> int:
    """The estimate's tensors alone (``MemoryEstimate.live_bytes``): what a trial's measured peak
    counts (the allocator's peak on a GPU). The process overhead (CUDA context and fragmentation,
    or the 512 MiB of a CPU rank's interpreter) is no tensor: compared with it, estimate and trial
    were 24x apart."""
    return memory.live_bytes


@dataclass(frozen=True)
class TrialRecord:
    """One attempt of one trial: the candidate, what was predicted, what was measured."""

    number: int
    config: ParallelConfig
    measurement: Measurement
    perf: PerfEstimate
    memory: MemoryEstimate
    #: the learned model's step time when the trial was proposed, and its log-space sd
    predicted_step_time: float
    predicted_sd: float = 0.0
    attempt: int = 1
    job_key: str = ""
    #: "search" (proposed by the sampler) or "retime" (a contender re-run before the verdict)
    purpose: str = "search"
    #: the stack the trial ran (``pipette.stacks``): records written before stacks were the runner's
    stack: str = DEFAULT_STACK
    #: when the attempt started and ended (UTC); None in records written before they were kept
    started_at: datetime | None = None
    ended_at: datetime | None = None
    #: keys of the stored JSON this version does not know, kept as they were and written back
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def status(self) -> str:
        return self.measurement.status

    @property
    def analytic_step_time(self) -> float:
        return self.perf.step_time

    @property
    def predicted_peak_bytes(self) -> int:
        """The tensors, as the trial's measured peak counts them (the process overhead apart)."""
        return self.memory.live_bytes

    @property
    def error_pct(self) -> float | None:
        """(measured - predicted) / predicted in percent, positive when the trial ran slower than
        predicted (one convention with the API's ``prediction_error``); None unless it ran ok."""
        m = self.measurement
        if m.step_time is None or m.status != "ok":
            return None
        return 100.0 * (m.step_time - self.predicted_step_time) / self.predicted_step_time

    @property
    def details(self) -> Details:
        return self.measurement.details

    def observation(self) -> Observation:
        from pipette.learned import Observation

        return Observation(self.config, self.perf, self.memory, self.measurement, self.job_key)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.extra,
            "number": self.number, "attempt": self.attempt, "label": self.label, "job_key": self.job_key,
            "stack": self.stack, "purpose": self.purpose, "config": self.config.to_dict(),
            "measurement": self.measurement.to_dict(), "perf": self.perf.to_dict(), "memory": self.memory.to_dict(),
            "analytic_step_time": self.analytic_step_time,
            "predicted_step_time": self.predicted_step_time, "predicted_sd": self.predicted_sd,
            "predicted_peak_bytes": self.predicted_peak_bytes, "error_pct": self.error_pct,
            "started_at": _iso(self.started_at), "ended_at": _iso(self.ended_at),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrialRecord:
        """Invert ``to_dict``, for every format written since the first (module docstring)."""
        fix = "pass what TrialRecord.to_dict wrote"
        if not isinstance(d, Mapping):
            raise SpecError(f"is a JSON {type(d).__name__}, not an object", field="trial", fix=fix)
        try:
            p, mem = d["perf"], d["memory"]
            return cls(
                number=int(d["number"]), attempt=int(d.get("attempt", 1)), job_key=str(d.get("job_key", "")),
                config=ParallelConfig.from_dict(d["config"]),
                measurement=Measurement.from_dict(d["measurement"]),
                perf=PerfEstimate(float(p["step_time"]), {k: float(v) for k, v in p["breakdown"].items()},
                                  float(p["tokens_per_s"]), float(p["mfu"]), float(p.get("hfu", 0.0))),
                memory=MemoryEstimate(int(mem["peak_bytes"]), int(mem["capacity_bytes"]),
                                      {k: int(v) for k, v in mem["breakdown"].items()}, int(mem.get("stage", 0)),
                                      tuple(str(n) for n in mem.get("notes", ())), int(mem.get("host_bytes", 0)),
                                      int(mem.get("outside_bytes", 0)), str(mem.get("capacity_figure", "reserved"))),
                predicted_step_time=float(d["predicted_step_time"]), predicted_sd=float(d.get("predicted_sd", 0.0)),
                purpose=str(d.get("purpose", "search")), stack=str(d.get("stack", DEFAULT_STACK)),
                started_at=_time(d.get("started_at")), ended_at=_time(d.get("ended_at")),
                extra={k: v for k, v in d.items() if k not in FIELDS and k not in DERIVED},
            )
        except KeyError as e:
            raise SpecError(f"has no {e} key", field="trial", fix=fix) from None
        except (TypeError, ValueError, AttributeError) as e:
            raise SpecError(f"has a value of the wrong kind ({type(e).__name__}: {e})", field="trial",
                            fix=fix) from None


class TrialStore(Protocol):
    """Where a job's trial records are kept: the CLI's JSON-lines file, the service's database."""

    def append(self, record: TrialRecord) -> None:
        """Keep one ended attempt."""

    def records(self, job_key: str | None = None) -> list[TrialRecord]:
        """Every attempt kept, oldest first (of one job key, when given)."""

    def find(self, label: str, job_key: str | None = None) -> list[TrialRecord]:
        """The attempts of one candidate (``ParallelConfig.label``), oldest first."""

    def count(self) -> int:
        """How many attempts are kept."""


class JsonlTrialStore:
    """The CLI's store: one ``TrialRecord.to_dict`` JSON per line, appended as trials end.

    A line that is not a record (a crash cut it short, a hand edit) stops the reading with an
    error that names the file, the line and the fix: it is never skipped, which would make the
    next job learn from less than the user believes it has."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, record: TrialRecord) -> None:
        line = json.dumps(record.to_dict()) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as f:
                if f.tell() > 0 and not _ends_with_newline(self.path):
                    line = "\n" + line  # a cut last line must not swallow this record
                f.write(line.encode())
        except OSError as e:
            raise StoreError(f"cannot append to it ({e.strerror})", field=str(self.path),
                             fix="make the folder writable, or give another --home") from None

    def records(self, job_key: str | None = None) -> list[TrialRecord]:
        out = self._read()
        return out if job_key is None else [r for r in out if r.job_key == job_key]

    def find(self, label: str, job_key: str | None = None) -> list[TrialRecord]:
        return [r for r in self.records(job_key) if r.label == label]

    def count(self) -> int:
        return len(self._read())

    def _read(self) -> list[TrialRecord]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"cannot read it ({e.strerror})", field=str(self.path),
                             fix="make it readable, or move it away to start afresh") from None
        out = []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            if raw.strip():
                out.append(self._parse(raw, number))
        return out

    def _parse(self, raw: bytes, line: int) -> TrialRecord:
        try:
            return TrialRecord.from_dict(json.loads(raw.decode()))
        except UnicodeDecodeError:
            why = "not UTF-8"
        except json.JSONDecodeError as e:
            why = f"not JSON: {e.msg}, column {e.colno}"
        except PipetteError as e:
            why = e.message if e.field == "trial" else f"{e.field}: {e.message}"
        raise StoreError(
            f"line {line} is not a trial record ({why})", field=str(self.path),
            fix=f"delete or repair line {line} (a crash while writing can cut the last line short), or move "
                f"{self.path.name} away to start this cluster's trial memory afresh; --no-memory tunes without it")


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.isoformat()


def _time(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(str(value))
