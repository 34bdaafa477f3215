"""Read the config.json of a Mixture-of-Experts model: the fields of its ``ModelSpec``, ``MoeSpec`` included.

The field names are those of transformers' configuration classes and of the released files:

* ``mixtral`` (MixtralConfig; mistralai/Mixtral-8x7B-v0.1): ``num_local_experts``,
  ``num_experts_per_tok``, ``intermediate_size`` (each expert's width), ``sliding_window``
  (all layers when set).
* ``qwen2_moe`` / ``qwen3_moe`` (Qwen2MoeConfig, Qwen3MoeConfig; Qwen/Qwen1.5-MoE-A2.7B,
  Qwen/Qwen3-30B-A3B): ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``shared_expert_intermediate_size`` (Qwen2-MoE only), ``decoder_sparse_step`` and
  ``mlp_only_layers`` (layer ``i`` is MoE when ``i not in mlp_only_layers and (i + 1) %
  decoder_sparse_step == 0``, Qwen2MoeDecoderLayer), ``head_dim``, ``qkv_bias`` (Qwen2-MoE,
  default true) or ``attention_bias`` (Qwen3-MoE), q/k norms (Qwen3).
* ``deepseek_v2`` / ``deepseek_v3`` (DeepseekV2Config, DeepseekV3Config; deepseek-ai/DeepSeek-V3):
  ``n_routed_experts``, ``n_shared_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``first_k_dense_replace`` and ``moe_layer_freq`` (layer ``i`` is MoE when ``i >=
  first_k_dense_replace and i % moe_layer_freq == 0``, modeling_deepseek.py of the released
  weights), ``scoring_func``, ``num_nextn_predict_layers`` (MTP), and MLA's ``q_lora_rank``
  (null in V2-Lite), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``.
  ``kimi_k2`` (moonshotai/Kimi-K2-Instruct) is DeepSeek-V3's architecture under its own
  ``model_type`` (its deployment guide: "Kimi-K2 reuses the DeepSeekV3CausalLM architecture").
* ``gpt_oss`` (GptOssConfig; openai/gpt-oss-120b): ``num_local_experts``,
  ``num_experts_per_tok`` (the released files also say ``experts_per_token``),
  ``intermediate_size``, ``head_dim``, ``attention_bias``, ``sliding_window`` and
  ``layer_types`` (default: even layers ``sliding_attention``, odd ``full_attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from pipette.attention import AttentionSpec, MlaSpec
from pipette.errors import SpecError
from pipette.moe import SCORINGS, MoeSpec, Scoring

#: the ``model_type`` values read here
MOE_MODEL_TYPES: frozenset[str] = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                                             "kimi_k2", "gpt_oss"})
_FIX = "give the complete config.json of the released model"


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise SpecError(f"{where} has no {key!r}", field=f"model.{key}", fix=_FIX)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise SpecError(f"{where} has {key} {value!r}, not a whole number", field=f"model.{key}", fix=_FIX)
    return int(value)


def _window(cfg: dict[str, Any], where: str, layers: int, default_types: list[str] | None) -> dict[str, Any]:
    """The sliding window and the layers that use it, from ``layer_types`` (or the family's default)."""
    types = cfg.get("layer_types") or default_types
    if types is None:
        window = cfg.get("sliding_window")
        if cfg.get("model_type") == "mixtral" and window is not None:  # MixtralAttention: every layer
            return {"window": _int(cfg, "sliding_window", where), "window_layers": tuple(range(layers))}
        if cfg.get("use_sliding_window") is True:
            raise SpecError(f"{where} sets use_sliding_window without layer_types: which layers slide is not read",
                            field="model.layer_types", fix="add layer_types (sliding_attention / full_attention)")
        return {}
    if not isinstance(types, list) or len(types) != layers:
        raise SpecError(f"{where} has layer_types of {len(types) if isinstance(types, list) else types!r} entries "
                        f"for {layers} layers", field="model.layer_types", fix="give one type per layer")
    other = sorted({str(t) for t in types} - {"sliding_attention", "full_attention"})
    if other:
        raise SpecError(f"{where} has layers of type {', '.join(other)}, which the planner does not model",
                        field="model.layer_types", fix="give a model whose layers are full or sliding-window attention")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {"window": _int(cfg, "sliding_window", where), "window_layers": sliding} if sliding else {}


def attention_spec(cfg: dict[str, Any], where: str, hidden: int, heads: int, layers: int,
                   defaults: list[str] | None = None, **extra: Any) -> AttentionSpec | None:
    """The attention spec, or None where it is Llama's (``hidden / heads`` per head, nothing else)."""
    head_dim = _int(cfg, "head_dim", where, hidden // heads)
    spec = AttentionSpec(head_dim=head_dim, **extra, **_window(cfg, where, layers, defaults))
    return None if spec == AttentionSpec(head_dim=hidden // heads) else spec


def _moe_layers_qwen(cfg: dict[str, Any], where: str, layers: int) -> tuple[int, ...]:
    step = _int(cfg, "decoder_sparse_step", where, 1)
    only = cfg.get("mlp_only_layers") or []
    if step < 1 or not isinstance(only, list):
        raise SpecError(f"{where} has decoder_sparse_step {step} / mlp_only_layers {only!r}",
                        field="model.decoder_sparse_step", fix="decoder_sparse_step >= 1, mlp_only_layers a list")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)


def _mixtral(cfg: dict[str, Any], where: str, base: dict[str, Any]) -> dict[str, Any]:
    moe = MoeSpec(experts=_int(cfg, "num_local_experts", where), top_k=_int(cfg, "num_experts_per_tok", where),
                  expert_ffn=base["ffn_hidden"])
    return {"moe": moe, "attention": attention_spec(cfg, where, base["hidden"], base["heads"], base["layers"])}


def _qwen(cfg: dict[str, Any], where: str, base: dict[str, Any]) -> dict[str, Any]:
    qwen3 = cfg.get("model_type") == "qwen3_moe"
    shared = 0 if qwen3 else _int(cfg, "shared_expert_intermediate_size", where)
    moe = MoeSpec(experts=_int(cfg, "num_experts", where), top_k=_int(cfg, "num_experts_per_tok", where),
                  expert_ffn=_int(cfg, "moe_intermediate_size", where), shared_experts=1 if shared else 0,
                  shared_ffn=shared, shared_gate=bool(shared),
                  dense_layers=_moe_layers_qwen(cfg, where, base["layers"]))
    bias = bool(cfg.get("attention_bias", False)) if qwen3 else bool(cfg.get("qkv_bias", True))
    attention = attention_spec(cfg, where, base["hidden"], base["heads"], base["layers"], qkv_bias=bias,
                           o_bias=bias and qwen3, qk_norm=qwen3)
    return {"moe": moe, "attention": attention}


def _deepseek(cfg: dict[str, Any], where: str, base: dict[str, Any]) -> dict[str, Any]:
    v3 = cfg.get("model_type") in ("deepseek_v3", "kimi_k2")
    first, freq = _int(cfg, "first_k_dense_replace", where, 0), _int(cfg, "moe_layer_freq", where, 1)
    if freq < 1 or cfg.get("attention_bias") is True:
        raise SpecError(f"{where} has moe_layer_freq {freq} / attention_bias {cfg.get('attention_bias')}",
                        field="model.moe_layer_freq", fix="moe_layer_freq >= 1; latent attention without biases")
    expert_ffn = _int(cfg, "moe_intermediate_size", where)
    shared = _int(cfg, "n_shared_experts", where, 0)
    scoring = str(cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"))
    if scoring not in SCORINGS:
        raise SpecError(f"{where} has scoring_func {scoring!r}", field="model.scoring_func",
                        fix=f"the routers modelled score with {' or '.join(SCORINGS)}")
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"  # V2's "greedy" ignores n_group
    groups = _int(cfg, "n_group", where, 1) if grouped else 1
    moe = MoeSpec(experts=_int(cfg, "n_routed_experts", where), top_k=_int(cfg, "num_experts_per_tok", where),
                  expert_ffn=expert_ffn, shared_experts=shared, shared_ffn=shared * expert_ffn,
                  scoring=cast(Scoring, scoring),
                  groups=groups, group_top_k=_int(cfg, "topk_group", where, 1) if grouped else 1,
                  dense_layers=tuple(i for i in range(base["layers"]) if i < first or i % freq != 0),
                  mtp_layers=_int(cfg, "num_nextn_predict_layers", where, 0))
    q_rank = cfg.get("q_lora_rank")
    mla = MlaSpec(q_lora_rank=None if q_rank is None else _int(cfg, "q_lora_rank", where),
                  kv_lora_rank=_int(cfg, "kv_lora_rank", where), qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", where),
                  qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where), v_head_dim=_int(cfg, "v_head_dim", where))
    return {"moe": moe, "attention": AttentionSpec(head_dim=mla.qk_head_dim, mla=mla)}


def _gpt_oss(cfg: dict[str, Any], where: str, base: dict[str, Any]) -> dict[str, Any]:
    top_k = _int(cfg, "num_experts_per_tok", where, cfg.get("experts_per_token"))
    moe = MoeSpec(experts=_int(cfg, "num_local_experts", where), top_k=top_k, expert_ffn=base["ffn_hidden"],
                  router_bias=True, expert_bias=True)
    bias = bool(cfg.get("attention_bias", True))
    alternate = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(base["layers"])]
    attention = attention_spec(cfg, where, base["hidden"], base["heads"], base["layers"], alternate, qkv_bias=bias,
                           o_bias=bias, sinks=True)
    return {"moe": moe, "attention": attention}


_FAMILIES: dict[str, Callable[[dict[str, Any], str, dict[str, Any]], dict[str, Any]]] = {
    "mixtral": _mixtral, "qwen2_moe": _qwen, "qwen3_moe": _qwen, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
    "kimi_k2": _deepseek,
    "gpt_oss": _gpt_oss,
}


def read_moe_config(cfg: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of an MoE config.json whose ``model_type`` is one of ``MOE_MODEL_TYPES``."""
    layers, heads = _int(cfg, "num_hidden_layers", where), _int(cfg, "num_attention_heads", where)
    base: dict[str, Any] = {
        "name": name, "layers": layers, "hidden": _int(cfg, "hidden_size", where), "heads": heads,
        "kv_heads": _int(cfg, "num_key_value_heads", where, heads), "ffn_hidden": _int(cfg, "intermediate_size", where),
        "vocab": _int(cfg, "vocab_size", where), "max_seq": _int(cfg, "max_position_embeddings", where, 4096),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", False)), "arch": "llama",
    }
    return base | _FAMILIES[str(cfg["model_type"])](cfg, where, base)


__all__ = ["MOE_MODEL_TYPES", "attention_spec", "read_moe_config"]
