"""Which kind of trial runs a job, and what each kind answers: the one place that asks "Pipette's
runner or the user's script?", so the command line, the service and its driver do not.

A job's trials are run by Pipette's runner (one or several of the stacks it runs, each candidate
by its own: ``pipette.stacks``), or by the user's script (``pipette.script``) under the one
stack it is code of. ``job_kind`` picks the kind from the job's stack option and its script;
both kinds answer alike: the stacks, the stack the runner trains with, which earlier trials
teach the job, which launch files the best candidate gets, how they are written and launched.
Adding a stack Pipette runs is an entry in ``pipette.stacks`` (and its runner in workers/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.script import ScriptSpec, bind_stack, script_ds_config
from pipette.stack_choice import StackChoice, choose_stack
from pipette.stacks import DEFAULT_STACK, Stack, stacks_to_tune
from pipette.training import TrainingSpec

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


TrialKind = RunnerKind | ScriptKind


def job_kind(stack: str | None, script: ScriptSpec | None, *, field: str = "stack") -> TrialKind:
    """The kind of trial that runs a job of ``stack`` (the option's text: one stack, or several
    side by side for the runner) and ``script`` (None: Pipette's runner); a stack neither can run
    is refused in one line naming ``field``. A script is bound to its stack (an hf-trainer script
    under fsdp shards with FSDP)."""
    if script is None:
        return RunnerKind(stacks_to_tune(stack, script=False, field=field))
    stacks = stacks_to_tune(stack, script=True, script_kind=script.kind, field=field)
    return ScriptKind(stacks, bind_stack(script, stacks[0].key))


def script_from_record(stored: dict[str, Any] | None, **changes: Any) -> ScriptSpec | None:
    """The script a stored job names (None: the job runs Pipette's runner)."""
    return None if stored is None else ScriptSpec.from_dict({**stored, **changes})


def stack_choice_of(stack: str | None, script: ScriptSpec | None, script_config: str | None = None) -> StackChoice:
    """The stack named, else the one the script names (its kind, or a launch file one framework
    reads among its words or its config), else the default (``pipette.stack_choice``)."""
    if script is None:
        return choose_stack(stack)
    files = [*script.argv, *([script_config] if script_config else [])]
    return choose_stack(stack, script_kind=script.kind, files=files)


def traceable(stack: Stack) -> bool:
    """Whether a candidate of ``stack`` can be traced on fake devices (``workers.rank.fsdp_trace``
    runs the PyTorch-native runner's own code: the fsdp stack's)."""
    return stack.name == "fsdp"
