"""Stacks: the software that runs a job, as one named bundle the models predict for.

A ``Stack`` holds what a prediction depends on besides the model, recipe and cluster: the
performance constants (``pipette.perf``), the memory options (``pipette.memory``), the fits
prior of the memory estimator's error (``pipette.fits``), what the stack can run (degrees,
ZeRO/FSDP sharding modes, pipeline schedules, recomputation granularity) and which launch
files the emitter writes for it. A prediction is made for one stack, and trials of one
stack teach only it (``pipette.tuner.job_key`` includes the stack).

Choose one by name everywhere (``--stack``, ``stack:`` in a job file and the API): ``pipette``
(the default), ``hf-deepspeed``, ``megatron``, ``fsdp``; an option is appended with ``+``
(``fsdp+compile``, ``megatron+fp8``) where the stack has it. docs/stacks.md says which data
each stack's numbers come from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.estimates import MemoryEstimate, PerfEstimate
from pipette.fits import CPU, FSDP_GPU, NANOTRON_GPU, PIPETTE_GPU, FitsPrior
from pipette.memory import DEFAULT_OPTIONS, MEGATRON_OPTIONS, MemoryOptions, estimate_memory
from pipette.model import ModelSpec
from pipette.perf import HF_DEEPSPEED_CONSTANTS, MEGATRON_CONSTANTS, PerfConstants, estimate_perf
from pipette.training import TrainingSpec

#: The stack Pipette plans and tunes for when none is named: its own runner.
DEFAULT_STACK = "pipette"
#: The launch files of a DeepSpeed job (``pipette.emit.write_launch_files``).
DEEPSPEED_FILES = ("ds_config.json", "hostfile", "rank_map.json", "candidate.json", "launch.sh")
#: The launch files of a stack Pipette writes no config for: the candidate and where ranks go.
CANDIDATE_FILES = ("candidate.json", "hostfile", "rank_map.json")
#: Options a stack may offer, with what they mean.
OPTIONS: dict[str, str] = {
    "compile": "torch.compile of the model (fused elementwise kernels)",
    "fp8": "FP8 GEMMs (Transformer Engine or torchao Float8) on a device with FP8 tensor cores",
}
#: Said wherever an option is shown: what the models do with it today.
OPTION_NOT_MODELLED = "not modelled yet: predicted as the stack without it"


@dataclass(frozen=True)
class Stack:
    """One stack (see the module docstring); ``options`` are the ones chosen (``+compile``)."""

    name: str
    #: the frameworks it stands for, as a user knows them
    frameworks: str
    description: str
    constants: PerfConstants
    memory_options: MemoryOptions
    #: the estimator's error on a GPU (the CPU prior is the same for every stack: no CPU data)
    gpu_fits_prior: FitsPrior
    tensor_parallel: bool
    pipeline_parallel: bool
    #: ZeRO stages it runs (FSDP: NO_SHARD = 0, SHARD_GRAD_OP = 2, FULL_SHARD = 3; Megatron's
    #: distributed optimizer = 1)
    zero_stages: tuple[int, ...]
    schedules: tuple[str, ...]
    recompute: tuple[str, ...]
    launch_files: tuple[str, ...]
    #: whether Pipette's own trial runner runs it (``tune`` without ``--script``)
    runner_runs: bool = False
    #: options the stack offers (keys of ``OPTIONS``)
    available_options: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The name with its chosen options: ``fsdp+compile``."""
        return "+".join((self.name, *self.options))

    def fits_prior(self, device_kind: str) -> FitsPrior:
        return CPU if device_kind == "cpu" else self.gpu_fits_prior

    def refusals(self, config: ParallelConfig) -> list[str]:
        """The codes of ``STACK_RULES`` that ``config`` breaks on this stack (empty: it runs it)."""
        broken = []
        if config.tp > 1 and not self.tensor_parallel:
            broken.append("stack_tp")
        if config.pp > 1 and not self.pipeline_parallel:
            broken.append("stack_pp")
        if config.zero_stage not in self.zero_stages:
            broken.append("stack_zero")
        if config.pp > 1 and config.schedule not in self.schedules:
            broken.append("stack_schedule")
        if config.recompute not in self.recompute:
            broken.append("stack_recompute")
        return broken

    def estimate_memory(self, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                        capacity_bytes: int, *, device_kind: str = "gpu") -> MemoryEstimate:
        """``pipette.memory.estimate_memory`` with this stack's memory options."""
        return estimate_memory(model, training, config, capacity_bytes, device_kind=device_kind,
                               options=self.memory_options)

    def estimate_perf(self, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                      cluster: ClusterProfile) -> PerfEstimate:
        """``pipette.perf.estimate_perf`` with this stack's constants."""
        return estimate_perf(model, training, config, cluster, constants=self.constants)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.key, "frameworks": self.frameworks, "options": list(self.options),
            "options_note": OPTION_NOT_MODELLED if self.options else None,
            "runs": {"tp": self.tensor_parallel, "pp": self.pipeline_parallel, "zero_stages": list(self.zero_stages),
                     "schedules": list(self.schedules), "recompute": list(self.recompute)},
            "launch_files": list(self.launch_files), "runner_runs": self.runner_runs,
        }


#: Why a candidate is refused by its stack, by code (the plan's drop reasons).
STACK_RULES: dict[str, str] = {
    "stack_tp": "the stack has no tensor parallelism",
    "stack_pp": "the stack has no pipeline parallelism",
    "stack_zero": "the stack has no such ZeRO/FSDP sharding mode",
    "stack_schedule": "the stack has no such pipeline schedule",
    "stack_recompute": "the stack has no such recomputation granularity",
}

PIPETTE = Stack(
    name="pipette", frameworks="Pipette's runner (Hugging Face eager Llama under DeepSpeed)",
    description="what `pipette tune` runs and its launch files start; constants fitted on h100_single_gpu.csv",
    constants=HF_DEEPSPEED_CONSTANTS, memory_options=DEFAULT_OPTIONS, gpu_fits_prior=PIPETTE_GPU,
    tensor_parallel=True, pipeline_parallel=True, zero_stages=(0, 1, 2, 3), schedules=("1f1b",),
    recompute=("none", "selective", "full"), launch_files=DEEPSPEED_FILES, runner_runs=True,
)
#: HF Trainer / Accelerate with DeepSpeed: the same eager HF model and DeepSpeed engine as
#: Pipette's runner, so the same constants and prior (not measured apart: docs/stacks.md).
#: Tensor and pipeline parallelism only where the script builds them (AutoTP, PipelineModule);
#: gradient_checkpointing is full recomputation only.
HF_DEEPSPEED = replace(
    PIPETTE, name="hf-deepspeed", frameworks="Hugging Face Trainer / Accelerate with DeepSpeed",
    description="`--script-kind hf-trainer` scripts; the runner's constants (same model code and engine)",
    recompute=("none", "full"), runner_runs=False, available_options=("compile",),
)
#: Megatron-LM, NeMo, nanotron: fused kernels, vocab-parallel loss, the distributed optimizer
#: (ZeRO-1), fp32 gradient buffers. Constants fitted on vTrain (Megatron-DeepSpeed) and the
#: Ultra-Scale set (nanotron); the prior on the Ultra-Scale set.
MEGATRON = Stack(
    name="megatron", frameworks="Megatron-LM, NeMo, nanotron",
    description="fused kernels, vocab-parallel loss, distributed optimizer; constants fitted on vTrain + Ultra-Scale",
    constants=MEGATRON_CONSTANTS, memory_options=MEGATRON_OPTIONS, gpu_fits_prior=NANOTRON_GPU,
    tensor_parallel=True, pipeline_parallel=True, zero_stages=(0, 1), schedules=("1f1b", "interleaved"),
    recompute=("none", "selective", "full"), launch_files=CANDIDATE_FILES, available_options=("fp8",),
)
#: PyTorch FSDP/FSDP2 (torchtitan, Accelerate FSDP, llm-foundry): ZeRO-3-like FULL_SHARD with
#: fp32 sharded master and fp32 gradient reduction; torchtitan adds TP and PP schedules. Until
#: FSDP's own terms are fitted (prefetch overlap), it is priced with the Megatron constants
#: and its flash attention (SDPA), the memory with fp32 gradients (docs/stacks.md).
FSDP = Stack(
    name="fsdp", frameworks="PyTorch FSDP/FSDP2: torchtitan, Accelerate FSDP, llm-foundry",
    description="FULL_SHARD/SHARD_GRAD_OP/NO_SHARD; Megatron constants with fused attention, fp32 gradients",
    constants=replace(MEGATRON_CONSTANTS, flash_attention=True),
    memory_options=replace(MEGATRON_OPTIONS, grad_accum_fp32=True), gpu_fits_prior=FSDP_GPU,
    tensor_parallel=True, pipeline_parallel=True, zero_stages=(0, 2, 3), schedules=("1f1b", "interleaved"),
    recompute=("none", "selective", "full"), launch_files=CANDIDATE_FILES, available_options=("compile", "fp8"),
    runner_runs=True,
)

STACKS: dict[str, Stack] = {s.name: s for s in (PIPETTE, HF_DEEPSPEED, MEGATRON, FSDP)}


def get_stack(stack: str | Stack | None, *, field: str = "stack") -> Stack:
    """The stack named ``name[+option...]`` (``None``: the default); a ``Stack`` is returned as is.
    An unknown name or option is a ``SpecError`` naming the known ones."""
    if stack is None:
        return STACKS[DEFAULT_STACK]
    if isinstance(stack, Stack):
        return stack
    name, *options = [part.strip() for part in str(stack).strip().lower().split("+")]
    found = STACKS.get(name)
    if found is None:
        raise SpecError(f"unknown stack {stack!r}", field=field, fix=f"use one of {', '.join(STACKS)}")
    for option in options:
        if option not in found.available_options:
            offered = ", ".join(f"{name}+{o}" for o in found.available_options) or "none"
            raise SpecError(f"{name} has no option {option!r}", field=field,
                            fix=f"use {name} alone or one of its options ({offered})")
    return replace(found, options=tuple(sorted(set(options))))


def runner_stacks() -> list[str]:
    """The stacks Pipette's own trial runner runs."""
    return [s.name for s in STACKS.values() if s.runner_runs]


def stack_to_tune(name: str | None, *, script: bool, script_kind: str | None = None, field: str = "stack") -> Stack:
    """The stack a tuning job is for: ``name``, else ``hf-deepspeed`` for an hf-trainer script,
    ``fsdp`` for an accelerate-fsdp or torchtitan script, else Pipette's runner. Without a script
    only a stack the runner runs is accepted."""
    default = None
    if script and script_kind == "hf-trainer":
        default = "hf-deepspeed"
    elif script and script_kind in ("accelerate-fsdp", "torchtitan"):
        default = "fsdp"
    stack = get_stack(name or default, field=field)
    if not script:
        check_runner_runs(stack, field=field)
    return stack


def check_runner_runs(stack: Stack, *, field: str = "stack") -> None:
    """Refuse to tune ``stack`` with Pipette's own runner when the runner does not run it."""
    if stack.runner_runs and stack.options:
        raise SpecError(f"{stack.key}: Pipette's runner runs {stack.name} without {', '.join(stack.options)}",
                        field=field, fix=f"tune --stack {stack.name}, or your own script with --script")
    if not stack.runner_runs:
        raise SpecError(
            f"{stack.key} cannot be tuned by Pipette's runner, which runs {', '.join(runner_stacks())} only",
            field=field, fix=f"tune your own {stack.name} script with --script, or plan it with `pipette plan "
                             f"--stack {stack.key}`",
        )


__all__ = [
    "DEFAULT_STACK", "FSDP", "HF_DEEPSPEED", "MEGATRON", "OPTIONS", "PIPETTE", "STACKS", "STACK_RULES",
    "Stack", "check_runner_runs", "get_stack", "runner_stacks", "stack_to_tune",
]
