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


def deepspeed_refusals(model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                       device_kind: str) -> list[str]:
    """Why Pipette's DeepSpeed runner (DeepSpeed's engines, its tensor parallelism) cannot run ``config``."""
    m, c = model, config
    out = []
    if m.moe is not None:  # its layers would be built as dense MLPs, and trained without a word
        out.append(f"{m.name} is a Mixture-of-Experts model; DeepSpeed's runner builds dense Llama models: "
                   "run it with the fsdp stack (--stack fsdp)")
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
