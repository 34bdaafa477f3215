"""``TrialSpec``: one trial to run (the candidate, its job, and how long to measure)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pipette.config import ParallelConfig
from pipette.emit import deepspeed_config
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.registry import script_from_record, script_record
from pipette.script import ScriptSpec
from pipette.stacks import runner_stacks
from pipette.training import TrainingSpec


@dataclass(frozen=True)
class TrialSpec:
    model: ModelSpec
    training: TrainingSpec
    config: ParallelConfig
    warmup_steps: int = 2
    min_steps: int = 3
    max_steps: int = 10
    #: stop once the 95% confidence half-width of the mean step time is below this fraction
    rel_ci: float = 0.05
    #: per-rank memory cap in bytes (the device's memory on a CPU run); None: no cap
    memory_cap_bytes: int | None = None
    device_kind: str = "cpu"
    #: peak FLOP/s per device for MFU (the cluster's DeviceSpec); None: MFU not reported
    peak_flops: float | None = None
    #: learning rate of the emitted DeepSpeed config (``pipette.emit.deepspeed_config``)
    lr: float = 1e-4
    seed: int = 0
    data: str | None = None
    checkpoint: str | None = None
    #: the user's own training script, run instead of Pipette's runner (``workers.host.script_trial``)
    script: ScriptSpec | None = None
    #: the stack Pipette's runner trains the candidate with (its ``Stack.runner``): ``pipette``
    #: (DeepSpeed, ``workers.rank.train``) or ``fsdp`` (PyTorch-native, ``workers.rank.fsdp``)
    stack: str = "pipette"

    def __post_init__(self) -> None:
        for name in ("min_steps", "max_steps"):
            if getattr(self, name) < 1:
                raise SpecError("must be at least 1", field=f"trial.{name}", fix="give a positive step count")
        if self.warmup_steps < 1:
            raise SpecError("must be at least 1", field="trial.warmup_steps", fix="warm up for one step or more")
        if self.max_steps < self.min_steps:
            raise SpecError("is below min_steps", field="trial.max_steps", fix="raise max_steps")
        if self.device_kind not in ("cpu", "gpu"):
            raise SpecError(f"is {self.device_kind!r}", field="trial.device_kind", fix="use cpu or gpu")
        runners = runner_stacks()  # those with a runner (``Stack.runner``); a script trial's stack is the script's
        if self.stack not in runners:
            raise SpecError(f"is {self.stack!r}", field="trial.stack", fix=f"use one of {', '.join(runners)}")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise SpecError("must be positive", field="trial.memory_cap_bytes", fix="give bytes, or no cap")

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch * self.training.seq_len

    def runner_options(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("model", "training", "config")}
        out["script"] = script_record(self.script)
        return out

    def candidate(self) -> dict[str, Any]:
        """The ``candidate.json`` content (what ``pipette.emit`` writes), plus the runner options."""
        return {
            "model": self.model.to_dict(), "training": self.training.to_dict(), "config": self.config.to_dict(),
            "trial": self.runner_options(),
        }

    @classmethod
    def from_candidate(cls, data: dict[str, Any]) -> TrialSpec:
        for key in ("model", "training", "config"):
            if key not in data:
                raise SpecError("is missing", field=f"candidate.{key}", fix="write candidate.json with pipette plan")
        options = dict(data.get("trial") or {})
        known = {f.name for f in fields(cls)}
        bad = sorted(set(options) - known)
        if bad:
            raise SpecError(f"unknown key(s) {', '.join(bad)}", field="candidate.trial", fix="drop them")
        options["script"] = script_from_record(options.get("script"))
        return cls(
            model=ModelSpec.from_dict(data["model"]),
            training=TrainingSpec.from_dict(data["training"]),
            config=ParallelConfig.from_dict(data["config"]),
            **options,
        )


    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config Pipette emits for this candidate: the one the trial runs."""
        return deepspeed_config(self.training, self.config, lr=self.lr, model=self.model)
