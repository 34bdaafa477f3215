"""Stacks: the software that runs a job, as one named bundle the models predict for.

A ``Stack`` holds what a prediction depends on besides the model, recipe and cluster: the
performance constants (``pipette.perf_constants``), the memory options (``pipette.memory_options``),
the fits prior of the memory estimator's error (``pipette.fits``), what the stack can run (degrees,
ZeRO/FSDP sharding modes, pipeline schedules, recomputation granularity) and which launch
files the emitter writes for it. A prediction is made for one stack, and trials of one
stack teach only it (``pipette.tuner.job_key`` includes the stack).

A stack is data: the estimators take one (``pipette.perf.estimate_perf(..., stack=)``,
``pipette.memory.estimate_memory(..., stack=)``, ``pipette.plan.make_plan(..., stack=)``, a name or a
``Stack``), so this module sits between the constants it bundles and the estimators that use them.

Choose one by name everywhere (``--stack``, ``stack:`` in a job file and the API): ``pipette``
(the default), ``hf-deepspeed``, ``megatron``, ``nanotron``, ``fsdp``; an option is appended with ``+``
(``fsdp+compile``, ``megatron+fp8``) where the stack has it. docs/stacks.md says which data
each stack's numbers come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.efficiency import family
from pipette.errors import SpecError
from pipette.fits import CPU, FSDP_GPU, MEGATRON_GPU, NANOTRON_GPU, PIPETTE_GPU, FitsPrior
from pipette.fsdp_rules import fsdp_problems
from pipette.layout import (
    FSDP_LAYOUT,
    HF_DEEPSPEED_LAYOUT,
    MEGATRON_LAYOUT,
    NANOTRON_LAYOUT,
    PIPETTE_LAYOUT,
    Layout,
    StackLayout,
    layout_of,
)
from pipette.memory_options import (
    DEFAULT_OPTIONS,
    FP8_INPUT_BYTES,
    FSDP_COMPILE_FRAGMENTATION,
    FSDP_OPTIONS,
    MEGATRON_OPTIONS,
    MXFP8_INPUT_BYTES,
    NANOTRON_OPTIONS,
    NVFP4_INPUT_BYTES,
    MemoryOptions,
)
from pipette.model import ModelSpec
from pipette.perf_constants import HF_DEEPSPEED_CONSTANTS, MEGATRON_CONSTANTS, MemoryPressure, PerfConstants
from pipette.runners import DEEPSPEED_RUNNER, NATIVE_RUNNER, Runner, deepspeed_moe_refusals
from pipette.training import TrainingSpec

#: The stack Pipette plans and tunes for when none is named: its own runner.
DEFAULT_STACK = "pipette"
#: The launch files of a DeepSpeed job (``pipette.emit.write_launch_files``).
DEEPSPEED_FILES = ("ds_config.json", "hostfile", "rank_map.json", "candidate.json", "launch.sh")
#: The launch files of a stack Pipette writes no config for: the candidate and where ranks go.
CANDIDATE_FILES = ("candidate.json", "hostfile", "rank_map.json")
#: The launch files of Pipette's PyTorch-native runner (the ``fsdp`` stack): ``launch.sh`` runs it
#: with ``torchrun``; no DeepSpeed config.
NATIVE_FILES = (*CANDIDATE_FILES, "launch.sh")
#: Options a stack may offer, with what they mean.
OPTIONS: dict[str, str] = {
    "compile": "torch.compile of the model (fused elementwise kernels)",
    "fp8": "FP8 GEMMs (Transformer Engine or torchao Float8) on a device with FP8 tensor cores",
    "fp8-rowwise": "FP8 GEMMs with one scale per row (torchao Float8's rowwise recipe: torchtitan "
                   "float8.recipe_name = \"rowwise\") instead of one per tensor",
    "async-tp": "asynchronous tensor parallelism (torchtitan's async TP: the sequence-parallel all-gathers and "
                "reduce-scatters micro-pipelined with the matmuls over symmetric memory)",
    "mxfp8": "FP8 GEMMs with one scale per block of 32 (Transformer Engine's MXFP8BlockScaling recipe on "
             "Blackwell; Megatron-Bridge's FP8-MX / MXFP8)",
    "nvfp4": "FP4 GEMMs with block scales (Transformer Engine's NVFP4BlockScaling recipe on Blackwell; "
             "Megatron-Bridge's NVFP4)",
    "te": "Transformer Engine in the training dtype (Megatron-Core as Megatron-Bridge and NeMo run it in BF16: fused "
          "attention, the tensor-parallel communication overlapped with the GEMMs, sequence parallelism); the FP8 "
          "recipes run it too",
    "alloc-pressure": "price a stall per micro-batch as the estimated peak nears capacity (the caching allocator's "
                      "flush and retry; pipette.perf.MemoryPressure, fitted on the Ultra-Scale set; off by default: "
                      "docs/stacks.md)",
}
#: Said wherever an option the models do not price is shown.
OPTION_NOT_MODELLED = "not modelled yet: predicted as the stack without it"
#: Options the performance model prices (``PerfConstants.fp8_gemms``); the others are shown and
#: kept with the trials only.
MODELLED_OPTIONS = ("fp8", "fp8-rowwise", "mxfp8", "nvfp4", "async-tp", "te", "alloc-pressure")
#: The low-precision recipes of the linear layers: one at most per stack key
LOW_PRECISION_RECIPES = ("fp8", "fp8-rowwise", "mxfp8", "nvfp4")


@dataclass(frozen=True)
class CompileTerms:
    """What a stack's ``compile`` option changes in its constants and memory options (torchtitan's
    torch.compile of each transformer block and of the loss; docs/stacks.md)."""

    #: share of ``PerfConstants.elementwise_passes`` and ``layer_overhead_s`` left: Inductor fuses a
    #: layer's norms, rotary, gating and residual adds into a few kernels
    elementwise_share: float
    #: the loss compiled too (``MemoryOptions.fused_loss``)
    fused_loss: bool
    #: ``MemoryOptions.fragmentation`` of compiled runs
    fragmentation: float
    #: under ``fp8`` too: the casts fused into the kernels before the GEMMs (torchao's Float8 relies on
    #: compile for it: torchtitan docs/float8.md) and this FP8 GEMM efficiency (None: the stack's)
    fp8_efficiency: float | None = None

    def apply(self, constants: PerfConstants, memory: MemoryOptions) -> tuple[PerfConstants, MemoryOptions]:
        constants = replace(constants, elementwise_passes=constants.elementwise_passes * self.elementwise_share,
                            layer_overhead_s=constants.layer_overhead_s * self.elementwise_share,
                            ring_pass_share=constants.ring_pass_share * self.elementwise_share)
        if constants.fp8_gemms:
            constants = replace(constants, fp8_casts_fused=True,
                                fp8_efficiency=self.fp8_efficiency or constants.fp8_efficiency)
        memory = replace(memory, fused_loss=memory.fused_loss or self.fused_loss, fragmentation=self.fragmentation)
        return constants, memory


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
    #: its rank layout: mesh order and the degrees it runs (cp, ep) with their rules (``pipette.layout``)
    layout: StackLayout
    #: Pipette's own runner of it (``tune`` without ``--script``: ``pipette.runners``); None: Pipette
    #: plans it and tunes a user's script of it, never runs it itself
    runner: Runner | None = None
    #: the script kinds (``pipette.script.KINDS``) whose scripts are its code: a script of one is
    #: tuned with it when no stack is named (``SCRIPT_KIND_STACKS``)
    script_kinds: tuple[str, ...] = ()
    #: a script tuned with it shards with PyTorch FSDP (``ScriptSpec.fsdp``, ``pipette.script.bind_stack``):
    #: an ``hf-trainer`` script gets ``--fsdp``, a DeepSpeed script is refused; and an FSDP script
    #: is refused under a stack without it
    fsdp_scripts: bool = False
    #: files only its framework reads: an input that names one is priced by it (``pipette.stack_choice``)
    framework_files: tuple[str, ...] = ()
    #: options the stack offers (keys of ``OPTIONS``)
    available_options: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    #: HSDP (``ParallelConfig.dp_shard``: shard within a node, replicate across) and CPU offload
    #: of parameters, gradients and optimizer states (``ParallelConfig.offload``): FSDP2's
    hsdp: bool = False
    offload: bool = False
    #: the PyTorch-native runner's splitting rules apply (``pipette.fsdp_rules``: tp dividing the
    #: FFN and vocabulary, no tied embeddings under tp or pp, enough micro-batches for 1F1B)
    native_rules: bool = False
    #: ZeRO-2/3 (FSDP's sharding) under a pipeline: FSDP2 with ``torch.distributed.pipelining``
    #: runs it, DeepSpeed's pipeline engine refuses it (``pipette.space``'s ``zero_pipeline``)
    sharded_pipeline: bool = False
    #: the device families (``pipette.efficiency.family``) the stack's step-time constants were fitted
    #: or checked on, each with the runs; on another family a plan says so (``calibration_note``)
    calibrated_on: tuple[tuple[str, str], ...] = ()
    #: an interleaved schedule's layers split over the virtual stages as evenly as they go, not only
    #: where pp x virtual stages divides them: torchtitan (``generate_llm_fqn_per_model_part``; its
    #: Llama 3.1 405B runs 126 layers interleaved over pp 8) and Pipette's fsdp runner
    #: (``workers.rank.fsdp_model.stage_layers``). Megatron-LM asserts an even split.
    uneven_virtual_stages: bool = False
    #: the constants and memory options under the ``fp8`` option, where the stack's FP8 is more
    #: than FP8 GEMMs (None: the stack's own with ``fp8_gemms``)
    fp8_constants: PerfConstants | None = None
    #: said under a plan priced by the stack without options (``pipette.stack_choice.pricing_lines``): what its
    #: bare constants are and which option prices the software users more likely run
    bare_note: str | None = None
    #: the constants under the ``te`` option without a low-precision recipe: the ``fp8`` option's
    #: engine with its GEMMs in the training dtype (None: the stack does not offer it)
    te_constants: PerfConstants | None = None
    fp8_memory_options: MemoryOptions | None = None
    #: per recipe option (``mxfp8``, ``nvfp4``): the memory options under it (None: ``fp8_memory_options``)
    recipe_memory_options: tuple[tuple[str, MemoryOptions], ...] = ()
    #: the constants on CPU workers where the stack's own CPU trials gave them (None: ``constants``
    #: on every device; ``constants_for``)
    cpu_constants: PerfConstants | None = None
    #: what the ``compile`` option changes (None: compile not priced, predicted as the stack without it)
    compiled: CompileTerms | None = None
    #: ``PerfConstants.tp_overlap`` under the ``async-tp`` option
    async_tp_overlap: float = 0.0
    #: ``PerfConstants.fp8_efficiency`` under the ``fp8-rowwise`` option (the ``fp8`` option's terms
    #: otherwise)
    fp8_rowwise_efficiency: float | None = None
    #: per recipe option (``mxfp8``, ``nvfp4``): the ``fp8`` option's constants with this
    #: ``PerfConstants.fp8_efficiency`` (and the ``fp4`` peak under ``nvfp4``)
    recipe_efficiencies: tuple[tuple[str, float], ...] = ()
    #: the device peak ``nvfp4``'s efficiency is relative to: ``fp4`` (the data sheet's FP4 peak) or
    #: ``fp8`` (the FP8 tensor rate, the recipe's speedup over it fitted)
    nvfp4_peak: str = "fp4"
    #: ``PerfConstants.memory_pressure`` under the ``alloc-pressure`` option, priced on the memory
    #: estimate of the chosen options (None: the stack does not offer it)
    memory_pressure: MemoryPressure | None = None

    @property
    def key(self) -> str:
        """The name with its chosen options: ``fsdp+compile``."""
        return "+".join((self.name, *self.options))

    @property
    def runner_runs(self) -> bool:
        """Whether Pipette's own trial runner runs it (``tune`` without ``--script``)."""
        return self.runner is not None

    @property
    def unmodelled_options(self) -> tuple[str, ...]:
        """The chosen options the models predict as the stack without them."""
        priced = MODELLED_OPTIONS + (("compile",) if self.compiled is not None else ())
        return tuple(o for o in self.options if o not in priced)

    @property
    def options_note(self) -> str | None:
        """What the models do with the chosen options, or None when every one is priced."""
        missing = self.unmodelled_options
        return f"{', '.join(missing)}: {OPTION_NOT_MODELLED}" if missing else None

    def fits_prior(self, device_kind: str) -> FitsPrior:
        return CPU if device_kind == "cpu" else self.gpu_fits_prior

    def constants_for(self, device_kind: str) -> PerfConstants:
        """The constants that price the stack on ``device_kind`` (``cpu``: ``cpu_constants`` where
        measured, else ``constants``)."""
        return self.cpu_constants if device_kind == "cpu" and self.cpu_constants is not None else self.constants

    def refusals(self, config: ParallelConfig, model: ModelSpec | None = None,
                 training: TrainingSpec | None = None, device_kind: str = "gpu") -> list[str]:
        """The codes of ``STACK_RULES`` that ``config`` breaks on this stack (empty: it runs it);
        with ``model`` and ``training``, the runner's splitting rules too (``native_rules``)."""
        broken = []
        if (config.dp_shard is not None and not self.hsdp) or (config.offload and not self.offload):
            broken.append("stack_fsdp_options")
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
        if self.native_rules and model is not None and training is not None \
                and fsdp_problems(model, training, config, device_kind, world=None):
            broken.append("stack_native_split")
        if self.runner is not None and self.runner.deepspeed and model is not None and training is not None \
                and deepspeed_moe_refusals(model, training, config):
            broken.append("stack_moe_split")
        # the degrees its rank layout does not run (cp, ep and their rules: ``pipette.layout``); last, so a
        # candidate the rules above refuse too is counted as before
        if self.layout.problems(config):
            broken.append("stack_layout")
        return broken

    @property
    def embedding_loss_split(self) -> bool:
        """An interleaved (or plain) pipeline whose stages the layers alone do not split evenly runs where
        the layers plus the embedding and the loss do (Megatron-Core's ``account_for_embedding_in_pipeline_split``
        and ``account_for_loss_in_pipeline_split``): the stack's memory splits its stages so
        (``MemoryOptions.stage_balance`` "embedding_loss", ``pipette.memory.embedding_loss_stage_layers``)."""
        return self.memory_options.stage_balance == "embedding_loss"

    def calibration_note(self, device: DeviceSpec) -> str | None:
        """What a plan on ``device`` should say when no run of this stack on its family priced the
        constants (None when one did): they are then carried over from other devices, untested."""
        fam = family(device)
        known = dict(self.calibrated_on)
        if not known or fam in known:
            return None
        where = ", ".join(f"{f.upper() if f != 'cpu' else 'CPU devices'} ({runs})" for f, runs in self.calibrated_on)
        what = "CPU devices" if device.kind == "cpu" else f"{device.name}s"
        curve = "" if device.kind == "cpu" else f"; the GEMM curve is {FAMILY_CURVES.get(fam, FAMILY_CURVES['a100'])}"
        return (f"{self.key}: step-time constants fitted on {where}, none on {what}{curve}; the rest carried over "
                f"untested: expect larger errors than docs/stacks.md reports")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.key, "frameworks": self.frameworks, "options": list(self.options),
            "options_note": self.options_note, "calibrated_on": dict(self.calibrated_on),
            "runs": {"tp": self.tensor_parallel, "pp": self.pipeline_parallel, "zero_stages": list(self.zero_stages),
                     "schedules": list(self.schedules), "recompute": list(self.recompute)},
            "launch_files": list(self.launch_files), "runner_runs": self.runner_runs,
        }


#: Where each device family's GEMM curve comes from (``pipette.efficiency``), for ``Stack.calibration_note``;
#: a family without one uses the A100's.
FAMILY_CURVES: dict[str, str] = {
    "a100": "the A100's (fitted on vTrain's Megatron-DeepSpeed runs)",
    "h100": "the H100's (the probe's measured points, or fitted on Ultra-Scale's nanotron runs)",
    "b200": "the B200's (fitted on SimuMax's Megatron-LM runs)",
}

#: Why a candidate is refused by its stack, by code (the plan's drop reasons).
STACK_RULES: dict[str, str] = {
    "stack_layout": "the stack cannot lay out the ranks so (a cp or ep degree it does not run, or an ep its "
                    "data-parallel ranks do not hold: pipette.layout)",
    "stack_tp": "the stack has no tensor parallelism",
    "stack_pp": "the stack has no pipeline parallelism",
    "stack_zero": "the stack has no such ZeRO/FSDP sharding mode",
    "stack_schedule": "the stack has no such pipeline schedule",
    "stack_recompute": "the stack has no such recomputation granularity",
    "stack_fsdp_options": "HSDP and CPU offload are FSDP's (the stack has neither)",
    "stack_native_split": "the PyTorch-native runner cannot split the model so (tp and the FFN/vocabulary, tied "
                          "embeddings, too few micro-batches for the pipeline, tp or cp of attention not Llama's)",
    "stack_moe_split": "the DeepSpeed runner trains experts (AutoEP) without tp or pp, under ZeRO 0-2, LoRA on the "
                       "attention alone (beside ep > 1 without ZeRO)",
    "stack_routing": "the stack runs none of the MoE routings the job allows (torchtitan's router is dropless)",
}

#: Pipette's runner on CPU workers (gloo, fp32): ``HF_DEEPSPEED_CONSTANTS`` with the terms a CPU
#: run spends its time in fitted on the runner's own CPU trials, since the GPU constants priced them
#: fast and ranked the two stacks' candidates on different scales. Fitted by
#: tests/benchmarks/pipette_cpu_fit.py on half the pipette rows of an exhaustive CPU run, the other
#: half held out: docs/results.md, "The CPU terms of each stack".
PIPETTE_CPU_CONSTANTS = replace(
    HF_DEEPSPEED_CONSTANTS,
    #: fixed time per layer per forward-equivalent pass: DeepSpeed's hooks and the small ops,
    #: Python-bound on a CPU core (the GPU fit: 7.99e-4)
    layer_overhead_s=4.87e-3,
    #: memory passes over T x h per layer forward: fitted at its bound, 0 (the one model of the
    #: fit cannot tell them from the per-layer time; the GPU fit: 32.8)
    elementwise_passes=0.0,
    #: fixed cost of one blocking collective (gloo on loopback, ranks sharing 2 cores; GPU: 0)
    collective_overhead_s=7.05e-3,
    #: a pipeline hop's fixed cost: fitted at its bound, 0
    p2p_overhead_s=0.0,
    #: memory passes over T x f per layer forward: the GPU fit's value the CPU terms were fitted beside
    #: (the GPU's is refitted apart: 17.2 since its attention is priced at FlashAttention-2's rates)
    ffn_passes=13.4,
)

PIPETTE = Stack(
    name="pipette",
    frameworks="Pipette's runner (Hugging Face eager Llama-family models under DeepSpeed; experts under AutoEP)",
    description="what `pipette tune` runs and its launch files start; constants fitted on h100_single_gpu.csv",
    constants=HF_DEEPSPEED_CONSTANTS, cpu_constants=PIPETTE_CPU_CONSTANTS, memory_options=DEFAULT_OPTIONS,
    gpu_fits_prior=PIPETTE_GPU,
    tensor_parallel=True, pipeline_parallel=True, zero_stages=(0, 1, 2, 3), schedules=("1f1b",),
    recompute=("none", "selective", "full"), launch_files=DEEPSPEED_FILES, runner=DEEPSPEED_RUNNER,
    layout=PIPETTE_LAYOUT,
    calibrated_on=(("h100", "h100_single_gpu.csv"), ("cpu", "its own CPU trials")),
)
#: HF Trainer / Accelerate with DeepSpeed: the same eager HF model and DeepSpeed engine as
#: Pipette's runner, so the same constants and prior (not measured apart: docs/stacks.md).
#: Tensor and pipeline parallelism only where the script builds them (AutoTP, PipelineModule);
#: gradient_checkpointing is full recomputation only.
HF_DEEPSPEED = replace(
    PIPETTE, name="hf-deepspeed", frameworks="Hugging Face Trainer / Accelerate with DeepSpeed",
    description="`--script-kind hf-trainer` scripts; the runner's constants (same model code and engine)",
    recompute=("none", "full"), runner=None, available_options=("compile",), script_kinds=("hf-trainer",),
    layout=HF_DEEPSPEED_LAYOUT,
    # its context parallelism is DeepSpeed Ulysses' all-to-all (pipette.layout: hf-deepspeed's cp_kind)
    constants=replace(HF_DEEPSPEED_CONSTANTS, cp_comm="a2a"), memory_options=replace(DEFAULT_OPTIONS, cp_comm="a2a"),
)
#: The megatron stack's memory-pressure stall (``pipette.perf.MemoryPressure``: the caching
#: allocator's flush and retry as the estimated peak nears capacity), fitted by
#: tests/benchmarks/pressure_fit.py on the Ultra-Scale rows of 17 of its 21 (model, nodes) groups
#: (nanotron, 8x H100 80GB nodes), checked on the other 4 (docs/stacks.md). Seconds per micro-batch
#: at capacity, and the share of capacity where it starts. Only under the ``alloc-pressure``
#: option: on by default it made the Ultra-Scale MAPE worse and priced MLPerf's Llama-2-70B LoRA
#: layout, which runs at full speed near capacity, far too slow. Its fits: docs/results.md, "The
#: memory-pressure stall".
MEGATRON_PRESSURE_STALL_S = 1.057
MEGATRON_PRESSURE_ONSET = 0.627
MEGATRON_PRESSURE = MemoryPressure(MEGATRON_PRESSURE_STALL_S, MEGATRON_PRESSURE_ONSET, MEGATRON_OPTIONS)
#: ``megatron+fp8`` / ``+mxfp8`` / ``+nvfp4``: the recipe's GEMM throughput relative to the bf16 curve
#: at the recipe's peak (``PerfConstants.fp8_efficiency``). Fitted (tests/benchmarks/crossval_problems.py,
#: ``megatron-bridge``; rows and sets: ``pipette.constant_sources``) on Megatron-Bridge's dense Llama runs.
MEGATRON_FP8_EFFICIENCY = 0.916  # per-tensor (FP8, FP8-CS): 27 rows
MEGATRON_MXFP8_EFFICIENCY = 0.866  # blockwise MXFP8 (MXFP8, FP8-MX): 22 rows
#: NVFP4 relative to the FP8 tensor rate (``Stack.nvfp4_peak``), not the data sheet's FP4 peak: at the same
#: layouts GB300's runs are 1.21x GB200's under NVFP4 and 1.24x under FP8 (Llama 3.1 405B, 26.06), where the
#: FP4 peaks differ 1.5x and the FP8 peaks not at all (docs/results.md)
MEGATRON_NVFP4_EFFICIENCY = 1.359  # NVFP4 over the FP8 rate: 18 rows
#: ``PerfConstants.tensor_rate_shares`` of the Megatron-Core recipes: B200 is the reference (its curve was fitted
#: on SimuMax's B200 runs); GB200's and GB300's data sheets give the same FP8 and BF16 peaks, yet at the same
#: layout and recipe GB300 runs 1.19-1.21x faster, which cuDNN's attention timings (1.08-1.18x) and the
#: norms' (1.0x) do not account for. Fitted per GPU on Megatron-Bridge's runs (rows: pipette.constant_sources).
MEGATRON_GB300_TENSOR_RATE = 1.323  # 23 rows
MEGATRON_GB200_TENSOR_RATE = 1.036  # 31 rows
MEGATRON_H100_TENSOR_RATE = 0.905  # 9 rows
MEGATRON_TENSOR_RATE_SHARES: tuple[tuple[str, float], ...] = (
    ("GB300", MEGATRON_GB300_TENSOR_RATE), ("GB200", MEGATRON_GB200_TENSOR_RATE), ("H100", MEGATRON_H100_TENSOR_RATE))
#: the megatron stack's: Megatron's constants, packed documents attending within themselves (Megatron-Core's
#: THD format, which Megatron-Bridge's fine-tuning recipes run: ``packed_sequence=True``)
MEGATRON_STACK_CONSTANTS = replace(MEGATRON_CONSTANTS, varlen_attention=True)
#: Megatron-Core with Transformer Engine as Megatron-Bridge runs it (``megatron+te``; the engine of every
#: recipe below): fused attention at its measured timings, the userbuffer TP overlap, sequence parallelism
#: (norms and residuals on the 1/t shard, pipeline hops carrying it), the devices' tensor-rate shares.
#: Nothing in it is fitted on BF16 runs: it is the FP8 recipes' engine with the GEMMs in the training dtype
#: (``megatron`` alone keeps the constants of vTrain's unfused Megatron-DeepSpeed and nanotron).
MEGATRON_TE_CONSTANTS = replace(MEGATRON_STACK_CONSTANTS, flash_attention=True, tp_overlap=1.0, sequence_parallel=True,
                                p2p_sequence_sharded=True, measured_attention=True,
                                tensor_rate_shares=MEGATRON_TENSOR_RATE_SHARES)
#: Megatron-Core's Transformer Engine FP8 as Megatron-Bridge and MLPerf run it: the engine above with FP8
#: GEMMs, casts fused into the norms and activations (FP8 weights), LoRA adapters on the roofline.
MEGATRON_FP8_CONSTANTS = replace(MEGATRON_TE_CONSTANTS, fp8_gemms=True, fp8_casts_fused=True,
                                 fp8_efficiency=MEGATRON_FP8_EFFICIENCY)
#: Megatron-LM and NeMo: fused kernels, vocab-parallel loss, the distributed optimizer (ZeRO-1),
#: fp32 gradient buffers. Constants fitted on vTrain (Megatron-DeepSpeed) and the Ultra-Scale set
#: (nanotron, whose kernels and schedule are Megatron's); the memory options and the prior on
#: SimuMax's Megatron-LM runs. ``megatron+alloc-pressure`` adds the memory-pressure stall
#: (``MEGATRON_PRESSURE``).
MEGATRON = Stack(
    name="megatron", frameworks="Megatron-LM, NeMo",
    description="fused kernels, vocab-parallel loss, distributed optimizer; constants fitted on vTrain + Ultra-Scale",
    constants=MEGATRON_STACK_CONSTANTS, memory_options=MEGATRON_OPTIONS, gpu_fits_prior=MEGATRON_GPU,
    tensor_parallel=True, pipeline_parallel=True, zero_stages=(0, 1), schedules=("1f1b", "interleaved"),
    recompute=("none", "selective", "full"), launch_files=(*CANDIDATE_FILES, "megatron_args.txt"),
    layout=MEGATRON_LAYOUT,
    framework_files=("megatron_args.txt",),
    available_options=("fp8", "mxfp8", "nvfp4", "te", "alloc-pressure"), memory_pressure=MEGATRON_PRESSURE,
    recipe_efficiencies=(("mxfp8", MEGATRON_MXFP8_EFFICIENCY), ("nvfp4", MEGATRON_NVFP4_EFFICIENCY)),
    nvfp4_peak="fp8",
    #: Megatron-LM / NeMo FP8 is Transformer Engine's: its fused attention (cuDNN / flash, not the
    #: unfused one the bf16 constants were fitted with on vTrain), the casts fused into the norm and
    #: activation kernels, its userbuffer TP overlap, and (NeMo ``fp8_params``) FP8 weights: MLPerf's
    #: Llama-2-70B LoRA reference (NVTE_FUSED_ATTN=1, TP_COMM_OVERLAP=True, FP8=True sets fp8 and
    #: fp8_params; docs/stacks.md); its efficiency fitted on Megatron-Bridge's runs (above).
    fp8_constants=MEGATRON_FP8_CONSTANTS, te_constants=MEGATRON_TE_CONSTANTS,
    bare_note=("priced as unfused Megatron (vTrain's Megatron-DeepSpeed); Megatron-Core with Transformer Engine, "
               "Megatron-LM's default and what NeMo and Megatron-Bridge run: --stack megatron+te (bf16) or "
               "megatron+fp8 / +mxfp8 / +nvfp4"),
    fp8_memory_options=replace(MEGATRON_OPTIONS, fp8_weights=True, linear_input_bytes=FP8_INPUT_BYTES),
    #: the linear inputs saved in the recipe's format (``MemoryOptions.linear_input_bytes``); the weights
    #: not in FP8: an MXFP8 weight keeps a row-wise and a column-wise copy, each with its scales (TE's
    #: ``MXFP8Tensor``), and Megatron-Bridge's NVFP4 recipe keeps bf16 parameters (``bf16_with_nvfp4_mixed``:
    #: ``fp8_param_gather = False``; megatron/bridge/training/mixed_precision.py)
    recipe_memory_options=(("mxfp8", replace(MEGATRON_OPTIONS, linear_input_bytes=MXFP8_INPUT_BYTES)),
                           ("nvfp4", replace(MEGATRON_OPTIONS, linear_input_bytes=NVFP4_INPUT_BYTES))),
    calibrated_on=(("a100", "vTrain"), ("h100", "Ultra-Scale's nanotron runs; Megatron-Bridge's FP8 runs"),
                   ("b200", "SimuMax; Megatron-Bridge's B200, GB200 and GB300 runs")),
)
#: nanotron (Hugging Face's 3D-parallel trainer): Megatron's step-time constants (the Ultra-Scale
#: set they were fitted on is nanotron's) and nanotron's own memory (``NANOTRON_OPTIONS``: fp32
#: gradient buffers unsharded under ZeRO-1, DDP's bucket copies under ZeRO-0, stages balanced by
#: compute cost) with its prior, both fitted on the Ultra-Scale set. Recomputation is whole layers
#: only (``ParallelismArgs.recompute_layer``); its pipeline engine runs 1F1B (and
#: all-forward-all-backward, which Pipette does not plan).
NANOTRON = Stack(
    name="nanotron", frameworks="nanotron (Hugging Face)",
    description="Megatron's constants; nanotron's memory (fp32 grad buffers, its ZeRO-1, compute-balanced stages)",
    constants=MEGATRON_CONSTANTS, memory_options=NANOTRON_OPTIONS, gpu_fits_prior=NANOTRON_GPU,
    tensor_parallel=True, pipeline_parallel=True, zero_stages=(0, 1), schedules=("1f1b",),
    recompute=("none", "full"), launch_files=(*CANDIDATE_FILES, "nanotron.yaml"), framework_files=("nanotron.yaml",),
    layout=NANOTRON_LAYOUT,
    calibrated_on=(("h100", "Ultra-Scale"), ("a100", "vTrain's Megatron-DeepSpeed runs, fitted with it")),
)
#: ``FSDP_CONSTANTS.attention_efficiency`` (0.181, fitted on H100 runs) carried to an A100: 0.181 x
#: 0.615 / 0.35, FlashAttention-2's utilization of each (below).
FSDP_A100_ATTENTION_EFFICIENCY = 0.318
#: PyTorch FSDP's own terms (``pipette.perf.PerfConstants``): fused attention (SDPA /
#: flash-attn 2) at its own efficiency, gathers and reduce-scatters prefetched under compute,
#: one gather per unit and pass under activation checkpointing (no re-gather for the
#: recomputation), cross-node rings on every NIC of a node. The H100 GEMM curve and the link
#: share are the Megatron stack's (Ultra-Scale). Fitted (least squares on log(predicted /
#: measured), soft-L1) by tests/benchmarks/stack_fit.py on llm-foundry's bf16 FULL_SHARD runs of
#: MPT 760M, 3B, 13B and 70B (38 rows of llmfoundry_h100_fsdp.csv); checked on its 1B, 7B and
#: 30B runs and on torchtitan's FSDP2 runs (docs/stacks.md).
FSDP_CONSTANTS = replace(
    MEGATRON_CONSTANTS, flash_attention=True, recompute_regathers=False,
    #: memory passes over T x h per layer forward: LayerNorm with biases, GeLU over 4h, residuals
    elementwise_passes=27.2,
    #: fixed time per layer per forward-equivalent pass (FSDP's per-unit hooks, small kernels)
    layer_overhead_s=1.42e-3,
    #: fraction of the bf16 peak the flash-attn 2 kernels reach on an H100
    attention_efficiency=0.181,
    #: on an A100: the H100 fit scaled by FlashAttention-2's utilization there against an H100's (62%,
    #: the middle of Dao 2023's 50-73%, over Shah et al. 2024's 35%): counted, not fitted (no FSDP run
    #: on an A100 in the shared data; a plan there says so: ``calibration_note``)
    attention_efficiencies=(("a100", FSDP_A100_ATTENTION_EFFICIENCY),),
    #: share of a phase's compute that hides its gathers and reduce-scatters (prefetch)
    shard_overlap=0.809,
    #: share of a node's summed NIC bandwidth its data-parallel rings reach (fit at the bound: 1.0)
    dp_cut_fraction=1.0,
    #: selective recomputation is torchtitan's per-op checkpointing: half of the matmuls (counted)
    op_sac_linear_share=0.5,
    #: DTensor sequence parallelism under TP: norms, residuals and FP8 input casts on the 1/t shard
    sequence_parallel=True,
    #: ``fsdp+fp8``: FP8 GEMM throughput relative to the bf16 curve, fitted on llm-foundry's 7 fp8
    #: runs (Transformer Engine). Above 1 because TE fuses the casts into the norm and the GEMM
    #: (LayerNormLinear), which the counted cast passes (perf.FP8_CAST_BYTES) charge in full.
    fp8_efficiency=1.365,
    #: context parallelism as torchtitan runs it on GPUs: PyTorch's ring with the all-gather rotation
    #: (torchtitan's default ``context_parallel_rotate_method``; pipette.perf_cp), K and V repeated to the
    #: query heads before it (torchtitan's Llama)
    cp_comm="allgather", cp_repeat_kv=True,
)
#: The fsdp stack on CPU workers (gloo, fp32): ``FSDP_CONSTANTS`` with the terms a CPU run spends
#: its time in fitted on the fsdp runner's own CPU trials, never borrowed from the pipette stack.
#: Fitted (least squares on log(predicted / measured), soft-L1) by tests/benchmarks/fsdp_cpu_run_fit.py
#: on the fsdp rows of the exhaustive run the pipette rows of PIPETTE_CPU_CONSTANTS come from, so both
#: families sit on one scale, and checked on another run. The tensor-parallel collective, which that
#: tp-1 space never shows, is kept from dedicated trials (tests/benchmarks/fsdp_cpu_calibration.py).
#: The runs and figures: docs/results.md, "The CPU terms of each stack"; docs/fsdp.md.
FSDP_CPU_CONSTANTS = replace(
    FSDP_CONSTANTS,
    #: fixed time per layer per forward-equivalent pass: FSDP's per-unit hooks and the small ops,
    #: Python-bound on a CPU core (the GPU fit: 1.42e-3)
    layer_overhead_s=5.48e-3,
    #: memory passes over T x h per layer forward: fitted at its bound, 0 (on these runs the
    #: per-layer time alone fits them; the GPU fit: 27.2)
    elementwise_passes=0.0,
    #: fixed cost of one blocking collective: the tensor-parallel all-reduces (gloo on loopback,
    #: ranks sharing 2 cores; GPU: 0)
    collective_overhead_s=4.22e-2,
    #: fixed cost of one of FSDP2's per-unit gathers or gradient reductions over a stage's
    #: data-parallel group (issued asynchronously, the next unit's gather prefetched; GPU: 0)
    unit_collective_s=1.43e-2,
    #: a pipeline hop's fixed cost: fitted at its bound, 0 (the schedule's non-blocking p2p; a
    #: receive's wait is the data dependency the 1F1B formula prices)
    p2p_overhead_s=0.0,
    #: the share of the 1F1B bubble that costs wall time on these runs (the dedicated-trial fit put
    #: it at its bound, 0: the cpu-4 cluster's 4 ranks share 2 cores, so a waiting stage may leave
    #: its core to the others)
    bubble_share=0.827,
    #: the runner's own ring on CPU ranks (workers.rank.ring_attention: KV blocks point to point, the
    #: key/value heads only)
    cp_comm="p2p", cp_repeat_kv=False,
)
#: ``fsdp+compile``: the share of the elementwise passes and per-layer overhead left under
#: torch.compile (torchtitan compiles each transformer block: ``apply_compile``). Fitted by
#: tests/benchmarks/torchtitan_fit.py on torchtitan's two compiled bf16 1D FSDP runs (8B on 8 and 128
#: H100s; the eager pair fixes the device); held out: its other 22 compiled runs (docs/stacks.md).
FSDP_COMPILE_ELEMENTWISE_SHARE = 0.0
#: ``fsdp+compile+fp8``: torchao Float8 (tensorwise) GEMM efficiency relative to the bf16 curve, the
#: casts fused by compile. Fitted by tests/benchmarks/torchtitan_fit.py on torchtitan's two compiled
#: Float8 1D FSDP runs (8B on 8 and 128 H100s); held out: its other 16 (TP, PP, H200, 32k sequence).
FSDP_COMPILE_FP8_EFFICIENCY = 0.788
#: ``fsdp+async-tp``: the share of a micro-batch's linear-layer GEMM time that hides the TP
#: collectives (``PerfConstants.tp_overlap``) under torchtitan's async TP (``enable_async_tensor_parallel``:
#: torch._inductor's micro-pipelined collective matmuls, ``_micro_pipeline_tp``). Fitted by
#: tests/benchmarks/torchtitan_fit.py on its 70B bf16 async run (256 H100s, FSDP32 x TP8); held out:
#: its other 9 async runs (8B on 64 GPUs, 70B Float8, 405B under PP).
FSDP_ASYNC_TP_OVERLAP = 0.137
#: ``fsdp+fp8-rowwise``: torchao Float8's rowwise-scaled GEMM efficiency relative to the bf16 curve
#: (per-row scales: a slower scaled-mm kernel than tensorwise). Fitted by
#: tests/benchmarks/torchtitan_fit.py on torchtitan's 70B rowwise run without async TP (256 H100s);
#: held out: its other 3 rowwise runs (70B async TP, 8B on 64 GPUs).
FSDP_FP8_ROWWISE_EFFICIENCY = 0.514
#: PyTorch FSDP/FSDP2 (torchtitan, Accelerate FSDP, llm-foundry): ZeRO-3-like FULL_SHARD with
#: fp32 sharded master and fp32 gradient reduction; torchtitan adds TP and PP schedules. Priced
#: with ``FSDP_CONSTANTS``, the memory with FSDP2's terms (``FSDP_OPTIONS``; docs/fsdp.md).
FSDP = Stack(
    name="fsdp", frameworks="PyTorch FSDP/FSDP2: torchtitan, Accelerate FSDP, llm-foundry",
    description="FULL_SHARD/SHARD_GRAD_OP/NO_SHARD, HSDP, CPU offload; its own constants (prefetch overlap, flash "
                "attention), FSDP2's memory (sharded fp32 states, per-layer gathers)",
    constants=FSDP_CONSTANTS, cpu_constants=FSDP_CPU_CONSTANTS,
    memory_options=FSDP_OPTIONS, gpu_fits_prior=FSDP_GPU,
    tensor_parallel=True, pipeline_parallel=True, zero_stages=(0, 2, 3), schedules=("1f1b", "interleaved"),
    recompute=("none", "selective", "full"), launch_files=NATIVE_FILES, layout=FSDP_LAYOUT,
    available_options=("compile", "fp8", "fp8-rowwise", "async-tp"), async_tp_overlap=FSDP_ASYNC_TP_OVERLAP,
    fp8_rowwise_efficiency=FSDP_FP8_ROWWISE_EFFICIENCY,
    runner=NATIVE_RUNNER, script_kinds=("accelerate-fsdp", "torchtitan"), fsdp_scripts=True,
    framework_files=("torchtitan.toml",),
    hsdp=True, offload=True, native_rules=True, sharded_pipeline=True, uneven_virtual_stages=True,
    compiled=CompileTerms(elementwise_share=FSDP_COMPILE_ELEMENTWISE_SHARE, fused_loss=True,
                          fragmentation=FSDP_COMPILE_FRAGMENTATION, fp8_efficiency=FSDP_COMPILE_FP8_EFFICIENCY),
    calibrated_on=(("h100", "llm-foundry, torchtitan"), ("cpu", "its own CPU trials")),
)

STACKS: dict[str, Stack] = {s.name: s for s in (PIPETTE, HF_DEEPSPEED, MEGATRON, NANOTRON, FSDP)}


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
    chosen = tuple(sorted(set(options)))
    rowwise = "fp8-rowwise" in chosen
    recipes = [o for o in chosen if o in LOW_PRECISION_RECIPES]
    if len(recipes) > 1:
        raise SpecError(f"{stack!r} names two FP8 recipes ({', '.join(recipes)})", field=field,
                        fix=f"use one of {', '.join(f'{name}+{o}' for o in recipes)}, not several")
    constants, memory = found.constants, found.memory_options
    if recipes:
        constants = found.fp8_constants or replace(found.constants, fp8_gemms=True)
        memory = dict(found.recipe_memory_options).get(recipes[0], found.fp8_memory_options or found.memory_options)
        efficiency = dict(found.recipe_efficiencies).get(recipes[0])
        if efficiency is not None:
            constants = replace(constants, fp8_efficiency=efficiency,
                                low_precision_peak=found.nvfp4_peak if recipes[0] == "nvfp4" else "fp8")
    elif "te" in chosen and found.te_constants is not None:
        constants = found.te_constants
    if "compile" in chosen and found.compiled is not None:
        constants, memory = found.compiled.apply(constants, memory)
    if rowwise and found.fp8_rowwise_efficiency is not None:
        constants = replace(constants, fp8_efficiency=found.fp8_rowwise_efficiency)
    if "async-tp" in chosen:
        constants = replace(constants, tp_overlap=found.async_tp_overlap)
    if "alloc-pressure" in chosen and found.memory_pressure is not None:
        constants = replace(constants, memory_pressure=replace(found.memory_pressure, options=memory))
    # the runner runs no option (check_runner_runs): a launch.sh of it would not run what was priced
    files = tuple(f for f in found.launch_files if f != "launch.sh") if chosen and found.runner_runs \
        else found.launch_files
    return replace(found, options=chosen, constants=constants, memory_options=memory, launch_files=files)


#: Between the stacks of a plan that ranks several side by side: ``pipette,fsdp``.
STACK_SEPARATOR = ","


def stack_layout(stack: str) -> StackLayout:
    """The rank layout of ``stack`` (a name, options after ``+`` ignored): its entry's ``Stack.layout``."""
    name = stack.split("+", 1)[0].strip().lower()
    if name not in STACKS:
        raise SpecError(f"no rank layout for stack {name!r}", field="stack", fix=f"use one of {', '.join(STACKS)}")
    return STACKS[name].layout


def rank_layout(config: ParallelConfig, stack: str | None) -> Layout:
    """The mesh of ``config`` in ``stack``'s order (None: the canonical one): ``pipette.layout.layout_of``
    by the stack's name."""
    return layout_of(config, None if stack is None else stack_layout(stack))


def get_stacks(stacks: str | Stack | Sequence[str | Stack] | None, *, field: str = "stack") -> tuple[Stack, ...]:
    """One stack or several (``pipette,fsdp``, or a list of names): each as ``get_stack`` says, in
    the order given; the same stack twice is a ``SpecError``."""
    if stacks is None or isinstance(stacks, Stack):
        return (get_stack(stacks, field=field),)
    parts = stacks.split(STACK_SEPARATOR) if isinstance(stacks, str) else list(stacks)
    if not parts or any(isinstance(p, str) and not p.strip() for p in parts):
        raise SpecError(f"is {stacks!r}", field=field,
                        fix=f"name one stack or several separated by commas (pipette,fsdp); known: {', '.join(STACKS)}")
    chosen = tuple(get_stack(p, field=field) for p in parts)
    keys = [s.key for s in chosen]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise SpecError(f"names {', '.join(twice)} twice", field=field, fix="name each stack once")
    return chosen


def stacks_key(stacks: tuple[Stack, ...]) -> str:
    """The stacks' keys joined as a user writes them (``pipette,fsdp``); one stack: its key."""
    return STACK_SEPARATOR.join(s.key for s in stacks)


def runner_stacks() -> list[str]:
    """The stacks Pipette's own trial runner runs."""
    return [s.name for s in STACKS.values() if s.runner_runs]


#: The stack a script kind's scripts are code of (``Stack.script_kinds``): theirs when no stack is named.
SCRIPT_KIND_STACKS: dict[str, str] = {kind: s.name for s in STACKS.values() for kind in s.script_kinds}
#: Files only one framework reads, and its stack (``Stack.framework_files``).
FRAMEWORK_FILES: dict[str, str] = {f: s.name for s in STACKS.values() for f in s.framework_files}


def stacks_named(names: str | None, *, default: str | None = None, field: str = "stack") -> tuple[Stack, ...]:
    """The stacks of a job's stack option: one (``names``, else ``default``, else the default
    stack) or several side by side (``pipette,fsdp``); which kind of trial may run them is the
    registry's question (``pipette.registry.job_kind``)."""
    if names is None or STACK_SEPARATOR not in names:
        return (get_stack(names or default, field=field),)
    return get_stacks(names, field=field)


def check_runner_runs(stack: Stack, *, field: str = "stack") -> Runner:
    """``stack``'s runner; a stack Pipette's own runner does not run (or runs without the chosen
    options) is refused in one line."""
    if stack.runner is None:
        raise SpecError(
            f"{stack.key} cannot be tuned by Pipette's runner, which runs {', '.join(runner_stacks())} only",
            field=field, fix=f"tune your own {stack.name} script with --script, or plan it with `pipette plan "
                             f"--stack {stack.key}`",
        )
    if stack.options:
        raise SpecError(f"{stack.key}: Pipette's runner runs {stack.name} without {', '.join(stack.options)}",
                        field=field, fix=f"tune --stack {stack.name}, or your own script with --script")
    return stack.runner


__all__ = [
    "DEFAULT_STACK",
    "FRAMEWORK_FILES",
    "FSDP",
    "FSDP_A100_ATTENTION_EFFICIENCY",
    "FSDP_ASYNC_TP_OVERLAP",
    "FSDP_COMPILE_ELEMENTWISE_SHARE",
    "FSDP_COMPILE_FP8_EFFICIENCY",
    "FSDP_CONSTANTS",
    "FSDP_CPU_CONSTANTS",
    "FSDP_FP8_ROWWISE_EFFICIENCY",
    "HF_DEEPSPEED",
    "MEGATRON",
    "MEGATRON_PRESSURE",
    "MODELLED_OPTIONS",
    "NATIVE_FILES",
    "OPTIONS",
    "PIPETTE",
    "PIPETTE_CPU_CONSTANTS",
    "SCRIPT_KIND_STACKS",
    "STACKS",
    "STACK_RULES",
    "STACK_SEPARATOR",
    "CompileTerms",
    "Stack",
    "check_runner_runs",
    "get_stack",
    "get_stacks",
    "rank_layout",
    "runner_stacks",
    "stack_layout",
    "stacks_key",
    "stacks_named",
]
