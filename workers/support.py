"""What the backends can run: every candidate is checked here before any process starts.

The backend for a candidate is DeepSpeed in every case (``backend_name``):
pp == 1 runs the Hugging Face model under the DeepSpeed engine (ZeRO 0-3); pp > 1 runs it
as a ``PipelineModule`` under DeepSpeed's pipeline engine, with a tied embedding shared by the
first and last stage through ``TiedLayerSpec``. tp > 1 is Megatron-style sharding by
``workers.rank.tp_shard`` in both (linear layers and the vocabulary, built shard by shard:
``workers.rank.build``); the emitted config's AutoTP block is for users' own scripts.

``refusals_for`` needs only the job and the candidate, so a tuner can drop the candidates no
backend runs before it measures anything; ``refusals``/``check_runnable`` take a ``TrialSpec``.
"""

from __future__ import annotations

from pipette.config import ParallelConfig
from pipette.datafiles import check_checkpoint, jsonl_token_ids
from pipette.errors import InfeasibleError
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from workers.fsdp_spec import fsdp_problems
from workers.spec import TrialSpec

DEVICE_KINDS = ("cpu", "gpu")


def refusals_for(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str,
                 script: ScriptSpec | None = None, nodes: list[int] | None = None, stack: str = "pipette") -> list[str]:
    """Why the backends cannot run ``config`` for this job on ``device_kind`` devices; empty
    when they can. With ``script``, why the user's script cannot (``ScriptSpec.refusals``;
    ``nodes``: the node of each device). Pure: builds no model and starts no process."""
    out = []
    if device_kind not in DEVICE_KINDS:
        out.append(f"device kind {device_kind!r} is not one of {', '.join(DEVICE_KINDS)}")
    if script is not None:
        return out + script.refusals(training, config, nodes) + job_refusals(model, training, device_kind, script)
    if stack == "fsdp":
        return out + job_refusals(model, training, device_kind) + fsdp_refusals(model, training, config, device_kind)
    return out + job_refusals(model, training, device_kind) + runner_refusals(model, config)


def fsdp_refusals(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str) -> list[str]:
    """Why the PyTorch-native runner (``workers.rank.fsdp``) cannot run ``config``."""
    return [f"{message} ({field}: {fix})" for message, field, fix in
            fsdp_problems(model, training, config, device_kind, world=config.world)]


def runner_refusals(model: ModelSpec, config: ParallelConfig) -> list[str]:
    """Why Pipette's runner (DeepSpeed's engines, its tensor parallelism) cannot run ``config``."""
    m, c = model, config
    out = []
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


def job_refusals(model: ModelSpec, training: TrainingSpec, device_kind: str | None,
                 script: ScriptSpec | None = None) -> list[str]:
    """Why no candidate of this job can run, whatever its degrees: the part of ``refusals_for``
    a service can check at submit (``device_kind`` None: not measured yet, so not checked)."""
    out = []
    if script is None:  # the runner builds the model itself; a script builds its own
        if model.arch != "llama":
            out.append(f"the runner builds Llama models; {model.name} is {model.arch}")
        if training.seq_len > model.max_seq:
            out.append(f"seq_len {training.seq_len} exceeds the model's max_seq {model.max_seq}")
    if device_kind == "cpu" and training.dtype == "fp16":
        out.append("fp16 training needs a GPU; use bf16 or fp32 on CPU")
    return out


def refusals(trial: TrialSpec) -> list[str]:
    """Why the backends cannot run ``trial``; empty when they can."""
    return refusals_for(trial.model, trial.training, trial.config, trial.device_kind, trial.script,
                        stack=trial.stack)


def check_runnable(trial: TrialSpec) -> None:
    reasons = refusals(trial)
    if reasons:
        raise InfeasibleError(
            f"cannot run {trial.config.label}: " + "; ".join(reasons),
            field="config", fix="choose a candidate the backends can run",
            reasons={r: 1 for r in reasons},
        )


def backend_name(trial: TrialSpec) -> str:
    """What Pipette's runner runs ``trial`` with (a script trial's is ``script``: workers.host.kinds)."""
    c = trial.config
    parts = ["deepspeed", "pipeline" if c.pp > 1 else "engine", f"zero{c.zero_stage}"]
    if c.tp > 1:
        parts.append("megatron-tp")
    if c.pp > 1 and trial.model.tied_embeddings:
        parts.append("tied-embedding")
    if trial.training.is_lora:
        parts.append("tp-lora" if c.tp > 1 else "peft-lora")
    return "+".join(parts)


_CHECKED: set[tuple[str, str]] = set()


def check_inputs(trial: TrialSpec) -> None:
    """Refuse, before any rank starts, a trial whose inputs are not usable: a data file that is
    missing, unreadable, not JSONL or shorter than one sequence; a checkpoint that is missing,
    unreadable or not this model's (the first mismatching tensor and both shapes). Each is
    read once per process."""
    if trial.data is not None and (trial.data, str(trial.training.seq_len)) not in _CHECKED:
        jsonl_token_ids(trial.data, trial.model.vocab, trial.training.seq_len)
        _CHECKED.add((trial.data, str(trial.training.seq_len)))
    if trial.checkpoint is None or (trial.checkpoint, trial.model.name) in _CHECKED:
        return
    check_checkpoint(trial.model, trial.checkpoint)
    _CHECKED.add((trial.checkpoint, trial.model.name))
