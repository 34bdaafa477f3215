"""Real trials of a model whose attention is not Llama's (a tiny Qwen3: heads of 64 over a 128-wide
model, q/k RMSNorms) on both of Pipette's runners.

Until 2026-12-05 a Qwen3 or Qwen2 config.json was read as Llama's attention and its trials trained a
Llama of its shapes; read as it is, the runners build the family's own model
(``workers.rank.hf_model.llama_config``: Qwen3's, Qwen2's, or Llama's with a head size and biases),
through the data-parallel and pipeline paths, and the fsdp runner's tensor parallelism (Qwen3's q/k norms
over each rank's heads, ``workers.rank.fsdp_parallel.QK_NORMS``) and ring attention
(``workers.rank.context_parallel.attention_classes``); DeepSpeed's AutoTP shards Llama's attention only,
and refuses it (``pipette.runners``)."""

from __future__ import annotations

import math

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.host.executor import run_trial
from workers.spec import TrialSpec
from workers.support import refusals

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QWEN3 = ModelSpec.from_hf_config({
    "model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256, "vocab_size": 512,
    "max_position_embeddings": 256, "tie_word_embeddings": False, "_name_or_path": "tiny-qwen3"})
CASES = {
    "pipette-dp2-zero3-full": ("pipette", {"dp": 2, "zero_stage": 3}, "full", "deepspeed+engine+zero3"),
    "pipette-pp2-zero1-lora": ("pipette", {"pp": 2, "zero_stage": 1}, "lora", "deepspeed+pipeline+zero1+peft-lora"),
    "fsdp-dp2-full-shard-full": ("fsdp", {"dp": 2, "zero_stage": 3}, "full", "fsdp2-full-shard"),
    "fsdp-pp2-lora": ("fsdp", {"pp": 2, "zero_stage": 0}, "lora", "torch+pp-1f1b+peft-lora"),
    "fsdp-tp2-full": ("fsdp", {"tp": 2, "dp": 2, "zero_stage": 3}, "full", "fsdp2-full-shard+tp-sp"),
    "fsdp-cp2-full": ("fsdp", {"cp": 2, "zero_stage": 3}, "full", "fsdp2-full-shard+cp2-ring"),
}


def spec(stack: str, degrees: dict[str, int], method: str, **config: object) -> TrialSpec:
    training = TrainingSpec(global_batch=4, seq_len=32, dtype="fp32", method=method)  # type: ignore[arg-type]
    cfg = ParallelConfig(**({"tp": 1, "pp": 1, "dp": 1, "mbs": 1, "global_batch": 4} | degrees | config))  # type: ignore[arg-type]
    return TrialSpec(QWEN3, training, cfg, warmup_steps=2, min_steps=3, max_steps=3, stack=stack)


def test_the_model_is_qwen3s() -> None:
    assert QWEN3.attention is not None and QWEN3.attention.qk_norm and QWEN3.attention.head_dim == 64
    llama_shaped = ModelSpec(**{**QWEN3.to_dict(), "attention": None})  # type: ignore[arg-type]
    # per layer: q and o 256 wide (not 128), k and v 2 heads of 64 (not of 32), the two norms over a head
    assert QWEN3.total_params() - llama_shaped.total_params() == 4 * (2 * 128 * 128 + 2 * 128 * 64 + 2 * 64)


@pytest.mark.parametrize("name", list(CASES))
def test_a_qwen3_trial_trains_its_own_attention(name: str) -> None:
    stack, degrees, method, backend = CASES[name]
    trial = spec(stack, degrees, method)
    assert refusals(trial) == []
    m = run_trial(trial, timeout_s=240)
    assert m.status == "ok", m.error
    assert m.extra["backend"] == backend
    assert len(m.step_times) == 3 and all(t > 0 for t in m.step_times)
    assert all(math.isfinite(x) for x in m.losses) and m.losses[0] > math.log(QWEN3.vocab) - 0.5
    if method == "full" and trial.config.pp == 1:  # every parameter of Qwen3's layers, q/k norms included
        assert m.extra["trainable_params"] == QWEN3.total_params()


def test_deepspeeds_tensor_parallelism_is_refused_before_any_process() -> None:
    said = refusals(spec("pipette", {"tp": 2}, "full"))
    assert any("tensor parallelism shards Llama's" in r for r in said), said
