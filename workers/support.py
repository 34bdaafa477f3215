"""What the backends can run: every candidate is checked here before any process starts.

The backend for a candidate is DeepSpeed in every case (``backend_name``):
pp == 1 runs the Hugging Face model under the DeepSpeed engine (ZeRO 0-3, AutoTP when
tp > 1); pp > 1 runs it as a ``PipelineModule`` under DeepSpeed's pipeline engine,
with tp > 1 sharded by ``workers.tp_shard`` over the pipeline grid's model-parallel group
(AutoTP cannot parse a ``PipelineModule``; the ``tensor_parallel`` block is then unused).
"""

from __future__ import annotations

from pipette.errors import InfeasibleError
from workers.spec import TrialSpec


def refusals(trial: TrialSpec) -> list[str]:
    """Why the backends cannot run ``trial``; empty when they can."""
    m, t, c = trial.model, trial.training, trial.config
    out = []
    if m.arch != "llama":
        out.append(f"the runner builds Llama models; {m.name} is {m.arch}")
    if t.seq_len > m.max_seq:
        out.append(f"seq_len {t.seq_len} exceeds the model's max_seq {m.max_seq}")
    if c.pp > 1 and c.zero_stage >= 2:
        out.append(f"DeepSpeed's pipeline engine refuses ZeRO-{c.zero_stage} (pp={c.pp}); use ZeRO 0 or 1")
    if c.schedule != "1f1b":
        out.append("DeepSpeed's pipeline engine has no interleaved schedule; use 1f1b")
    if c.pp > m.layers:
        out.append(f"pp={c.pp} exceeds the {m.layers} layers")
    if c.pp > 1 and m.tied_embeddings:
        out.append("tied embeddings across pipeline stages are not supported by the runner yet")
    if c.tp > 1:
        for name, width in (("heads", m.heads), ("kv_heads", m.kv_heads), ("ffn_hidden", m.ffn_hidden)):
            if width % c.tp:
                out.append(f"tp={c.tp} does not divide {name}={width}")
    if trial.device_kind == "cpu" and t.dtype == "fp16":
        out.append("fp16 training needs a GPU; use bf16 or fp32 on CPU")
    return out


def check_runnable(trial: TrialSpec) -> None:
    reasons = refusals(trial)
    if reasons:
        raise InfeasibleError(
            f"cannot run {trial.config.label}: " + "; ".join(reasons),
            field="config", fix="choose a candidate the backends can run",
            reasons={r: 1 for r in reasons},
        )


def backend_name(trial: TrialSpec) -> str:
    c = trial.config
    parts = ["deepspeed", "pipeline" if c.pp > 1 else "engine", f"zero{c.zero_stage}"]
    if c.tp > 1:
        parts.append("megatron-tp" if c.pp > 1 else "autotp")
    if trial.training.is_lora:
        parts.append("tp-lora" if c.tp > 1 else "peft-lora")
    return "+".join(parts)
