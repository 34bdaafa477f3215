"""The runner's model builder with MoE (``workers.rank.fsdp_model.meta_model(..., moe=...)``): dense
without it, every layer's MLP an MoE feed-forward with it, its values drawn by parameter name
(``workers.rank.init``) as every other parameter's, PEFT's LoRA reaching the experts, and the
stage training on the CPU. One process; the expert-parallel stage is compared with this one in
``tests/fsdp/test_expert_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.rank.fsdp_model import build_stages, lm_loss, materialize, meta_model, parameter_names
from workers.rank.init import init_for, initial_values
from workers.rank.moe_layer import MoeFeedForward, MoeOptions

#: the first build imports transformers (~10 s of the 2-core VM's CPU)
pytestmark = pytest.mark.slow

MODEL = ModelSpec(name="tiny-moe", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=128,
                  max_seq=16, tied_embeddings=False, arch="llama")
SEQ = 16
MOE = MoeOptions(experts=4, top_k=2, expert_hidden=24, shared_hidden=16)


def _training(lora: bool = False) -> TrainingSpec:
    spec = LoraSpec(rank=4, alpha=8, targets=("q_proj", "gate_proj", "down_proj")) if lora else None
    return TrainingSpec(global_batch=2, seq_len=SEQ, dtype="fp32", method="lora" if lora else "full",
                        lora=spec)


def test_without_moe_the_model_stays_dense() -> None:
    names = {p.pipette_name for p in meta_model(MODEL, _training()).hf.parameters()}
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(".experts." in n or "mlp.gate.weight" in n for n in names)


def test_each_layer_gets_all_experts_named_by_their_global_index() -> None:
    hf = meta_model(MODEL, _training(), moe=MOE).hf
    for layer in hf.model.layers:
        assert isinstance(layer.mlp, MoeFeedForward) and sorted(layer.mlp.experts) == ["0", "1", "2", "3"]
    names = {p.pipette_name: tuple(p.pipette_full_shape) for p in hf.parameters()}
    assert names["model.layers.1.mlp.gate.weight"] == (4, 32)
    assert names["model.layers.1.mlp.experts.3.down_proj.weight"] == (32, 24)
    assert names["model.layers.0.mlp.shared_expert.up_proj.weight"] == (16, 32)
    assert all(p.device.type == "meta" for p in hf.parameters())


def test_lora_reaches_the_experts() -> None:
    hf = meta_model(MODEL, _training(lora=True), moe=MOE).hf
    trainable = {n for n, p in hf.named_parameters() if p.requires_grad}
    assert "model.layers.0.mlp.experts.2.gate_proj.lora_A.default.weight" in trainable
    assert "model.layers.0.mlp.shared_expert.down_proj.lora_B.default.weight" in trainable
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in trainable
    assert not any(n.endswith("mlp.gate.weight") for n in trainable)  # the router is frozen, as the base


def test_the_moe_stage_materializes_by_name_and_trains() -> None:
    meta = meta_model(MODEL, _training(), moe=MOE)
    (stage,) = build_stages(meta, [0], 1, SEQ)
    names = parameter_names(stage)
    cpu = torch.device("cpu")
    materialize(stage, names, cpu, cpu, seed=3, std=meta.std)
    router = stage.get_parameter("layers.1.mlp.gate.weight")
    name = "model.layers.1.mlp.gate.weight"
    torch.testing.assert_close(router, initial_values(name, (4, 32), init_for(name, (4, 32), meta.std), 3))
    tokens = torch.randint(0, MODEL.vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits = stage(tokens)
    assert logits.shape == (2, SEQ, MODEL.vocab) and torch.isfinite(logits).all()
    lm_loss(logits[:, :-1], tokens[:, 1:]).backward()  # type: ignore[no-untyped-call]  # unannotated in torch 2.13
    for key, p in stage.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), key
    assert router.grad is not None and router.grad.abs().max() > 0
