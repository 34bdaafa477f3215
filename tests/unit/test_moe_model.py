"""Mixture-of-Experts models (issue 47, Model): config.json of each family read, presets, total
and active parameters against the model cards, FLOPs per token against Megatron-LM's formula,
bad inputs refused in one line, and planning refused in one line until expert parallelism is
planned."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipette import moe_count
from pipette.attention import AttentionSpec, MlaSpec
from pipette.clusterfile import homogeneous_cluster
from pipette.errors import SpecError
from pipette.model import MODEL_PRESETS, ModelSpec
from pipette.moe import MoeSpec
from pipette.plan import check_recipe, make_plan
from pipette.training import TrainingSpec

# ---- config.json of each family, as released (shape keys and a few others a file has) --------
#: mistralai/Mixtral-8x7B-v0.1/config.json
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}
#: Qwen/Qwen3-30B-A3B/config.json
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
#: Qwen/Qwen2-57B-A14B/config.json (Qwen2-MoE: a shared expert and its gate, q/k/v biases)
QWEN2_57B_A14B = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2_moe",
    "moe_intermediate_size": 2560, "norm_topk_prob": False, "num_attention_heads": 28, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
    "shared_expert_intermediate_size": 20480, "sliding_window": 131072, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}
#: deepseek-ai/DeepSeek-V3/config.json
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
    "vocab_size": 129280,
}
#: deepseek-ai/DeepSeek-V2-Lite/config.json (no q bottleneck: q_lora_rank null)
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 1,
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
}
#: openai/gpt-oss-120b/config.json (its layer_types, alternating, as the file lists them)
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128, "rms_norm_eps": 1e-05,
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}


@pytest.mark.parametrize(("cfg", "preset"), [
    (MIXTRAL_8X7B, "mixtral-8x7b"), (QWEN3_30B_A3B, "qwen3-30b-a3b"), (QWEN2_57B_A14B, "qwen2-57b-a14b"),
    (DEEPSEEK_V3, "deepseek-v3"), (DEEPSEEK_V2_LITE, "deepseek-v2-lite"), (GPT_OSS_120B, "gpt-oss-120b"),
])
def test_each_family_s_config_json_is_read_as_its_preset(tmp_path: Path, cfg: dict[str, Any], preset: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert replace(ModelSpec.from_hf_config(path), name=preset) == MODEL_PRESETS[preset]
    assert ModelSpec.from_hf_config(tmp_path).moe == MODEL_PRESETS[preset].moe  # the folder holding it


def test_what_is_read_of_each_family() -> None:
    mixtral, qwen3, qwen2 = (MODEL_PRESETS[n] for n in ("mixtral-8x7b", "qwen3-30b-a3b", "qwen2-57b-a14b"))
    assert mixtral.moe == MoeSpec(experts=8, top_k=2, expert_ffn=14336) and mixtral.attention is None
    assert qwen3.moe == MoeSpec(experts=128, top_k=8, expert_ffn=768)
    assert qwen3.attention == AttentionSpec(head_dim=128, qk_norm=True) and qwen3.kv_dim == 512
    assert qwen2.moe == MoeSpec(experts=64, top_k=8, expert_ffn=2560, shared_experts=1, shared_ffn=20480,
                                shared_gate=True)
    assert qwen2.attention == AttentionSpec(head_dim=128, qkv_bias=True)
    v3, lite, oss = (MODEL_PRESETS[n] for n in ("deepseek-v3", "deepseek-v2-lite", "gpt-oss-120b"))
    assert v3.moe == MoeSpec(experts=256, top_k=8, expert_ffn=2048, shared_experts=1, shared_ffn=2048,
                             dense_layers=(0, 1, 2), scoring="sigmoid", groups=8, group_top_k=4, mtp_layers=1)
    assert v3.attention is not None and v3.attention.mla == MlaSpec(1536, 512, 128, 64, 128)
    assert lite.moe is not None and lite.moe.dense_layers == (0,) and lite.moe.shared_ffn == 2 * 1408
    assert lite.attention is not None and lite.attention.mla == MlaSpec(None, 512, 128, 64, 128)
    assert oss.moe == MoeSpec(experts=128, top_k=4, expert_ffn=2880, router_bias=True, expert_bias=True)
    assert oss.attention == AttentionSpec(head_dim=64, qkv_bias=True, o_bias=True, sinks=True, window=128,
                                          window_layers=tuple(range(0, 36, 2)))


def test_kimi_k2_is_read_as_deepseek_v3_s_architecture() -> None:
    """moonshotai/Kimi-K2-Instruct/config.json: model_type kimi_k2, DeepseekV3ForCausalLM's fields."""
    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840,
            "num_nextn_predict_layers": 0, "routed_scaling_factor": 2.827, "max_position_embeddings": 131072}
    model = ModelSpec.from_hf_config(kimi)
    assert model == replace(ModelSpec.from_hf_config({**kimi, "model_type": "deepseek_v3"}), name="kimi_k2")
    assert model.moe is not None and model.moe.experts == 384 and model.moe.dense_layers == (0,)
    # its card: "1T total parameters, 32B activated"
    assert 1.0e12 <= model.total_params() < 1.1e12 and 32e9 <= moe_count.active_params(model) < 33e9


def test_which_layers_are_dense_follows_each_family_s_rule() -> None:
    # Qwen2MoeDecoderLayer: MoE when i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    qwen = ModelSpec.from_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                     "mlp_only_layers": [3]})
    assert qwen.moe is not None and qwen.moe.dense_layers == (0, 2, 3, 4)
    # modeling_deepseek.py: MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
    ds = ModelSpec.from_hf_config({**DEEPSEEK_V3, "num_hidden_layers": 8, "moe_layer_freq": 2})
    assert ds.moe is not None and ds.moe.dense_layers == (0, 1, 2, 3, 5, 7)
    # gpt-oss without layer_types: GptOssConfig's default, even layers slide
    oss = ModelSpec.from_hf_config({k: v for k, v in GPT_OSS_120B.items() if k != "layer_types"})
    assert oss == ModelSpec.from_hf_config(GPT_OSS_120B)


# ---- parameters against the model cards -------------------------------------------------------
#: (preset, total B, active B, whether the card counts the input embedding as active).
#: Cards: see pipette/moe_presets.py. DeepSeek-V3: README_WEIGHTS.md's 36.6B (its card rounds it to 37B).
CARDS = [
    ("mixtral-8x7b", 46.7, 12.9, True), ("mixtral-8x22b", 141.0, 39.0, True),
    ("qwen3-235b-a22b", 235.0, 22.0, True), ("deepseek-v3", 671.0, 36.6, False),
    ("gpt-oss-120b", 116.83, 5.13, False), ("gpt-oss-20b", 20.91, 3.61, False), ("qwen1.5-moe-a2.7b", 14.3, 2.7, True),
]


@pytest.mark.parametrize(("preset", "total", "active", "embedding"), CARDS)
def test_total_and_active_parameters_are_within_1_percent_of_the_card(preset: str, total: float, active: float,
                                                                      embedding: bool) -> None:
    model = MODEL_PRESETS[preset]
    assert model.total_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert moe_count.active_params(model, embedding=embedding) / 1e9 == pytest.approx(active, rel=0.01)


@pytest.mark.parametrize(("preset", "total", "active"), [
    # These cards print the active count to two digits, further off than 1%: Qwen3-30B-A3B "30.5B in
    # total and 3.3B activated" (and "29.9B non-embedding"; the count: 3.353B, +1.6%), DeepSeek-V3
    # 671B / 37B (36.63B, -1.0%), DeepSeek-V2-Lite 15.7B / 2.4B (2.451B, +2.1%), Qwen2-57B-A14B
    # 57B / 14B (14.25B, +1.8%). The count is within one unit of the card's last printed digit.
    ("qwen3-30b-a3b", 30.5, 3.3), ("deepseek-v3", 671.0, 37.0), ("deepseek-v2-lite", 15.7, 2.4),
    ("qwen2-57b-a14b", 57.0, 14.0),
])
def test_cards_printed_to_two_digits_hold_the_count_within_their_last_digit(preset: str, total: float,
                                                                            active: float) -> None:
    model = MODEL_PRESETS[preset]
    embedding = not preset.startswith("deepseek")
    unit = 0.1 if active < 10 else 1.0
    assert model.total_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert abs(moe_count.active_params(model, embedding=embedding) / 1e9 - active) < unit


def test_qwen3_30b_non_embedding_count_matches_its_card() -> None:
    model = MODEL_PRESETS["qwen3-30b-a3b"]
    non_embedding = model.total_params() - 2 * model.vocab * model.hidden  # "29.9B" (embedding and LM head out)
    assert non_embedding / 1e9 == pytest.approx(29.9, rel=0.005)


def test_deepseek_v3_counts_671b_without_its_mtp_module() -> None:
    """README_WEIGHTS.md of DeepSeek-V3: main model 671B; the MTP module 11.5B unique parameters
    (the 685B of the checkpoint holds both). total_params is the main model's."""
    model = MODEL_PRESETS["deepseek-v3"]
    assert model.total_params() / 1e9 == pytest.approx(671.0, rel=0.001)
    assert moe_count.mtp_params(model) / 1e9 == pytest.approx(11.5, rel=0.015)
    assert moe_count.mtp_params(MODEL_PRESETS["mixtral-8x7b"]) == 0


def test_experts_are_most_of_an_moe_model_and_the_rest_is_counted_once() -> None:
    model = MODEL_PRESETS["mixtral-8x7b"]
    moe = model.moe
    assert moe is not None
    experts = model.layers * moe.experts * moe_count.expert_params(model)
    assert experts == 32 * 8 * 3 * 4096 * 14336
    # the rest of Mixtral is a Mistral-7B without its MLP, plus the routers
    dense = ModelSpec("m", 32, 4096, 32, 8, 14336, 32000, 32768)
    assert model.total_params() - experts == dense.total_params() - 32 * dense.mlp_params() + 32 * 4096 * 8


# ---- FLOPs per token --------------------------------------------------------------------------
def _megatron_flops_per_token(model: ModelSpec, s: int) -> float:
    """megatron/training/training.py, num_floating_point_operations / transformer_flops, per token
    (batch 1, seq_length s), for an MoE model with SwiGLU, written as that function writes it."""
    moe, a, h = model.moe, model.attention, model.hidden
    assert moe is not None and a is not None
    dense, moe_layers = len(moe.dense_layers), moe.moe_layers(model.layers)
    mlp = 3 * 2 * h * (model.ffn_hidden * 3 * dense + moe.expert_ffn * moe.top_k * 3 * moe_layers
                       + moe.shared_ffn * 3 * moe_layers)
    heads, mla = model.heads, a.mla
    if mla is not None:
        nope, rope, v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        assert mla.q_lora_rank is not None
        q_term = mla.q_lora_rank * (h + heads * (nope + rope) + 1)
        attn = 3 * 2 * (q_term + mla.kv_lora_rank * (h + heads * (nope + v) + 1) + h * rope + heads * v * h
                        + s * heads * (nope + rope) / 2 + s * heads * v / 2)
    else:
        q, kv = a.head_dim * heads, a.head_dim * model.kv_heads
        attn = 3 * 2 * (h * (q + kv + kv) + q * s / 2 * 2 + q * h)
    return mlp + attn * model.layers + 3 * 2 * h * model.vocab


@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_forward_flops_are_megatron_s_over_three_plus_the_router(preset: str) -> None:
    """Megatron-LM counts forward, weight and data gradient (x3); it leaves out the router matmul
    (2 h E per MoE layer) and counts MLA's two latent norms as a FLOP per element (the + 1 terms)."""
    model, s = MODEL_PRESETS[preset], 4096
    moe, a = model.moe, model.attention
    assert moe is not None and a is not None
    router = 2 * model.hidden * moe.experts * moe.moe_layers(model.layers)
    norms = 2 * ((a.mla.q_lora_rank or 0) + a.mla.kv_lora_rank) * model.layers if a.mla else 0
    ours = model.forward_flops_per_token(s, causal=True)
    assert ours == pytest.approx(_megatron_flops_per_token(model, s) / 3 - norms + router, rel=1e-12)


def test_flops_are_twice_the_active_matrices_plus_attention() -> None:
    """Kaplan et al. 2020's C_forward = 2 N + 2 n_layer n_ctx d_attn, with N the active
    non-embedding parameters: here every matrix a token goes through, and the LM head."""
    model = MODEL_PRESETS["mixtral-8x7b"]
    matrices = moe_count.active_params(model, embedding=False) - (2 * 32 + 1) * 4096  # less the RMSNorms
    attention = 2 * 32 * 1024 * 4096 * 2  # keys x (q.k and p.v) x hidden, whole
    assert model.forward_flops_per_token(1024) == pytest.approx(2 * matrices + attention, rel=1e-12)


def test_sliding_window_layers_attend_to_at_most_the_window() -> None:
    oss = MODEL_PRESETS["gpt-oss-120b"]
    full = replace(oss, attention=replace(oss.attention, window=None, window_layers=())) if oss.attention else oss
    short, long = 128, 8192
    assert oss.forward_flops_per_token(short) == full.forward_flops_per_token(short)  # within the window
    saved = full.forward_flops_per_token(long, causal=True) - oss.forward_flops_per_token(long, causal=True)
    keys = long / 2 - (128 - 128 * 128 / (2 * long))  # causal: s/2 against w - w^2/2s, per query
    assert saved == pytest.approx(18 * 2 * keys * 64 * (64 + 64), rel=1e-12)


# ---- bad inputs -------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "field", "words"), [
    ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "model.moe.top_k", "top_k 9 is more than the 8 experts"),
    ({**MIXTRAL_8X7B, "num_local_experts": None}, "model.num_local_experts", "has no 'num_local_experts'"),
    ({k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"}, "model.moe_intermediate_size",
     "has no 'moe_intermediate_size'"),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}, "model.kv_lora_rank", "has no 'kv_lora_rank'"),
    ({**DEEPSEEK_V3, "n_routed_experts": 1}, "model.moe.experts", "at least 2"),
    ({**DEEPSEEK_V3, "first_k_dense_replace": 61}, "model.moe.dense_layers", "no MoE layer"),
    ({**DEEPSEEK_V3, "n_group": 7}, "model.moe.groups", "7 groups"),
    ({**DEEPSEEK_V3, "scoring_func": "sparsemixer"}, "model.scoring_func", "'sparsemixer'"),
    ({**DEEPSEEK_V3, "qk_rope_head_dim": "64"}, "model.qk_rope_head_dim", "not a whole number"),
    ({**QWEN2_57B_A14B, "use_sliding_window": True}, "model.layer_types", "use_sliding_window without layer_types"),
    ({**GPT_OSS_120B, "layer_types": ["linear_attention"] * 36}, "model",
     "a hybrid model (gpt_oss) with linear_attention layers"),
    ({**GPT_OSS_120B, "layer_types": ["full_attention"] * 35}, "model.layer_types", "35 entries for 36 layers"),
])
def test_a_bad_moe_config_is_refused_in_one_line(cfg: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as e:
        ModelSpec.from_hf_config(cfg)
    assert e.value.field == field and words in str(e.value) and e.value.fix, str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("fields", "field"), [
    ({"experts": 8, "top_k": 0, "expert_ffn": 64}, "model.moe.top_k"),
    ({"experts": 8, "top_k": 2, "expert_ffn": 64, "shared_experts": 1}, "model.moe.shared_ffn"),
    ({"experts": 8, "top_k": 2, "expert_ffn": 64, "capacity_factor": -1.0}, "model.moe.capacity_factor"),
    ({"experts": 8, "top_k": 2, "expert_ffn": 64, "dense_layers": (2, 1)}, "model.moe.dense_layers"),
    ({"experts": 8, "top_k": 2, "expert_ffn": 64, "scoring": "relu"}, "model.moe.scoring"),
    ({"experts": 8, "top_k": 2, "expert_ffn": True}, "model.moe.expert_ffn"),
    ({"experts": 8, "top_k": 2, "expert_ffn": 10**30}, "model.moe.expert_ffn"),
    ({"experts": 10**6, "top_k": 2, "expert_ffn": 64}, "model.moe.experts"),
])
def test_a_bad_moe_spec_is_refused(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as e:
        MoeSpec(**fields)
    assert e.value.field == field


def test_model_spec_dicts_with_moe_are_checked_and_round_trip() -> None:
    for name in ("deepseek-v3", "gpt-oss-20b", "qwen1.5-moe-a2.7b"):
        model = MODEL_PRESETS[name]
        assert ModelSpec.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    data = MODEL_PRESETS["mixtral-8x7b"].to_dict()
    for bad, field in [({**data, "moe": {"experts": 8}}, "model.moe"),
                       ({**data, "moe": {**data["moe"], "dense_layers": [40]}}, "model.moe.dense_layers"),
                       ({**data, "moe": {**data["moe"], "top_k": 2, "experts_per_token": 2}}, "model.moe"),
                       ({**data, "arch": "gpt"}, "model.arch"),
                       ({**data, "attention": {"head_dim": 128, "mla": {"kv_lora_rank": 512}}}, "model.attention.mla")]:
        with pytest.raises(SpecError) as e:
            ModelSpec.from_dict(bad)
        assert e.value.field == field, (bad, e.value)


def test_a_dense_model_is_as_it_was() -> None:
    """No moe or attention key in a dense model's dict: the hashes of its jobs and trials stay."""
    llama = MODEL_PRESETS["llama3-8b"]
    assert list(llama.to_dict()) == ["name", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq",
                                     "tied_embeddings", "arch"]
    assert llama.moe is None and llama.attention is None and llama.head_dim == 128
    assert ModelSpec.from_dict(llama.to_dict()) == llama


# ---- planning: with the experts (issue 47) ------------------------------------------------------
def test_an_moe_model_is_planned_with_its_experts_not_as_dense() -> None:
    """Issue 47: the refusal lifted. Pipette's own DeepSpeed runner trains Mixtral under AutoEP and
    refuses, in one line, experts of a family it does not build (DeepSeek's latent attention); the
    planner's dense path sees only the attention (the experts are pipette.memory_moe / perf_moe's)."""
    model = ModelSpec.from_hf_config(MIXTRAL_8X7B)  # reading it is fine
    assert model.total_params() / 1e9 == pytest.approx(46.7, rel=0.01)
    training = TrainingSpec(global_batch=64, seq_len=4096)
    cluster = homogeneous_cluster("H100-80GB", 2, 8, 300e9, 25e9)
    check_recipe(model, training)
    plan = make_plan(model, training, cluster)  # the default stack: Pipette's DeepSpeed runner
    assert {(p.config.tp, p.config.pp) for p in plan.ranked} == {(1, 1)} and max(p.config.ep for p in plan.ranked) > 1
    with pytest.raises(SpecError) as e:
        make_plan(ModelSpec.preset("deepseek-v2-lite"), training, cluster)
    line = str(e.value)
    assert "is a Mixture-of-Experts model; the pipette stack's DeepSpeed runner builds the experts of" in line, line
    assert "\n" not in line and e.value.field == "stack" and e.value.fix
    assert set(model.linear_shapes()) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert model.layer_params() == moe_count.attention_params(model) + model.norm_params()


