"""ModelSpec, TrainingSpec, DeviceSpec and ParallelConfig: presets, counts, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipette.config import ParallelConfig
from pipette.device import DEVICE_PRESETS, DeviceSpec
from pipette.errors import SpecError, UnknownPresetError
from pipette.model import MODEL_PRESETS, ModelSpec
from pipette.runners import builds_the_model
from pipette.training import TrainingSpec


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        # Published parameter counts (model cards / config.json of the released weights).
        ("llama2-7b", 6.74), ("llama2-13b", 13.02), ("llama2-70b", 68.98),
        ("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3.2-1b", 1.24),
        ("llama3.2-3b", 3.21), ("gpt3-175b", 174.6),
    ],
)
def test_preset_parameter_counts_match_published(name: str, billions: float) -> None:
    assert ModelSpec.preset(name).total_params() / 1e9 == pytest.approx(billions, rel=0.005)


@pytest.mark.parametrize(("name", "positions"), [
    ("llama2-7b", 4096), ("llama3-8b", 8192), ("llama3-70b", 8192),
    # Llama 3.1 / 3.2: max_position_embeddings 131072 (RoPE scaled from 8192 by the "llama3" rope_type);
    # the presets said 8192, so a 32k plan of llama3.1-8b was refused as longer than the model
    ("llama3.1-8b", 131072), ("llama3.2-1b", 131072), ("llama3.2-3b", 131072),
])
def test_preset_positions_match_the_released_config(name: str, positions: int) -> None:
    assert ModelSpec.preset(name).max_seq == positions


def test_megatron_gpt_shapes_match_the_paper_table() -> None:
    # Narayanan et al. 2021, Table 1: "number of parameters (billion)".
    for name, billions in [("megatron-gpt-1.7b", 1.7), ("megatron-gpt-39b", 39.1), ("megatron-gpt-1t", 1008)]:
        # The table rounds to two significant digits (1.65B prints as 1.7).
        assert ModelSpec.preset(name).total_params() / 1e9 == pytest.approx(billions, rel=0.03)


def test_every_preset_is_valid_and_named_by_its_key() -> None:
    assert {"llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "gpt3-175b"} <= set(MODEL_PRESETS)
    for key, spec in MODEL_PRESETS.items():
        assert spec.name == key


def test_unknown_preset_names_the_closest_ones_not_all() -> None:
    """Issue 17, item 11: the fix listed all ~30 presets in one line."""
    with pytest.raises(UnknownPresetError) as e:
        ModelSpec.preset("llama2-7")
    fix = e.value.fix or ""
    assert e.value.field == "model" and fix.startswith("did you mean llama2-7b") and len(fix) < 200, fix
    assert "docs/inputs.md, Model" in fix
    with pytest.raises(UnknownPresetError) as e:
        ModelSpec.preset("zzz")
    assert "did you mean" not in (e.value.fix or "") and "docs/inputs.md" in (e.value.fix or "")


def test_from_hf_config_reads_llama_and_gpt2(tmp_path: Path) -> None:
    llama = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    spec = ModelSpec.from_hf_config(path)
    assert spec.total_params() == ModelSpec.preset("llama3-8b").total_params()
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    assert ModelSpec.from_hf_config(gpt2).total_params() / 1e6 == pytest.approx(124.4, rel=0.01)


def test_from_hf_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="num_attention_heads"):
        ModelSpec.from_hf_config({"hidden_size": 64, "num_hidden_layers": 2})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        ModelSpec.from_hf_config(bad)
    with pytest.raises(SpecError, match="no such file"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")


def test_model_validation() -> None:
    with pytest.raises(SpecError, match="kv_heads"):
        ModelSpec("m", 2, 64, 4, 3, 128, 100, 64)
    with pytest.raises(SpecError, match="positive"):
        ModelSpec("m", 0, 64, 4, 4, 128, 100, 64)


def test_flops_per_token_matches_the_6n_rule_for_long_models() -> None:
    m = ModelSpec.preset("llama2-70b")
    # Kaplan et al. 2020: forward ~ 2N FLOPs per token (+ attention); embeddings excluded.
    non_embedding = m.total_params() - m.embedding_params()
    assert m.forward_flops_per_token(4096) / (2 * non_embedding) == pytest.approx(1.05, abs=0.05)


def test_training_spec_lora_defaults_and_errors() -> None:
    t = TrainingSpec(global_batch=8, seq_len=512, method="lora")
    assert t.lora is not None and t.lora.rank == 16
    with pytest.raises(SpecError, match="training.lora.targets"):
        TrainingSpec.from_dict({"global_batch": 8, "seq_len": 8, "method": "lora", "lora": {"targets": ["qkv"]}})
    with pytest.raises(SpecError, match="training.zero_stages"):
        TrainingSpec(global_batch=8, seq_len=8, zero_stages=(4,))
    with pytest.raises(SpecError, match="training.global_batch"):
        TrainingSpec.from_dict({"seq_len": 8})
    with pytest.raises(SpecError, match="unknown key"):
        TrainingSpec.from_dict({"global_batch": 8, "seq_len": 8, "batch": 3})


def test_device_presets() -> None:
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "v100-32gb", "t4-16gb", "cpu"):
        assert name in DEVICE_PRESETS
    assert DeviceSpec.preset("H100-80GB").peak("bf16") == 989e12
    with pytest.raises(SpecError, match="bf16"):
        DeviceSpec.preset("V100-32GB").peak("bf16")
    with pytest.raises(UnknownPresetError):
        DeviceSpec.preset("B300")


def test_parallel_config_layout_matches_megatron_order() -> None:
    c = ParallelConfig(tp=2, pp=2, dp=2, mbs=1, global_batch=8)
    assert c.world == 8 and c.grad_accum == 4
    mesh = c.layout
    assert mesh.groups("tp")[0] == [0, 1] and mesh.groups("dp")[0] == [0, 2] and mesh.groups("pp")[0] == [0, 4]
    assert all(mesh.rank(mesh.coords(r)) == r for r in range(8))
    assert c.layers_per_stage(7) == [4, 3]


def test_parallel_config_validation() -> None:
    with pytest.raises(SpecError, match="divisible"):
        ParallelConfig(tp=1, pp=1, dp=3, mbs=1, global_batch=8)
    with pytest.raises(SpecError, match="placement"):
        ParallelConfig(tp=2, pp=1, dp=1, mbs=1, global_batch=1, placement=(0, 0))
    with pytest.raises(SpecError, match="interleaved"):
        ParallelConfig(tp=1, pp=2, dp=1, mbs=1, global_batch=2, virtual_stages=2)


#: Mixtral-8x7B's released config.json (the keys the planner reads, and its experts).
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "max_position_embeddings": 32768,
}


@pytest.mark.parametrize(("cfg", "named"), [
    # Mixtral itself is read since issue 47 (tests/unit/test_moe_model.py); its experts under a
    # Llama model_type are not: the keys decide, not the name.
    ({**MIXTRAL, "model_type": "llama"}, "Mixture-of-Experts model (llama): num_local_experts 8"),
    ({**MIXTRAL, "model_type": "olmoe", "num_local_experts": 0, "num_experts": 64},
     "Mixture-of-Experts model (olmoe): num_experts 64, num_experts_per_tok 2"),
    # Mamba hybrids (issue 47): Jamba's and Nemotron-H's config.json keys.
    ({**MIXTRAL, "model_type": "jamba", "attn_layer_period": 8, "mamba_d_state": 16},
     "a hybrid model (jamba) with state-space (attn_layer_period, mamba_d_state) layers"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M-M*-", "ssm_state_size": 128},
     "a hybrid model (nemotron_h) with state-space (hybrid_override_pattern, ssm_state_size) layers"),
    ({"model_type": "t5", "is_encoder_decoder": True, "d_model": 512}, "an encoder-decoder model (t5)"),
    ({**MIXTRAL, "model_type": "gemma", "num_local_experts": 1, "num_experts_per_tok": 1}, "model_type 'gemma'"),
])
def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path: Path, cfg: dict[str, object],
                                                            named: str) -> None:
    """Issue 32, item 6: Mixtral was planned silently as a dense 7.24B model."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(SpecError) as e:
        ModelSpec.from_hf_config(path)
    line = str(e.value)
    assert named in line and "does not model yet" in line and "\n" not in line, line
    assert "fix: give a dense decoder-only model" in line


#: dense config.json files whose attention is not Llama's (the keys the planner reads), with the
#: parameters their model cards give, in billions
DENSE_ATTENTION = [
    ({"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936,
      "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False},
     32.8, "heads of 128 (not 5120 / 64 = 80), q/k norms"),  # Qwen/Qwen3-32B
    ({"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
      "max_position_embeddings": 40960, "tie_word_embeddings": True}, 0.596, "heads of 128"),  # Qwen3-0.6B
    ({"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
      "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 32768,
      "sliding_window": 131072, "use_sliding_window": False}, 7.62, "biases on q, k and v"),  # Qwen2.5-7B
    ({"model_type": "mistral", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 131072,
      "max_position_embeddings": 1024000, "sliding_window": None}, 12.25, "heads of 128"),  # Mistral-Nemo
    ({"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768,
      "sliding_window": 4096}, 7.24, "a sliding window of 4096 on 32 layers"),  # Mistral-7B-v0.1
]


@pytest.mark.parametrize(("cfg", "billions", "differs"), DENSE_ATTENTION)
def test_a_dense_model_is_read_with_its_own_attention(cfg: dict[str, object], billions: float, differs: str) -> None:
    """Qwen3-32B (64 heads of 128 over a 5,120-wide model) and Mistral-Nemo were refused ("head_dim
    other than hidden_size / num_attention_heads"), and Qwen2's q/k/v biases, Qwen3's q/k norms and
    Mistral 7B v0.1's sliding window were read as Llama's attention without a word (and trained so)."""
    model = ModelSpec.from_hf_config(cfg)
    assert model.attention is not None and differs in model.attention.differences(model.hidden, model.heads)
    assert model.total_params() / 1e9 == pytest.approx(billions, rel=0.002)
    # Pipette's runners build Llama's, Qwen2's and Qwen3's attention (workers.rank.hf_model): all but a window
    # the sequences exceed, which they refuse in one line
    assert builds_the_model(model, TrainingSpec(global_batch=8, seq_len=4096)) == []
    if model.attention.window is not None:
        refusals = builds_the_model(model, TrainingSpec(global_batch=8, seq_len=8192))
        assert len(refusals) == 1 and "a sliding window of 4096 under longer sequences" in refusals[0], refusals


def test_a_dense_config_with_moe_keys_at_one_expert_is_planned() -> None:
    """num_experts 1 (or 0) is a dense model; Mistral's head_dim equal to hidden/heads is fine."""
    dense = {**MIXTRAL, "model_type": "mistral", "num_local_experts": 1, "num_experts_per_tok": 1, "head_dim": 128}
    assert ModelSpec.from_hf_config(dense).total_params() > 7e9
