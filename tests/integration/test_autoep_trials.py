"""Pipette's DeepSpeed runner trains a Mixture-of-Experts model with DeepSpeed's AutoEP (the ``pipette``
stack, issue 47): real Ray, real DeepSpeed, the tiny Mixtral-shaped ``tiny-moe`` on 2 gloo ranks.
Expert parallelism computes the same model as the experts kept whole on every rank (AutoEP's router
and experts against Hugging Face's Mixtral block), each rank trains the experts the memory estimate
counts, and what the runner does not build is refused before any rank starts."""

from __future__ import annotations

import pytest

from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError
from pipette.memory_moe import mlp_params
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.host.executor import run_trial
from workers.spec import TrialSpec

MODEL = ModelSpec.preset("tiny-moe")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def trial(ep: int, zero: int = 1, tp: int = 1, lora: LoraSpec | None = None) -> TrialSpec:
    training = TrainingSpec(global_batch=4, seq_len=32, dtype="fp32", method="lora" if lora else "full", lora=lora)
    config = ParallelConfig(tp=tp, pp=1, dp=2, ep=ep, mbs=2, global_batch=4, zero_stage=zero)
    return TrialSpec(MODEL, training, config, warmup_steps=2, min_steps=3, max_steps=3)


def test_expert_parallelism_trains_the_model_the_whole_experts_train() -> None:
    one, two = run_trial(trial(1), timeout_s=240), run_trial(trial(2), timeout_s=240)
    assert one.status == two.status == "ok", (one.error, two.error)
    assert one.extra["backend"] == "deepspeed+engine+zero1"
    assert two.extra["backend"] == "deepspeed+engine+zero1+autoep2"
    assert two.losses == pytest.approx(one.losses, rel=1e-4)  # AutoEP's experts are Mixtral's block's
    moe = MODEL.moe
    assert moe is not None
    whole = MODEL.total_params()
    local = mlp_params(MODEL, trial(2).config)[2]  # one MoE layer's experts on a rank, as the estimate counts
    assert one.extra["trainable_params"] == whole
    assert two.extra["trainable_params"] == whole - MODEL.layers * (2 * local - local)  # half the experts


def test_lora_on_the_attention_trains_beside_autoep_without_zero() -> None:
    adapters = LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    m = run_trial(trial(2, zero=0, lora=adapters), timeout_s=240)
    assert m.status == "ok", m.error
    assert m.extra["backend"] == "deepspeed+engine+zero0+peft-lora+autoep2"
    assert 0 < m.extra["trainable_params"] < MODEL.total_params() // 10


@pytest.mark.parametrize(("spec", "words"), [
    (trial(2, tp=2), "without tensor or pipeline parallelism"),
    (trial(2, zero=3), "ZeRO-3 with experts"),
    (trial(2, zero=0, lora=LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "gate_proj"))), "LoRA on gate_proj"),
    (trial(2, zero=1, lora=LoraSpec(rank=8, alpha=16.0, targets=("q_proj",))), "LoRA with ep=2 under ZeRO-1"),
])
def test_what_the_runner_does_not_build_is_refused_before_any_rank(spec: TrialSpec, words: str) -> None:
    with pytest.raises(InfeasibleError, match=words):
        run_trial(spec, timeout_s=5)
