"""What the backends can run: every candidate is checked here before any process starts.

Which rules apply is the registry's answer (``pipette.registry.candidate_refusals``): the user's
script's, or those of the runner of the trial's stack (``pipette.runners``). Pipette's DeepSpeed
runner (``backend_name``): pp == 1 runs the Hugging Face model under the DeepSpeed engine (ZeRO 0-3); pp > 1 runs it
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
from pipette.registry import candidate_refusals
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from workers.spec import TrialSpec

DEVICE_KINDS = ("cpu", "gpu")


def refusals_for(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str,
                 script: ScriptSpec | None = None, nodes: list[int] | None = None, stack: str = "pipette") -> list[str]:
    """Why the backends cannot run ``config`` for this job on ``device_kind`` devices; empty
    when they can: the user's script's rules with ``script`` (``nodes``: the node of each device),
    else the rules of ``stack``'s runner (``pipette.registry.candidate_refusals``). Pure: builds no
    model and starts no process."""
    out = []
    if device_kind not in DEVICE_KINDS:
        out.append(f"device kind {device_kind!r} is not one of {', '.join(DEVICE_KINDS)}")
    return out + candidate_refusals(model, training, config, device_kind, script, stack, nodes)


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
    if c.ep > 1:
        parts.append(f"autoep{c.ep}")  # DeepSpeed's expert parallelism (ds_config expert_parallel)
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
