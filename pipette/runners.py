"""Pipette's own runners: what a trial of a stack Pipette runs starts, reads and refuses.

A stack whose trials Pipette runs itself names its runner (``pipette.stacks.Stack.runner``); the
host (``workers.host.kinds``), the trial's checks (``pipette.registry.candidate_refusals``) and
``pipette tune``'s stack check (``pipette.stacks.check_runner_runs``) read it from there, so
nothing branches on a stack's name. Two runners today:

- ``DEEPSPEED_RUNNER`` (the ``pipette`` stack): ``workers.rank.train``, Hugging Face's eager Llama
  under DeepSpeed's engines, reading ``ds_config.json`` beside the candidate;
- ``NATIVE_RUNNER`` (the ``fsdp`` stack): ``workers.rank.fsdp``, PyTorch FSDP2, TP and PP on a
  DeviceMesh, reading the candidate alone; its candidates can be traced on fake devices
  (``workers.rank.fsdp_trace``).

Pure: the refusals read the job and the candidate, and start nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipette.autoep import DEEPSPEED_MOE_FAMILIES, autoep_family
from pipette.config import ParallelConfig
from pipette.contract import FSDP_ENTRY, TRAIN_ENTRY
from pipette.fsdp_rules import fsdp_problems
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

#: why a runner cannot run a candidate (model, recipe, candidate, device kind): empty when it can
Refusals = Callable[[ModelSpec, TrainingSpec, ParallelConfig, str], list[str]]


@dataclass(frozen=True)
class Runner:
    """One of Pipette's runners (see the module docstring)."""

    #: the module each rank runs as ``python -m`` (``pipette.contract``)
    entry: str
    #: it trains under DeepSpeed's engines: reads ``ds_config.json`` (``--deepspeed_config``) and,
    #: on CPU devices, needs DeepSpeed's CPU op built before its first trial
    deepspeed: bool
    #: why it cannot run a candidate (``Refusals``)
    refusals: Refusals
    #: its candidates can be traced on fake devices (``workers.rank.fsdp_trace`` runs its code)
    traceable: bool = False

    def rank_args(self) -> list[str]:
        """What follows the interpreter in a rank's command, run in the folder of its files."""
        config = ["--deepspeed_config", "ds_config.json"] if self.deepspeed else []
        return ["-m", self.entry, *config, "--candidate", "candidate.json"]


def builds_the_model(model: ModelSpec, training: TrainingSpec) -> list[str]:
    """Why a runner cannot build this job's model, whatever the candidate: both build Llama models
    (``workers.rank.build``) of at most the model's ``max_seq`` (a user's script builds its own)."""
    out = []
    if model.arch != "llama":
        out.append(f"the runner builds Llama models; {model.name} is {model.arch}")
    unbuilt = model.attention.unbuilt(model.hidden, model.heads, training.seq_len) if model.attention else ""
    if unbuilt:
        out.append(f"the runner builds Llama's, Qwen2's and Qwen3's attention; {model.name}'s has {unbuilt}")
    if training.seq_len > model.max_seq:
        out.append(f"seq_len {training.seq_len} exceeds the model's max_seq {model.max_seq}")
    return out


def deepspeed_moe_refusals(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> list[str]:
    """Why the DeepSpeed runner cannot train ``model``'s experts under ``config``: it builds the Hugging Face
    model of the families above and leaves the experts to DeepSpeed's AutoEP (``expert_parallel`` in the
    ds_config), so without its own tensor parallelism (which shards dense MLPs; AutoEP folds DeepSpeed's
    AutoTP, not Pipette's) and pipeline (AutoEP replaces the blocks of a whole model), ZeRO 0-2 (its ZeRO-3
    fills blocks partitioned before AutoEP replaces them), LoRA on the attention alone (an expert's
    weights are one 3-D tensor per matrix, which PEFT does not wrap) and, beside ep > 1, without ZeRO
    (stage_1_and_2.py ``_configure_moe_settings`` asserts a param group of experts; LoRA freezes them)."""
    if model.moe is None:
        return []
    family = autoep_family(model)
    if family not in DEEPSPEED_MOE_FAMILIES:
        return [f"{model.name}'s experts are not of a family the DeepSpeed runner builds with AutoEP "
                f"({', '.join(DEEPSPEED_MOE_FAMILIES)}): run it with the fsdp stack (--stack fsdp)"]
    out = []
    if config.tp > 1 or config.pp > 1:
        out.append(f"tp={config.tp}, pp={config.pp} with experts: the DeepSpeed runner trains an MoE model "
                   "without tensor or pipeline parallelism (AutoEP over dp); use tp=1, pp=1")
    if config.zero_stage == 3:
        out.append("ZeRO-3 with experts: the DeepSpeed runner trains an MoE model under ZeRO 0-2; use 0, 1 or 2")
    if training.lora is not None and config.ep > 1 and config.zero_stage >= 1:
        out.append(f"LoRA with ep={config.ep} under ZeRO-{config.zero_stage}: DeepSpeed's ZeRO optimizer asserts an "
                   "MoE model trains an expert parameter group, and LoRA freezes the experts; use ZeRO 0 or ep=1")
    mlp = sorted(set(training.lora.targets) & {"gate_proj", "up_proj", "down_proj"}) if training.lora else []
    if mlp:
        out.append(f"LoRA on {', '.join(mlp)} of an MoE model: the DeepSpeed runner adapts the attention alone "
                   "(an expert's weights are one 3-D tensor, which PEFT does not wrap); target q/k/v/o_proj")
    return out


def deepspeed_refusals(model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                       device_kind: str) -> list[str]:
    """Why Pipette's DeepSpeed runner (DeepSpeed's engines, its tensor parallelism) cannot run ``config``."""
    m, c = model, config
    out = []
    out += deepspeed_moe_refusals(m, training, c)
    if m.attention is not None and c.tp > 1 and not m.attention.is_llamas(m.hidden, m.heads, training.seq_len):
        out.append(f"tp={c.tp} with {m.name}'s attention ({m.attention.differences(m.hidden, m.heads)}): the runner's "
                   "tensor parallelism shards Llama's; use tp=1")
    if c.dp_shard is not None or c.offload:
        out.append("HSDP (dp_shard) and CPU offload are options of the fsdp stack (workers.rank.fsdp); DeepSpeed's "
                   "runner has neither: leave them out, or run the candidate with the fsdp stack")
    if c.pp > 1 and c.zero_stage >= 2:
        out.append(f"DeepSpeed's pipeline engine refuses ZeRO-{c.zero_stage} (pp={c.pp}); use ZeRO 0 or 1")
    if c.schedule != "1f1b":
        # deepspeed.runtime.pipe.schedule has TrainSchedule (1F1B) and InferenceSchedule only,
        # and a PipelineModule gives each rank one contiguous block of layers.
        out.append(
            f"schedule {c.schedule!r} with {c.virtual_stages} virtual stages per device: DeepSpeed's "
            "pipeline engine runs only 1F1B with one contiguous stage per device (no interleaving); use 1f1b"
        )
    if c.pp > m.layers:
        out.append(f"pp={c.pp} exceeds the {m.layers} layers")
    if c.tp > 1:
        for name, width in (("heads", m.heads), ("kv_heads", m.kv_heads), ("ffn_hidden", m.ffn_hidden),
                            ("vocab", m.vocab)):
            if width % c.tp:
                out.append(f"tp={c.tp} does not divide {name}={width}")
    return out


def native_refusals(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str) -> list[str]:
    """Why the PyTorch-native runner (``workers.rank.fsdp``) cannot run ``config`` (``pipette.fsdp_rules``)."""
    return [f"{message} ({field}: {fix})" for message, field, fix in
            fsdp_problems(model, training, config, device_kind, world=config.world)]


DEEPSPEED_RUNNER = Runner(entry=TRAIN_ENTRY, deepspeed=True, refusals=deepspeed_refusals)
NATIVE_RUNNER = Runner(entry=FSDP_ENTRY, deepspeed=False, refusals=native_refusals, traceable=True)
