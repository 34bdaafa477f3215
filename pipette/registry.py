"""Which kind of trial runs a job, and what each kind answers: the one place that asks "Pipette's
runner or the user's script?", so the command line, the service and its driver do not.

A job's trials are run by Pipette's runner (one or several of the stacks it runs, each candidate
by its own: ``pipette.stacks``), or by the user's script (``pipette.script``) under the one
stack it is code of. ``job_kind`` picks the kind from the job's stack option and its script;
both kinds answer alike: the stacks, the stack the runner trains with, which earlier trials
teach the job, which launch files the best candidate gets, how they are written and launched.
The worker side asks it too, with the trial's script and stack: why a candidate cannot run
(``candidate_refusals``, ``job_refusals``) and which runner trains it (``runner_of``).
Adding a stack Pipette runs is an entry in ``pipette.stacks`` naming its runner
(``pipette.runners``; its rank program in workers/rank/): docs/stacks.md, "Adding a stack".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError, SpecError
from pipette.model import ModelSpec
from pipette.runners import Runner, builds_the_model
from pipette.script import ScriptSpec, bind_stack, script_ds_config
from pipette.stack_choice import StackChoice, choose_stack
from pipette.stacks import (
    DEFAULT_STACK,
    SCRIPT_KIND_STACKS,
    Stack,
    check_runner_runs,
    get_stack,
    stacks_key,
    stacks_named,
)
from pipette.training import TrainingSpec

if TYPE_CHECKING:
    from pipette.tune_result import TuneResult

#: Pipette's runner's launch files, in the order a user reads them (each stack keeps its own).
RUNNER_FILES = ("ds_config.json", "hostfile", "launch.sh", "rank_map.json", "candidate.json")
#: A DeepSpeed script's: its launchers' files instead of launch.sh (``pipette.emit_script``).
SCRIPT_FILES = ("ds_config.json", "accelerate_config.yaml", "hostfile", "rank_map.json",
                "candidate.json", "launch-deepspeed.sh", "launch-torchrun.sh", "launch-accelerate.sh")


@dataclass(frozen=True)
class RunnerKind:
    """Trials of Pipette's own runner, for each of ``stacks``."""

    stacks: tuple[Stack, ...]
    script: None = None
    #: what the trials run, in a sentence ("N candidates runnable by ...")
    runs = "the backend"
    #: the job, in a sentence ("x is not a file of ...")
    what = "a job of Pipette's runner"
    #: the trials run the user's own code on the cluster (a service allows it per cluster)
    runs_user_code = False
    #: other jobs' trials on the same cluster teach this one (they measured the same runner)
    learns_from_other_jobs = True
    #: the trials need the user's working directory shipped to the nodes
    ships_workdir = False

    @property
    def stack(self) -> Stack:
        return self.stacks[0]

    @property
    def runner_stack(self) -> str:
        """The stack the runner trains candidates with: the first's where the runner runs it (a
        job over several: each candidate names its own), else DeepSpeed's."""
        return self.stack.name if self.stack.runner_runs else DEFAULT_STACK

    def store_suffix(self, script_key: Callable[[ScriptSpec], str]) -> str:
        """What the trial store's name adds to the cluster's key: nothing, the runner's trials are shared."""
        return ""

    def forget_hint(self, store: Path) -> str | None:
        return None

    def ds_config(self, base: dict[str, Any]) -> dict[str, Any]:
        return base

    def launch_files(self, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                     cluster: ClusterProfile, stack: Stack) -> tuple[str, ...]:
        """The best candidate's files: DeepSpeed's, or the native runner's (no ds_config.json)."""
        return tuple(n for n in RUNNER_FILES if n in stack.launch_files)

    def launch_command(self, config: ParallelConfig, cluster: ClusterProfile, stack: Stack,
                       files: tuple[str, ...]) -> str:
        from pipette.emit import stack_launch_command

        return stack_launch_command(config, cluster, stack) or (
            f"with {stack.frameworks}, from candidate.json (Pipette writes no launcher for {stack.key})")

    def write_launch_files(self, out: str | Path, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                           cluster: ClusterProfile, stack: Stack, extra: dict[str, Any]) -> dict[str, Path]:
        from pipette.emit import write_launch_files

        return write_launch_files(out, model, training, config, cluster, extra=extra, stack=stack)

    def write_best(self, out: str | Path, result: TuneResult) -> dict[str, Path]:
        """The tuned best's files, with the tuning's figures (``TuneResult.launch_files``: its stack's)."""
        return result.launch_files(out)


@dataclass(frozen=True)
class ScriptKind:
    """Trials of the user's script, under the one stack it is code of."""

    stacks: tuple[Stack, ...]
    script: ScriptSpec
    runs = "your script"
    what = "a job of its own script"
    runs_user_code = True
    #: a script's trials measure the script: other jobs' (the runner's, other scripts') do not tell about it
    learns_from_other_jobs = False

    @property
    def stack(self) -> Stack:
        return self.stacks[0]

    @property
    def ships_workdir(self) -> bool:
        return self.script.workdir is not None

    @property
    def runner_stack(self) -> str:
        """The script runs itself; what the runner would use is DeepSpeed's (it checks, never trains)."""
        return DEFAULT_STACK

    def store_suffix(self, script_key: Callable[[ScriptSpec], str]) -> str:
        """The script's trials are its own: keyed by its settings and its files' content."""
        return f"-script-{script_key(self.script)}"

    def forget_hint(self, store: Path) -> str | None:
        return (f"  (earlier trials of this script as its files are now: {store}; --no-memory, or remove that "
                "file, to start afresh)")

    def ds_config(self, base: dict[str, Any]) -> dict[str, Any]:
        return script_ds_config(base, self.script)

    def launch_files(self, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                     cluster: ClusterProfile, stack: Stack) -> tuple[str, ...]:
        """A DeepSpeed script's files, or an FSDP script's (which depend on its kind and the candidate)."""
        from pipette.emit_script import fsdp_script_files

        if not self.script.fsdp:
            return SCRIPT_FILES
        return tuple(fsdp_script_files(model, training, config, cluster, self.script))

    def launch_command(self, config: ParallelConfig, cluster: ClusterProfile, stack: Stack,
                       files: tuple[str, ...]) -> str:
        if self.script.fsdp:  # its FSDP settings are in its own files (pipette.script_fsdp)
            return " or ".join(f"./{n}" for n in files if n.startswith("launch-"))
        return "./launch-torchrun.sh (or ./launch-deepspeed.sh, ./launch-accelerate.sh)"

    def write_launch_files(self, out: str | Path, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                           cluster: ClusterProfile, stack: Stack, extra: dict[str, Any]) -> dict[str, Path]:
        from pipette.emit_script import write_script_launch_files

        return write_script_launch_files(out, model, training, config, cluster, self.script,
                                         extra={**extra, "stack": stack.to_dict()})

    def write_best(self, out: str | Path, result: TuneResult) -> dict[str, Path]:
        """The tuned best's files for the script, with how the tuning stopped."""
        p, best = result.plan, result.best
        if best is None:
            raise InfeasibleError(f"no trial succeeded ({result.stop_reason})", field="job",
                                  fix="look at the trials' errors; allow more trials or more memory headroom")
        return self.write_launch_files(out, p.model, p.training, best.config, p.cluster, self.stack,
                                       {"tuning": {"stop_reason": result.stop_reason}})


TrialKind = RunnerKind | ScriptKind


def job_kind(stack: str | None, script: ScriptSpec | None, *, field: str = "stack") -> TrialKind:
    """The kind of trial that runs a job of ``stack`` (the option's text: one stack, or several
    side by side for the runner) and ``script`` (None: Pipette's runner); a stack neither can run
    is refused in one line naming ``field``. A script is bound to its stack (an hf-trainer script
    under fsdp shards with FSDP)."""
    if script is None:
        return RunnerKind(stacks_to_tune(stack, script=False, field=field))
    stacks = stacks_to_tune(stack, script=True, script_kind=script.kind, field=field)
    return ScriptKind(stacks, bind_stack(script, stacks[0]))


def stacks_to_tune(names: str | None, *, script: bool, script_kind: str | None = None,
                   field: str = "stack") -> tuple[Stack, ...]:
    """The stacks a tuning job is for: ``names``, else the script kind's (``Stack.script_kinds``),
    else Pipette's runner's. Pipette's runner runs one or several side by side (``pipette,fsdp``:
    each candidate trained by its own stack's runner), each a stack it runs; a script is one
    stack's code."""
    if not script:
        chosen = stacks_named(names, field=field)
        for one in chosen:
            check_runner_runs(one, field=field)
        return chosen
    chosen = stacks_named(names, default=SCRIPT_KIND_STACKS.get(script_kind or ""), field=field)
    if len(chosen) > 1:
        raise SpecError(f"names {len(chosen)} stacks for one script", field=field,
                        fix="give the one stack your script runs (a script is one stack's code)")
    return chosen


def script_from_record(stored: dict[str, Any] | None, **changes: Any) -> ScriptSpec | None:
    """The script a stored job names (None: the job runs Pipette's runner)."""
    return None if stored is None else ScriptSpec.from_dict({**stored, **changes})


def script_record(script: ScriptSpec | None) -> dict[str, Any] | None:
    """The script as a record keeps it (``script_from_record`` reads it back; None: Pipette's runner)."""
    return None if script is None else script.to_dict()


def job_key_fields(stacks: tuple[Stack, ...]) -> dict[str, str]:
    """What a job's key (``pipette.tuner.job_key``) adds for its stacks: nothing for the default
    stack alone, whose stored trials keep the key they had before stacks existed."""
    key = stacks_key(stacks)
    return {} if key == DEFAULT_STACK else {"stack": key}


def runner_of(stack: str | Stack) -> Runner:
    """The runner that trains a trial of ``stack`` (a stack Pipette runs; ``pipette.runners``)."""
    return check_runner_runs(get_stack(stack, field="trial.stack"), field="trial.stack")


def job_refusals(model: ModelSpec, training: TrainingSpec, device_kind: str | None,
                 script: ScriptSpec | None = None) -> list[str]:
    """Why no candidate of this job can run, whatever its degrees: the part of
    ``candidate_refusals`` a service can check at submit (``device_kind`` None: not measured yet,
    so not checked). Pipette's runners build the model (``pipette.runners.builds_the_model``); a
    script builds its own."""
    out = builds_the_model(model, training) if script is None else []
    if device_kind == "cpu" and training.dtype == "fp16":
        out.append("fp16 training needs a GPU; use bf16 or fp32 on CPU")
    return out


def check_job_runs(model: ModelSpec, training: TrainingSpec, device_kind: str | None, script: ScriptSpec | None,
                   *, script_hint: str, plan_hint: str) -> None:
    """Refuse, before anything is planned, a job no candidate of which the trial backends can run
    (a model the runners do not build; fp16 on CPU devices): accepted, it failed only once planning
    started (issue 32, item 19), with a fix about schedules. ``script_hint`` and ``plan_hint`` say
    how the caller's surface gives a script (``--script``, ``script:``) and plans without trials."""
    reasons = job_refusals(model, training, device_kind, script)
    if not reasons:
        return
    if script is None and (model.arch != "llama" or model.attention is not None):
        raise SpecError(f"{reasons[0]}, so no trial of this job could run", field="model",
                        fix="use a Llama-architecture model (a preset such as tiny-llama or llama3-8b, or a "
                            f"Llama config.json), or tune your own training script ({script_hint}), which builds "
                            f"the model itself; {plan_hint} predicts any model without trials")
    fp16 = training.dtype == "fp16" and device_kind == "cpu"
    raise SpecError(f"{'; '.join(reasons)}: no trial of this job could run on this cluster",
                    field="training.dtype" if fp16 else "training",
                    fix="use bf16 or fp32 on CPU devices, or submit to a GPU cluster" if fp16 else
                    "change the recipe as the message says")


def candidate_refusals(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str,
                       script: ScriptSpec | None, stack: str | Stack, nodes: list[int] | None = None) -> list[str]:
    """Why the code of a trial cannot run ``config``: the user's script (``ScriptSpec.refusals``;
    ``nodes``: the node of each device), else the runner of ``stack`` (``Runner.refusals``).
    Empty when it can. Pure: builds no model and starts no process."""
    if script is not None:
        return script.refusals(training, config, nodes) + job_refusals(model, training, device_kind, script)
    return job_refusals(model, training, device_kind) + runner_of(stack).refusals(model, training, config,
                                                                                 device_kind)


def stack_choice_of(stack: str | None, script: ScriptSpec | None, script_config: str | None = None) -> StackChoice:
    """The stack named, else the one the script names (its kind, or a launch file one framework
    reads among its words or its config), else the default (``pipette.stack_choice``)."""
    if script is None:
        return choose_stack(stack)
    files = [*script.argv, *([script_config] if script_config else [])]
    return choose_stack(stack, script_kind=script.kind, files=files)


def traceable(stack: Stack) -> bool:
    """Whether a candidate of ``stack`` can be traced on fake devices (``workers.rank.fsdp_trace``
    runs the PyTorch-native runner's own code: the fsdp stack's, ``Runner.traceable``)."""
    return stack.runner is not None and stack.runner.traceable
