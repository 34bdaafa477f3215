"""``ModelSpec``: the shape of a decoder-only transformer, with presets.

Parameter and FLOP counts follow the matrices that are really there (q, k, v, o, the
MLP), so grouped-query attention, gated MLPs and untied embeddings are counted right.
A Mixture-of-Experts model carries its experts in ``moe`` (``pipette.moe``) and attention
shapes other than ``hidden / heads`` in ``attention`` (``pipette.attention``); both are
counted by ``pipette.moe_count`` and read from config.json by ``pipette.moe_config``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from pipette import moe_count
from pipette.attention import AttentionSpec
from pipette.errors import SpecError, UnknownPresetError
from pipette.moe import MoeSpec
from pipette.moe_config import MOE_MODEL_TYPES, attention_spec, read_moe_config
from pipette.moe_presets import MOE_CONFIGS

Arch = Literal["llama", "gpt"]
ARCHS: tuple[str, ...] = ("llama", "gpt")


#: Sanity bounds of a model's shape: well above every model published (hidden 25,600 and
#: ffn 102,400 for Megatron's 1T GPT; vocabularies of 256k; 10M positions), well below what
#: overflows the planner's arithmetic (an HF config with ``hidden_size: 1e30`` asked for
#: 5.96e52 GiB; issue 17, item 14).
MODEL_LIMITS: dict[str, int] = {
    "layers": 4096, "hidden": 1 << 18, "heads": 1 << 12, "kv_heads": 1 << 12, "ffn_hidden": 1 << 20,
    "vocab": 1 << 23, "max_seq": 1 << 24,
}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    ``arch="llama"``: RMSNorm, rotary positions, gated (SwiGLU) MLP with three matrices,
    no biases. ``arch="gpt"``: LayerNorm, learned positions, GeLU MLP with two matrices,
    biases everywhere (the Megatron-LM GPT). ``moe``: the experts (None: dense);
    ``attention``: attention shapes other than ``hidden / heads`` (None: those).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    max_seq: int
    tied_embeddings: bool = False
    arch: Arch = "llama"
    moe: MoeSpec | None = None
    attention: AttentionSpec | None = None

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(
                    f"must be a positive integer, got {value!r}",
                    field=f"model.{f}",
                    fix="give a whole number of at least 1",
                )
            if value > MODEL_LIMITS[f]:
                raise SpecError(
                    f"is {value:.3g}, beyond any model this tuner plans (at most {MODEL_LIMITS[f]:,})",
                    field=f"model.{f}", fix="check config.json: a value this large is a typo or a unit mix-up",
                )
        if self.arch not in ARCHS:
            raise SpecError(
                f"unknown architecture {self.arch!r}",
                field="model.arch",
                fix=f"use one of {', '.join(ARCHS)}",
            )
        if self.hidden % self.heads:
            raise SpecError(
                f"hidden {self.hidden} is not divisible by heads {self.heads}",
                field="model.heads",
                fix="choose heads that divide hidden",
            )
        if self.heads % self.kv_heads:
            raise SpecError(
                f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}",
                field="model.kv_heads",
                fix="kv_heads must divide heads (grouped-query attention)",
            )
        if not isinstance(self.moe, MoeSpec | None) or not isinstance(self.attention, AttentionSpec | None):
            raise SpecError("moe / attention must be a MoeSpec / AttentionSpec or None", field="model",
                            fix="build them with MoeSpec.from_dict / AttentionSpec.from_dict")
        if self.moe is not None or self.attention is not None:
            moe_count.check(self)

    # ---- shapes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.attention is None else self.attention.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the k (and of the v) projection."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.arch == "llama" else 2

    # ---- parameters ---------------------------------------------------------------
    def attention_params(self) -> int:
        h = self.hidden
        weights = h * h + 2 * h * self.kv_dim + h * h  # q, k, v, o
        biases = (h + 2 * self.kv_dim + h) if self.arch == "gpt" else 0
        return weights + biases

    def mlp_params(self) -> int:
        weights = self.mlp_matrices * self.hidden * self.ffn_hidden
        biases = (self.ffn_hidden + self.hidden) if self.arch == "gpt" else 0
        return weights + biases

    def norm_params(self) -> int:
        """Two norms per layer: RMSNorm has a scale, LayerNorm a scale and a bias."""
        per_norm = self.hidden if self.arch == "llama" else 2 * self.hidden
        return 2 * per_norm

    def layer_params(self) -> int:
        """One layer's parameters; of a model with experts, its attention and norms only (the MLP of
        each layer, routed and shared experts or a dense one, is ``pipette.memory_moe``'s: experts are
        never priced as a dense MLP)."""
        if self.moe is not None:
            return moe_count.attention_params(self) + self.norm_params()
        if self.attention is not None:
            return moe_count.attention_params(self) + self.mlp_params() + self.norm_params()
        return self.attention_params() + self.mlp_params() + self.norm_params()

    def embedding_params(self) -> int:
        """Input embedding (plus learned positions for GPT)."""
        pos = self.max_seq * self.hidden if self.arch == "gpt" else 0
        return self.vocab * self.hidden + pos

    def head_params(self) -> int:
        """Final norm plus the LM head (zero extra weights when tied)."""
        final_norm = self.hidden if self.arch == "llama" else 2 * self.hidden
        return final_norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def total_params(self) -> int:
        if self.moe is not None or self.attention is not None:
            return moe_count.total_params(self)
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear layer of one transformer layer, by module name.

        The names are the Hugging Face Llama module names, which LoRA targets use. A model with
        experts gives its attention's only (``moe_count.attention_shapes``: MLA's projections where it
        has them); its MLPs are ``pipette.memory_moe`` / ``pipette.perf_moe``'s.
        """
        if self.moe is not None or self.attention is not None:
            shapes = moe_count.attention_shapes(self)
            if self.moe is None:
                h, f = self.hidden, self.ffn_hidden
                shapes |= {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
            return shapes
        h, kv, f = self.hidden, self.kv_dim, self.ffn_hidden
        shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
        if self.arch == "llama":
            shapes |= {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
        else:
            shapes |= {"up_proj": (h, f), "down_proj": (f, h)}
        return shapes

    # ---- FLOPs --------------------------------------------------------------------
    def forward_flops_per_token(self, seq_len: int, *, causal: bool = False) -> float:
        """Forward FLOPs per token, all layers and the LM head.

        Matmuls count 2 FLOPs per multiply-add (Narayanan et al. 2021, sec. 5.1 / appendix):
        2 x (linear weights) + attention scores and context 2 x 2 x s x h per layer, plus
        the logits 2 x h x V. ``causal=True`` halves the attention term, as FlashAttention
        computes it; the Megatron-LM formula counts the full square (``causal=False``).
        """
        if self.moe is not None or self.attention is not None:
            return moe_count.forward_flops_per_token(self, seq_len, causal=causal)
        linear = sum(i * o for i, o in self.linear_shapes().values())
        attn = 4 * seq_len * self.hidden * (0.5 if causal else 1.0)
        per_layer = 2 * linear + attn
        return self.layers * per_layer + 2 * self.hidden * self.vocab

    def to_dict(self) -> dict[str, Any]:
        """The fields; ``moe`` and ``attention`` only where set (a dense model's dict, and the
        hashes of its jobs and trials, as before they existed)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NESTED}
        return out | {k: getattr(self, k).to_dict() for k in _NESTED if getattr(self, k) is not None}

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(
                f"unknown key(s) {', '.join(unknown)}",
                field="model",
                fix=f"use only {', '.join(sorted(known))}",
            )
        missing = sorted(
            f.name for f in fields(cls) if f.name not in data and f.name not in _DEFAULTED
        )
        if missing:
            raise SpecError(
                f"missing key(s) {', '.join(missing)}",
                field="model",
                fix="give every shape field, or use a preset name",
            )
        moe, attention = data.get("moe"), data.get("attention")
        return cls(**{**data, "moe": None if moe is None else MoeSpec.from_dict(moe),
                      "attention": None if attention is None else AttentionSpec.from_dict(attention)})

    @classmethod
    def gpt(
        cls,
        hidden: int,
        layers: int,
        heads: int,
        *,
        vocab: int = 51200,
        max_seq: int = 2048,
        name: str | None = None,
    ) -> ModelSpec:
        """A Megatron-LM GPT: ffn = 4h, tied embeddings, vocab padded to 51200."""
        return cls(
            name=name or f"gpt-h{hidden}-l{layers}",
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            ffn_hidden=4 * hidden,
            vocab=vocab,
            max_seq=max_seq,
            tied_embeddings=True,
            arch="gpt",
        )

    @classmethod
    def from_hf_config(cls, source: str | Path | dict[str, Any]) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a path, the folder holding it, or its parsed content).

        Understands Llama-family configs (llama, mistral, qwen2, ...: ``hidden_size``,
        ``num_hidden_layers``, ...), GPT-2 configs (``n_embd``, ``n_layer``, ...) and the
        Mixture-of-Experts families of ``pipette.moe_config`` (Mixtral, Qwen-MoE, DeepSeek, gpt-oss).
        """
        cfg, where = read_config_json(source)
        name = str(cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model")
        refuse_unsupported_architecture(cfg, where)
        if str(cfg.get("model_type", "")).lower() in MOE_MODEL_TYPES:
            return cls(**read_moe_config(cfg, name, where))
        return _dense_from_hf_config(cls, cfg, name, where)

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        try:
            return MODEL_PRESETS[name.lower()]
        except KeyError:
            raise UnknownPresetError(
                f"unknown model preset {name!r}", field="model",
                fix=preset_fix(name, "or a config.json path or a model folder"),
            ) from None


def read_config_json(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The parsed config.json (a path, the folder holding it, or its content) and where it came from."""
    if isinstance(source, dict):
        return source, "config"
    path = Path(source)
    if path.is_dir():  # a downloaded model's folder holds its config.json
        if not (path / "config.json").is_file():
            raise SpecError(f"the folder {str(path)!r} holds no config.json", field="model",
                            fix="give a preset name, a Hugging Face config.json, or the folder holding it")
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"no such file {str(path)!r}", field="model", fix="give a config.json path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read {str(path)!r} ({e})", field="model",
                        fix="give a readable Hugging Face config.json") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})", field="model",
                        fix="give a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"{path} is not a JSON object", field="model", fix="give a config.json")
    return cfg, str(path)


def _dense_from_hf_config(cls: type[ModelSpec], cfg: dict[str, Any], name: str, where: str) -> ModelSpec:
    """A dense model of a Llama-family or GPT-2 config.json."""
    try:
        if "n_embd" in cfg:  # GPT-2 style
            hidden = int(cfg["n_embd"])
            return cls(name=name, layers=int(cfg["n_layer"]), hidden=hidden, heads=int(cfg["n_head"]),
                       kv_heads=int(cfg["n_head"]), ffn_hidden=int(cfg.get("n_inner") or 4 * hidden),
                       vocab=int(cfg["vocab_size"]), max_seq=int(cfg.get("n_positions", 1024)),
                       tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), arch="gpt")
        heads, hidden, layers = int(cfg["num_attention_heads"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        dense = cls(name=name, layers=layers, hidden=hidden, heads=heads,
                    kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn_hidden=int(cfg["intermediate_size"]),
                    vocab=int(cfg["vocab_size"]), max_seq=positions(cfg),
                    tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), arch="llama")
        # the attention once the shape is checked (a bad hidden_size is named as itself, not as a head size)
        attention = dense_attention(cfg, where, hidden, heads, layers)
        return dense if attention is None else replace(dense, attention=attention)
    except KeyError as e:
        raise SpecError(f"{where} has no {e.args[0]!r}", field=f"model.{e.args[0]}",
                        fix="give a complete Hugging Face config.json of a decoder-only model") from None
    except (TypeError, ValueError) as e:
        raise SpecError(f"{where} has a value that is not a number ({e})", field="model",
                        fix="check the numeric fields of config.json") from None


def dense_attention(cfg: dict[str, Any], where: str, hidden: int, heads: int, layers: int) -> AttentionSpec | None:
    """The attention of a dense Llama-family config.json where it is not Llama's own (None where it
    is): an explicit ``head_dim`` (Qwen3-32B: 64 heads of 128 over 5,120; Mistral-Nemo), the biases
    (``Qwen2Attention``: q, k and v with a bias, o without; ``LlamaAttention`` / ``Qwen3Attention``:
    ``attention_bias`` on all four), Qwen3's RMSNorm of each query and key head, and Mistral's
    sliding window over every layer (``MistralAttention``, where ``sliding_window`` is set)."""
    family = str(cfg.get("model_type", "llama")).lower()
    bias = bool(cfg.get("attention_bias", False))
    extra: dict[str, Any] = {"qkv_bias": True} if family == "qwen2" else {"qkv_bias": bias, "o_bias": bias}
    if family == "qwen3":
        extra["qk_norm"] = True
    if family == "mistral" and cfg.get("sliding_window") is not None:
        window = int(cfg["sliding_window"])
        extra |= {"window": window, "window_layers": tuple(range(layers))} if window < positions(cfg) else {}
    return attention_spec(cfg, where, hidden, heads, layers, **extra)


def positions(cfg: dict[str, Any]) -> int:
    """The longest sequence a config.json's model takes: ``max_position_embeddings`` (4096 when
    absent), or the reach of its RoPE scaling where ``rope_scaling`` gives both the length it scales
    and the factor (``original_max_position_embeddings x factor``: Llama 3.1's ``llama3`` type, whose
    131,072 positions are already in ``max_position_embeddings``; YaRN as Qwen2.5's card adds it,
    32,768 x 4) when that is longer. A scaling without the original length (``linear``, ``dynamic``)
    extends nothing: models differ on whether ``max_position_embeddings`` counts it already."""
    base = int(cfg.get("max_position_embeddings", 4096))
    scaling = cfg.get("rope_scaling")
    if not isinstance(scaling, dict) or "original_max_position_embeddings" not in scaling:
        return base
    factor = float(scaling.get("factor") or 1.0)
    return max(base, int(int(scaling["original_max_position_embeddings"]) * factor))


#: The ``model_type`` values whose config.json this planner models as they are: dense,
#: decoder-only, one attention and one MLP per layer (Llama and GPT-2 shapes).
DENSE_MODEL_TYPES: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})

#: Keys that give a Mixture-of-Experts layer's number of experts, by model family
#: (Mixtral, Qwen-MoE, DeepSeek, DBRX, OLMoE, ...).
_EXPERT_KEYS: tuple[str, ...] = (
    "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
)


def refuse_unsupported_architecture(cfg: dict[str, Any], where: str) -> None:
    """Refuse what the planner would silently plan as something else (issue 32, item 6).

    A Mixtral config.json has Llama's keys; read as such it became a dense 7.24B model
    with none of its experts, so every estimate was wrong without a word.
    """
    what = unsupported_architecture(cfg)
    if what:
        raise SpecError(
            f"{where} describes {what}, which the planner does not model yet", field="model",
            fix="give a dense decoder-only model (model_type one of "
            f"{', '.join(sorted(DENSE_MODEL_TYPES))}), an MoE one ({', '.join(sorted(MOE_MODEL_TYPES))}) or a preset",
        )


def unsupported_architecture(cfg: dict[str, Any]) -> str | None:
    """What in ``cfg`` is not supported, in words, or None when it is a supported model."""
    experts = {k: cfg[k] for k in _EXPERT_KEYS if _is_more_than_one(cfg.get(k))}
    model_type = cfg.get("model_type")
    kind = f" ({model_type})" if isinstance(model_type, str) else ""
    hybrid = _hybrid_layers(cfg)
    if hybrid:
        return f"a hybrid model{kind} with {hybrid} layers beside attention: Mamba and linear-attention layers"
    if isinstance(model_type, str) and model_type.lower() in MOE_MODEL_TYPES:
        return None
    if experts or (isinstance(model_type, str) and "moe" in model_type.lower()):
        counts = ", ".join(f"{k} {v}" for k, v in experts.items())
        return f"a Mixture-of-Experts model{kind}{': ' + counts if counts else ''}: experts of this family"
    if cfg.get("is_encoder_decoder") is True:
        return f"an encoder-decoder model ({model_type}): only decoder-only models"
    if isinstance(model_type, str) and model_type.lower() not in DENSE_MODEL_TYPES:
        return f"model_type {model_type!r}: only Llama- and GPT-2-shaped models"
    return None


#: Keys of the state-space (Mamba) and linear-attention layers of hybrid models: Jamba
#: (``attn_layer_period``, ``mamba_d_state``), Nemotron-H (``hybrid_override_pattern``,
#: ``ssm_state_size``, ``mamba_num_heads``), Qwen3-Next (``linear_num_value_heads``).
_HYBRID_KEYS: tuple[str, ...] = ("hybrid_override_pattern", "attn_layer_period", "ssm_state_size",
                                 "linear_num_value_heads", "layers_block_type")


def _hybrid_layers(cfg: dict[str, Any]) -> str | None:
    """The kinds of non-attention layers of a hybrid model's config.json, or None."""
    types = cfg.get("layer_types")
    odd = sorted({str(t) for t in types} - {"full_attention", "sliding_attention", "attention"}) \
        if isinstance(types, list) else []
    if odd:
        return " / ".join(odd)
    keys = [k for k in cfg if k in _HYBRID_KEYS or k.startswith(("mamba_", "ssm_"))]
    return "state-space (" + ", ".join(sorted(keys)[:2]) + ")" if keys else None


def _is_more_than_one(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def closest_presets(name: str, n: int = 3) -> list[str]:
    """The presets whose names are closest to ``name`` (difflib's ratio), best first."""
    import difflib

    names = sorted(MODEL_PRESETS)
    close = difflib.get_close_matches(name.lower(), names, n=n, cutoff=0.5)
    return close or [x for x in names if x.split("-")[0] == name.lower().split("-")[0]][:n]


def preset_fix(name: str, otherwise: str) -> str:
    """A fix for an unknown preset: the closest names, and where every name is listed."""
    close = closest_presets(name)
    head = f"did you mean {', '.join(close)}? " if close else ""
    return f"{head}Give a preset ({len(MODEL_PRESETS)} of them: docs/inputs.md, Model), {otherwise}"


_DEFAULTED = {"tied_embeddings", "arch", "moe", "attention"}
_NESTED = ("moe", "attention")


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    max_seq: int,
    tied: bool = False,
) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv_heads, ffn, vocab, max_seq, tied, "llama")


def _presets() -> dict[str, ModelSpec]:
    models = [
        # Llama 2 (Touvron et al. 2023, Table 1 and the released config.json files).
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        # Llama 3 / 3.1 / 3.2 (released config.json files).
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
        _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 131072, tied=True),
        _llama("llama3.2-3b", 28, 3072, 24, 8, 8192, 128256, 131072, tied=True),
        # GPT-3 175B (Brown et al. 2020, Table 2.1), Megatron vocabulary padding.
        ModelSpec.gpt(12288, 96, 96, name="gpt3-175b"),
        # Tiny Llama-style models that train in seconds on a CPU.
        _llama("tiny-llama", 4, 128, 4, 4, 344, 512, 256),
        _llama("tiny-llama-8l", 8, 128, 4, 4, 344, 512, 256),
        _llama("tiny-llama-gqa", 4, 128, 8, 4, 344, 512, 256),
        _llama("tiny-llama-tied", 4, 128, 4, 4, 344, 512, 256, tied=True),
        ModelSpec.gpt(128, 4, 4, vocab=512, max_seq=256, name="tiny-gpt"),
    ]
    # The weak-scaling GPT shapes of Megatron-LM (Narayanan et al. 2021, Table 1).
    for params, heads, hidden, layers in [
        ("1.7b", 24, 2304, 24),
        ("3.6b", 32, 3072, 30),
        ("7.5b", 32, 4096, 36),
        ("18b", 48, 6144, 40),
        ("39b", 64, 8192, 48),
        ("76b", 80, 10240, 60),
        ("145b", 96, 12288, 80),
        ("310b", 128, 16384, 96),
        ("530b", 128, 20480, 105),
        ("1t", 160, 25600, 128),
    ]:
        models.append(ModelSpec.gpt(hidden, layers, heads, name=f"megatron-gpt-{params}"))
    # The GPT shapes of the vTrain single-node calibration set (Bang et al. 2024).
    for hidden in (1024, 2048):
        for layers in (12, 16, 20, 24):
            models.append(
                ModelSpec.gpt(hidden, layers, 16, max_seq=1024, name=f"vtrain-gpt-h{hidden}-l{layers}")
            )
    # Mixture-of-Experts models, read from their released config.json's fields (pipette.moe_presets).
    models += [ModelSpec(**read_moe_config(cfg, name, f"the {name} preset")) for name, cfg in MOE_CONFIGS.items()]
    return {m.name: m for m in models}


MODEL_PRESETS: dict[str, ModelSpec] = _presets()
