"""A trial of the user's own training script: how its ranks start, and what they measured.

The ranks run the script's argument list (``pipette.script.ScriptSpec.command``) with the
candidate's DeepSpeed config (``pipette.script.script_ds_config``), in the job's working
directory, with an environment that holds no credentials (``workers.host.script_env``) and
``PIPETTE_TRIAL`` (the steps to run, for ``pipette.report``). A script is timed, in order of
preference, by what it reports through ``pipette.report`` (``step``/``done`` events), else by
its DeepSpeed engine (``ds_step``/``ds_done`` from ``workers/rank/script_hook``); the measurement
says which (``extra["timing_source"]``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipette.contract import RANK_ENV, build_environment
from pipette.errors import SpecError
from pipette.measurement import Measurement, last_error_line
from pipette.script import ScriptSpec, script_ds_config, sharded
from pipette.script_faults import OWN_WORDS, script_fault, unsupported_hint
from pipette.script_fsdp import fsdp_script_args, fsdp_trial_parts
from workers.host.outcome import Outcome
from workers.host.script_env import script_path
from workers.spec import TrialSpec

DS_CONFIG = "ds_config.json"


def script_launch(trial: TrialSpec) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """The files, argument list and environment of every rank of a script trial."""
    script = trial.script
    if script is None:
        raise ValueError("not a script trial")
    steps = trial.warmup_steps + trial.max_steps
    extra_env: dict[str, str] = {}
    if script.fsdp:  # the fsdp stack's candidate, in the script's stack's words (pipette.script_fsdp)
        files, named, extra_env = fsdp_trial_parts(trial.training, trial.config, trial.model, script)
        argv = script.command(trial.training, trial.config, "", steps=steps,
                              fsdp_config_path=f"$PIPETTE_RANK_DIR/{named}" if named else None,
                              device_kind=trial.device_kind)
        argv += fsdp_script_args(trial.training, trial.config, trial.model, script)  # torchtitan's flags
    else:
        files = {DS_CONFIG: json.dumps(script_ds_config(trial.ds_config(), script), indent=2)}
        argv = script.command(trial.training, trial.config, f"$PIPETTE_RANK_DIR/{DS_CONFIG}", steps=steps,
                              device_kind=trial.device_kind)
    # DeepSpeed's JIT-built CPU op: the cache Pipette's own ranks use (built once per machine)
    env = dict(RANK_ENV) | extra_env | {"TORCH_EXTENSIONS_DIR": build_environment()["TORCH_EXTENSIONS_DIR"]} | {
        "PIPETTE_TRIAL": json.dumps({"warmup_steps": trial.warmup_steps, "timed_steps": trial.max_steps,
                                     "global_batch": trial.training.global_batch,
                                     "seq_len": trial.training.seq_len}),
    }
    return files, argv, env


@dataclass
class ScriptEvents:
    """Every event line of a script trial's ranks, as they arrive."""

    world: int
    global_batch: int
    by_rank: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    #: the candidate's ZeRO stage, checked against the engines the script builds (None: unchecked)
    zero_stage: int | None = None
    #: an FSDP script's candidate: FSDP2's ``reshard_after_forward`` it must build (True: ZeRO-3-like
    #: FULL_SHARD, False: SHARD_GRAD_OP), checked against its ``fully_shard`` calls (None: unchecked)
    reshard_after_forward: bool | None = None
    #: whether the candidate recomputes activations, checked against the script's checkpoint
    #: calls (``recompute`` events; None: unchecked)
    recompute: bool | None = None
    #: the candidate's micro-batch, checked against what the script says it ran (None: unchecked)
    micro_batch: int | None = None
    #: the script shards with FSDP (the fsdp stack): its faults are said in FSDP's words, not
    #: DeepSpeed's (issue 43, item 27: an Accelerate FSDP script was told it "ignores the
    #: DeepSpeed config" it never had)
    fsdp: bool = False
    #: the last step index of rank 0 passed on to the caller (a step can come from both sources)
    relayed: int = -1

    def add(self, rank: int, event: dict[str, Any]) -> dict[str, Any] | None:
        """Keep ``event``; returns rank 0's step to relay (once per step index), else None."""
        self.by_rank.setdefault(rank, []).append(event)
        if rank == 0 and event.get("event") in ("step", "ds_step") and int(event["step"]) > self.relayed:
            self.relayed = int(event["step"])
            return event
        return None

    def ignored_config(self) -> str | None:
        """One line when a rank trains another global batch than the candidate's, or (once it
        stepped) with another ZeRO stage or no DeepSpeed engine at all."""
        if self.fsdp:  # no FSDP at all explains the batch too (each rank alone): said first
            return self._ignored_fsdp() or self._ignored_batch() or self._ignored_micro_batch() or \
                self._ignored_recompute()
        return (self._ignored_batch() or self._ignored_micro_batch() or self._ignored_stage()
                or self._ignored_fsdp() or self._ignored_recompute())

    def _stepped(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """(rank, its events) of each rank that reported a step: what it built is known by then."""
        return [(rank, events) for rank, events in sorted(self.by_rank.items())
                if any(e.get("event") in ("step", "ds_step") for e in events)]

    def _ignored_recompute(self) -> str | None:
        """A rank that stepped without the activation checkpointing the candidate asks (no
        checkpoint call before its first step), or with it where the candidate asks none: its
        step time is another configuration's (issue 43, item 30)."""
        want = self.recompute
        if want is None:
            return None
        for rank, events in self._stepped():
            did = any(e.get("event") == "recompute" for e in events)
            if want and not did:
                return (f"the script ignores the candidate's activation checkpointing: rank {rank} stepped without "
                        "recomputing (no torch.utils.checkpoint call) (turn it on when Pipette passes the "
                        "checkpointing knob, e.g. model.gradient_checkpointing_enable(), or clear the knob: "
                        "--script-knob checkpointing=)")
            if did and not want:
                return (f"the script ignores the candidate's recompute none: rank {rank} recomputed activations "
                        "(called torch.utils.checkpoint) (checkpoint only when Pipette passes the checkpointing "
                        "knob)")
        return None

    def _ignored_micro_batch(self) -> str | None:
        """A rank that says it ran another micro-batch than the candidate's (its reports'
        ``micro_batch``, its DeepSpeed engine's): the same global batch split otherwise."""
        if self.micro_batch is None:
            return None
        for rank, events in self._stepped():
            said = [e.get("micro_batch") for e in events if e.get("event") in ("step", "ds_engine")]
            ran = next((int(m) for m in said if m), None)
            if ran is not None and ran != self.micro_batch:
                return (f"the script ignores the candidate's micro-batch: rank {rank} ran micro-batches of {ran}, "
                        f"the candidate's is {self.micro_batch} (give the script's micro_batch knob, or have it "
                        "read train_micro_batch_size_per_gpu from the config)")
        return None

    def _ignored_fsdp(self) -> str | None:
        """An FSDP script that stepped without ``fully_shard`` (Accelerate on CPU drops its FSDP
        plugin unless the script sets the state up, as examples/scripts/common.py's fsdp_on_cpu
        does), or built the other sharding: what most of its ``fully_shard`` calls asked (the
        decoder layers'; Accelerate keeps its last norm and head unsharded after forward whatever
        the plugin says)."""
        want = self.reshard_after_forward
        if want is None:
            return None
        mode = {True: "FULL_SHARD (reshard after forward)", False: "SHARD_GRAD_OP (no reshard after forward)"}
        for rank, events in sorted(self.by_rank.items()):
            if not any(e.get("event") in ("step", "ds_step") for e in events):
                continue  # FSDP wraps the model before the first step: judged once the rank stepped
            calls = [e.get("reshard_after_forward") for e in events if e.get("event") == "fsdp_shard"]
            if not calls:
                return (f"the script trains without FSDP: rank {rank} stepped but never called fully_shard, so the "
                        f"candidate's {mode[want]} was not run (Accelerate on CPU drops its FSDP plugin: set its "
                        "state up as examples/scripts/common.py's fsdp_on_cpu does, or run on GPUs)")
            built = [bool(c) for c in calls if isinstance(c, (bool, int))]
            if built and sum(b == want for b in built) * 2 <= len(built):
                return (f"the script ignores the candidate's FSDP sharding: rank {rank} built "
                        f"{mode[not want]} on {sum(b != want for b in built)} of {len(built)} fully_shard calls, the "
                        f"candidate's is {mode[want]} (take reshard_after_forward from the config Pipette gives)")
        return None

    def _ignored_stage(self) -> str | None:
        if self.zero_stage is None:
            return None
        for rank, events in sorted(self.by_rank.items()):
            if not any(e.get("event") in ("step", "ds_step") for e in events):
                continue  # an engine is built before the first step: judged once the rank stepped
            stages = [e.get("zero_stage") for e in events if e.get("event") == "ds_engine"]
            if not stages:
                return (f"the script trains without a DeepSpeed engine: rank {rank} stepped but built none, so "
                        f"the candidate's DeepSpeed config (ZeRO-{self.zero_stage}) was ignored (Accelerate on "
                        "CPU with use_cpu drops DeepSpeed: keep DeepSpeed on CPU as "
                        "examples/scripts/common.py's deepspeed_on_cpu does, or run on GPUs)")
            if stages[-1] is not None and int(stages[-1]) != self.zero_stage:
                return (f"the script ignores the DeepSpeed config's ZeRO stage: rank {rank} built a "
                        f"ZeRO-{stages[-1]} engine, the candidate's is ZeRO-{self.zero_stage} (pass the config "
                        "file Pipette gives, its zero_optimization included, to deepspeed.initialize or "
                        "the Trainer's --deepspeed)")
        return None

    def _ignored_batch(self) -> str | None:
        for rank, events in sorted(self.by_rank.items()):
            for e in events:
                samples = e.get("samples")
                if e.get("event") in ("step", "ds_step") and samples and int(samples) != self.global_batch:
                    if self.fsdp:
                        return self._fsdp_batch(rank, int(samples))
                    return (f"the script ignores the DeepSpeed config: rank {rank} trained {samples} sequences per "
                            f"step, the candidate's global batch is {self.global_batch} (give its micro_batch and "
                            "grad_accum knobs, or have it read the config's batch sizes)")
        return None

    def _fsdp_batch(self, rank: int, samples: int) -> str:
        """An FSDP script's other batch, by its cause: a rank that trained alone (Accelerate on
        CPU finds no accelerator, ``DistributedType.NO``: no process group, no FSDP) or knobs
        it does not take."""
        head = (f"the script ignores the candidate's global batch: rank {rank} trained {samples} sequences per step, "
                f"the candidate's is {self.global_batch}")
        if samples * self.world == self.global_batch:
            return (f"{head}: each rank trained alone (Accelerate on CPU finds no accelerator, DistributedType.NO, "
                    "and drops the process group and FSDP: set its state up before the Accelerator or the "
                    "TrainingArguments as examples/scripts/common.py's fsdp_on_cpu does, and give an HF Trainer "
                    "--accelerator_config '{\"use_configured_state\": true}'; on GPUs none of this is needed)")
        return f"{head} (give its micro_batch and grad_accum knobs, or have it read them from its flags)"

    def of(self, rank: int, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.by_rank.get(rank, []) if e.get("event") == kind]

    def rank_done(self, rank: int) -> bool:
        """The rank reported its end (through ``pipette.report`` or its DeepSpeed engine)."""
        return bool(self.of(rank, "done") or self.of(rank, "ds_done"))

    def all_done(self) -> bool:
        """Every rank reported its end."""
        return all(self.rank_done(r) for r in range(self.world))

    def steps_seen(self) -> int:
        """The steps rank 0 reported."""
        return max((len(self.of(0, k)) for k in ("step", "ds_step")), default=0)

    def any_step(self) -> bool:
        """Some rank reported a step (its lines may arrive before rank 0's)."""
        return any(self.of(r, k) for r in self.by_rank for k in ("step", "ds_step"))


def script_events(trial: TrialSpec) -> ScriptEvents:
    """The events of ``trial``'s ranks, checked against what its candidate asks: a DeepSpeed
    script's ZeRO stage, an FSDP script's sharding (a replicated FSDP candidate, zero_stage 0, is
    DDP: nothing to check), and every script's recomputation and micro-batch."""
    script, config = trial.script, trial.config
    checks: dict[str, Any] = {"recompute": config.recompute != "none", "micro_batch": config.mbs}
    if script is not None and script.fsdp:
        return ScriptEvents(config.world, trial.training.global_batch, fsdp=True,
                            reshard_after_forward=config.zero_stage == 3 if sharded(config) else None, **checks)
    return ScriptEvents(config.world, trial.training.global_batch, zero_stage=config.zero_stage, **checks)


def steps_across_ranks(per_rank: list[list[float]]) -> tuple[float, ...]:
    """The job's step times from each rank's own (the time between its consecutive
    ``Reporter.step`` calls): per step, the mean over the ranks.

    Not the slowest rank's, as for Pipette's own runner: there every rank starts its step
    together (a collective ends each), so the slowest rank's time is the step's. A script's
    ranks are not lined up between steps: each rank's interval is the same step period shifted
    by its own jitter, the intervals of a rank add up to the run's time, and a per-step maximum
    counts the jitter as time (the per-step maximum read above the HF Trainer's own samples per
    second, the mean over ranks within about 1%: ``tests/benchmarks/script_tuning.py``;
    docs/results.md, "Tuning a user's script")."""
    n = min((len(ts) for ts in per_rank), default=0)
    return tuple(statistics.fmean(ts[i] for ts in per_rank) for i in range(n))


def script_measurement(trial: TrialSpec, outcome: Outcome, events: ScriptEvents, wall: float,
                       exit_tail: str = "") -> Measurement:
    """The measurement of a script trial from its ranks' events. ``exit_tail``: the output of
    the rank whose exit failed the trial, empty where the trial ended otherwise."""
    extra: dict[str, Any] = {"wall_s": wall, "backend": "script", "script": list(trial.script.argv)
                             if trial.script else []}
    world = events.world
    reported = [events.of(r, "done") for r in range(world)]
    hooked = [events.of(r, "ds_done") for r in range(world)]
    steps0 = events.of(0, "step")
    source = "reporter" if steps0 else "deepspeed" if events.of(0, "ds_step") else None
    extra["timing_source"] = source
    if outcome.status != "ok":
        kind = "step" if source == "reporter" else "ds_step"
        timed = tuple(float(e["time"]) for e in events.of(0, kind) if not e.get("warmup"))
        losses = tuple(float(e["loss"]) for e in events.of(0, "step") if e.get("loss") is not None)
        error = outcome.error
        if outcome.status == "failed" and not events.any_step() and exit_tail:
            error = f"the script stopped before its first step: {last_error_line(exit_tail)}\n{error}"
        if outcome.status == "failed":
            error = _mark_fault(extra, error, exit_tail, trial.script, _features(trial))
        return Measurement(outcome.status, step_times=timed, tokens_per_step=trial.tokens_per_step,
                           losses=losses, error=error, extra=extra)
    dones = reported if source == "reporter" else hooked
    if source is None or not all(dones):
        what = "reported no step" if source is None else "did not report the end of every rank"
        error = (f"the script exited without error but {what}: call pipette.report.Reporter.step (and .done) "
                 "in its loop, or HFCallback in its Trainer, or train through a DeepSpeed engine")
        return Measurement("failed", tokens_per_step=trial.tokens_per_step, extra=extra,
                           error=_mark_fault(extra, error, "", trial.script))
    per_rank = [[float(t) for t in d[-1]["step_times"]] for d in dones]
    n = min(len(t) for t in per_rank)
    if n < 1:
        return Measurement("failed", tokens_per_step=trial.tokens_per_step, extra=extra,
                           error=f"the script ended after {events.steps_seen()} step(s), all warm-up "
                                 f"({trial.warmup_steps}): let it run {trial.warmup_steps + trial.min_steps} "
                                 "steps or more (its steps knob)")
    step_times = steps_across_ranks(per_rank)
    losses = tuple(float(e["loss"]) for e in steps0 if e.get("loss") is not None)
    if not losses and reported[0]:  # logged after their steps (the HF Trainer's)
        losses = tuple(float(x) for x in reported[0][-1].get("losses") or ())
    last = [d[-1] for d in dones]
    peaks = [d.get("peak_memory_bytes") for d in last]
    extra |= {"peak_rss_bytes": [int(d.get("peak_rss_bytes") or 0) for d in last],
              "warmup_steps": trial.warmup_steps}
    if source == "deepspeed":
        ds = [float(e["ds_time"]) for e in events.of(0, "ds_step") if not e.get("warmup") and e.get("ds_time")]
        if ds:
            extra["deepspeed_step_time"] = statistics.median(ds)
    log = reported[0][-1].get("log") if reported[0] else None
    if log:
        extra["script_log"] = log
    m = Measurement("ok", step_times=step_times, tokens_per_step=trial.tokens_per_step,
                    peak_memory=tuple(int(p or 0) for p in peaks) if all(p is not None for p in peaks) else (),
                    losses=losses, extra=extra, statistic="mean")
    if not all(math.isfinite(t) and t > 0 for t in step_times):
        return Measurement("failed", tokens_per_step=trial.tokens_per_step, extra=extra,
                           error=f"the script reported step times {list(step_times)}: give positive seconds")
    return m


def _mark_fault(extra: dict[str, Any], error: str, output: str, script: ScriptSpec | None,
                uses: list[str] | None = None) -> str:
    """A failure no layout explains (``pipette.script_faults``): its fix in ``extra["script_fault"]``,
    which stops the search, and on the error's second line; other errors are returned as they are."""
    fault = script_fault(error, output, script, python=sys.executable)
    if fault is None:
        hint = unsupported_hint(error, output, uses) if uses is not None else None
        if hint is not None:  # the candidate's in this script: not retried (pipette.tuner)
            extra["unsupported"] = hint
            first, _, rest = error.partition("\n")
            return "\n".join(x for x in (first, f"fix: {hint}", rest) if x)
        return error
    extra["script_fault"] = fault.fix
    if error.startswith(OWN_WORDS):
        return error  # its one line says what to change already
    first, _, rest = error.partition("\n")
    if fault.what not in first:  # the first line names it (the tuner's stop reason quotes that line)
        first = f"{first}: {fault.what}"
    return "\n".join(x for x in (first, f"fix: {fault.fix}", rest) if x)


def _features(trial: TrialSpec) -> list[str]:
    """What of ``pipette.script.UNSUPPORTED`` the trial's candidate uses."""
    c = trial.config
    uses = {"tp": c.tp > 1, "pp": c.pp > 1, "selective": c.recompute == "selective", "full": c.recompute == "full",
            "hsdp": c.dp_shard is not None, "offload": c.offload}
    return [name for name, used in uses.items() if used]


def check_script(script: ScriptSpec | None) -> None:
    """Refuse, before profiling, a script whose program is not there: ``python X`` needs a
    readable ``X``, any other program an executable (a path, or a name on ``PATH``). Nothing to
    check for Pipette's runner (no script)."""
    if script is None:
        return
    workdir = Path(script.workdir or ".")
    if not workdir.is_dir():
        raise SpecError(f"{str(workdir)!r} is not a folder", field="script.workdir",
                        fix="give the folder the script runs in")
    program = script.program
    path = workdir / program
    if script.is_python and program == "-m":  # python -m package.module: found at run time, on its path
        if shutil.which(script.argv[0], path=script_path(os.environ.get("PATH", ""))) is None:
            raise SpecError(f"{script.argv[0]!r} is not on PATH", field="script.argv",
                            fix="name a Python that is installed, e.g. python")
        if len(script.argv) < 3:
            raise SpecError("is python -m without a module", field="script.argv",
                            fix="give the module, e.g. python -m torchtitan.train")
        return
    if script.is_python:
        if shutil.which(script.argv[0], path=script_path(os.environ.get("PATH", ""))) is None:
            raise SpecError(f"{script.argv[0]!r} is not on PATH", field="script.argv",
                            fix="name a Python that is installed, e.g. python")
        if not path.is_file():
            raise SpecError(f"no such file {str(path)!r}", field="script.argv",
                            fix="give the training script's path, relative to the working directory")
        if not os.access(path, os.R_OK):
            raise SpecError(f"{str(path)!r} is not readable", field="script.argv", fix="chmod +r it")
        return
    if "/" in program:
        if not path.is_file():
            raise SpecError(f"no such file {str(path)!r}", field="script.argv",
                            fix="give the program's path, relative to the working directory")
        if not os.access(path, os.X_OK):
            raise SpecError(f"{str(path)!r} is not executable", field="script.argv",
                            fix=f"chmod +x {program}, or run it as python {program}")
    elif shutil.which(program) is None:
        raise SpecError(f"{program!r} is not on PATH", field="script.argv", fix="give its path")
