"""Parameters and FLOPs per token of a model with experts (``ModelSpec.moe``) or with its own
attention shapes (``ModelSpec.attention``), counted from the matrices that are there.

Shapes are those of transformers' modeling files: ``MixtralSparseMoeBlock`` (a bias-free router
``hidden x experts`` and ``experts`` SwiGLU MLPs), ``Qwen2MoeSparseMoeBlock`` (plus one shared
expert and its ``hidden x 1`` sigmoid gate), ``Qwen3MoeAttention`` (q_norm and k_norm of
``head_dim``), ``DeepseekV2Attention``/``DeepseekV3Attention`` (MLA: q_a_proj, q_a_layernorm,
q_b_proj or q_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj) and ``DeepseekV3MoE``
(its ``e_score_correction_bias`` is a buffer, not a parameter), ``GptOssAttention`` (biases on
q, k, v and o; ``sinks``, one per head) and ``GptOssMLP`` (router with a bias; experts with
``gate_up_proj_bias`` and ``down_proj_bias``).

**Active parameters** are those one token goes through: every parameter but the experts the
router did not pick, ``(experts - top_k)`` per MoE layer. Model cards differ on the input
embedding, a table look-up and no matmul: Mistral (Mixtral: 12.9B) and Qwen (Qwen3-30B-A3B:
3.3B) count it; DeepSeek (V3: 36.6B "including 0.9B for the output Head", README_WEIGHTS.md of
DeepSeek-V3) and OpenAI (gpt-oss-120b: 5.13B) do not. ``active_params(embedding=...)`` says which.

**FLOPs per token** (forward) as ``pipette.flops`` counts them (Narayanan et al. 2021, app.):
``2 x`` the active matrices, the attention core ``2 x keys x heads x (qk_head_dim + v_head_dim)``
per layer, and the logits ``2 h V``. The terms are those of Megatron-LM's
``num_floating_point_operations`` (megatron/training/training.py: routed experts
``moe_ffn_hidden_size x moe_router_topk``, shared experts, the dense layers of DeepSeek-V2/V3,
the MLA projections) over its factor 3 for forward and backward, plus the router matmul
``2 h E`` that Megatron leaves out. ``keys`` is the sequence (counted whole, as Megatron-LM's
dense formula) or half of it (``causal``); a sliding-window layer attends to at most ``window``
keys (Beltagy et al. 2020).
"""

from __future__ import annotations

from typing import Protocol

from pipette.attention import AttentionSpec
from pipette.errors import SpecError
from pipette.moe import MoeSpec


class Shape(Protocol):
    """What these counts read of a model: a ``pipette.model.ModelSpec`` (which imports this
    module, so it is described here rather than imported)."""

    @property
    def name(self) -> str: ...
    @property
    def arch(self) -> str: ...
    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def moe(self) -> MoeSpec | None: ...
    @property
    def attention(self) -> AttentionSpec | None: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def kv_dim(self) -> int: ...
    def embedding_params(self) -> int: ...
    def head_params(self) -> int: ...


def check(model: Shape) -> None:
    """Refuse shapes a model with experts or its own attention cannot have."""
    if model.arch != "llama":
        raise SpecError(f"arch {model.arch!r} with experts or an attention spec", field="model.arch",
                        fix="MoE and attention specs describe Llama-style models (RMSNorm, SwiGLU): use arch llama")
    if model.moe is not None:
        model.moe.check_layers(model.layers)
    if model.attention is not None:
        model.attention.check_layers(model.layers)


# ---- one layer ----------------------------------------------------------------------
def attention_weights(model: Shape) -> int:
    """The matrices of one layer's attention (no biases, norms or sinks)."""
    h, heads = model.hidden, model.heads
    mla = model.attention.mla if model.attention is not None else None
    if mla is None:
        q = heads * model.head_dim
        return h * q + 2 * h * model.kv_dim + q * h  # q, k, v, o
    q = h * heads * mla.qk_head_dim if mla.q_lora_rank is None else \
        h * mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim  # q_proj, or q_a_proj and q_b_proj
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) \
        + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)  # kv_a_proj_with_mqa, kv_b_proj
    return q + kv + heads * mla.v_head_dim * h  # + o_proj


def attention_shapes(model: Shape) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one layer's attention, by transformers' module name: q, k,
    v, o of ``heads x head_dim``; MLA's q_a_proj and q_b_proj (or q_proj), kv_a_proj_with_mqa,
    kv_b_proj and o_proj (DeepseekV3Attention). Their products add up to ``attention_weights``."""
    h, heads = model.hidden, model.heads
    mla = model.attention.mla if model.attention is not None else None
    if mla is None:
        q, kv = heads * model.head_dim, model.kv_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    qk = heads * mla.qk_head_dim
    shapes = {"q_proj": (h, qk)} if mla.q_lora_rank is None else \
        {"q_a_proj": (h, mla.q_lora_rank), "q_b_proj": (mla.q_lora_rank, qk)}
    return shapes | {"kv_a_proj_with_mqa": (h, mla.kv_lora_rank + mla.qk_rope_head_dim),
                     "kv_b_proj": (mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
                     "o_proj": (heads * mla.v_head_dim, h)}


def attention_params(model: Shape) -> int:
    """One layer's attention: its matrices, biases, q/k norms, MLA's latent norms and sinks."""
    a = model.attention
    total = attention_weights(model)
    if a is None:
        return total
    q, kv = model.heads * model.head_dim, model.kv_dim
    if a.mla is not None:  # q_a_layernorm (with a q bottleneck) and kv_a_layernorm
        total += (a.mla.q_lora_rank or 0) + a.mla.kv_lora_rank
    total += (q + 2 * kv if a.qkv_bias else 0) + (model.hidden if a.o_bias else 0)
    total += 2 * model.head_dim if a.qk_norm else 0
    return total + (model.heads if a.sinks else 0)


def expert_params(model: Shape) -> int:
    """One routed expert: gate, up and down (SwiGLU), and gpt-oss's biases."""
    moe = model.moe
    if moe is None:
        return 0
    h, f = model.hidden, moe.expert_ffn
    return 3 * h * f + ((2 * f + h) if moe.expert_bias else 0)


def moe_block_params(model: Shape, *, experts: int) -> int:
    """One MoE block with ``experts`` of its routed experts: router, shared experts and gate."""
    moe = model.moe
    if moe is None:
        raise SpecError("the model has no experts", field="model.moe", fix="count a dense model with ModelSpec")
    h = model.hidden
    router = h * moe.experts + (moe.experts if moe.router_bias else 0)
    shared = 3 * h * moe.shared_ffn + (h if moe.shared_gate else 0)
    return router + shared + experts * expert_params(model)


def _dense_mlp_params(model: Shape) -> int:
    return 3 * model.hidden * model.ffn_hidden  # SwiGLU, no biases (LlamaMLP, DeepseekV3MLP, Qwen2MoeMLP)


# ---- the model ----------------------------------------------------------------------
def total_params(model: Shape) -> int:
    """Every parameter of the model (DeepSeek-V3's MTP modules apart: ``mtp_params``)."""
    norms = 2 * model.hidden  # input_layernorm and post_attention_layernorm (RMSNorm)
    attention = attention_params(model) + norms
    moe = model.moe
    if moe is None:
        layers = model.layers * (attention + _dense_mlp_params(model))
    else:
        dense = len(moe.dense_layers)
        layers = model.layers * attention + dense * _dense_mlp_params(model) \
            + moe.moe_layers(model.layers) * moe_block_params(model, experts=moe.experts)
    return layers + model.embedding_params() + model.head_params()


def active_params(model: Shape, *, embedding: bool = True) -> int:
    """The parameters one token goes through (see the module's note on ``embedding``)."""
    moe = model.moe
    idle = 0 if moe is None else moe.moe_layers(model.layers) * (moe.experts - moe.top_k) * expert_params(model)
    return total_params(model) - idle - (0 if embedding else model.vocab * model.hidden)


def mtp_params(model: Shape) -> int:
    """DeepSeek-V3's multi-token-prediction modules (Liu et al. 2024, DeepSeek-V3 report, sec. 2.2):
    each an RMSNorm of the hidden state and of the next token's embedding (``enorm``, ``hnorm``),
    the projection ``eh_proj`` (2h x h), one MoE layer, and a final norm; the embedding and the
    output head are the main model's. README_WEIGHTS.md of DeepSeek-V3: 11.5B unique parameters."""
    moe = model.moe
    if moe is None or moe.mtp_layers == 0:
        return 0
    h = model.hidden
    layer = attention_params(model) + 2 * h + moe_block_params(model, experts=moe.experts)
    return moe.mtp_layers * (3 * h + 2 * h * h + layer)


def _keys(seq_len: int, window: int | None, causal: bool) -> float:
    """Keys one query attends to, on average (whole: the square Megatron-LM counts; causal: the
    lower triangle; a window of w: at most w, and with a causal mask w - w^2 / 2s for s > w)."""
    if window is None or seq_len <= window:
        return seq_len * (0.5 if causal else 1.0)
    return window - window * window / (2.0 * seq_len) if causal else float(window)


def attention_core_flops(model: Shape, seq_len: int, *, causal: bool = False) -> float:
    """Forward FLOPs per token of every layer's attention core, ``Q K^T`` at the query-key width and
    ``P V`` at the value width, over the keys each query attends to (``_keys``)."""
    a = model.attention
    mla = a.mla if a is not None else None
    qk, v = (mla.qk_head_dim, mla.v_head_dim) if mla is not None else (model.head_dim, model.head_dim)
    core = 0.0
    for i in range(model.layers):
        window = a.window if a is not None and i in a.window_layers else None
        core += 2.0 * _keys(seq_len, window, causal) * model.heads * (qk + v)
    return core


def active_linear_weights(model: Shape) -> float:
    """The weights of every layer's matrices one token multiplies by (multiply-adds per token):
    the attention's, and the MLP's or, in an MoE layer, the router's, the shared experts' and the
    ``top_k`` routed experts' (the embedding and the head apart)."""
    moe = model.moe
    if moe is None:
        mlp = model.layers * _dense_mlp_params(model)
    else:
        routed = moe.top_k * 3 * model.hidden * moe.expert_ffn
        block = model.hidden * moe.experts + 3 * model.hidden * moe.shared_ffn + routed \
            + (model.hidden if moe.shared_gate else 0)
        mlp = len(moe.dense_layers) * _dense_mlp_params(model) + moe.moe_layers(model.layers) * block
    return float(model.layers * attention_weights(model) + mlp)


def forward_flops_per_token(model: Shape, seq_len: int, *, causal: bool = False) -> float:
    """Forward FLOPs per token, all layers and the LM head (see the module's note)."""
    return 2.0 * active_linear_weights(model) + attention_core_flops(model, seq_len, causal=causal) \
        + 2.0 * model.hidden * model.vocab


__all__ = [
    "active_linear_weights", "active_params", "attention_core_flops", "attention_params", "attention_shapes",
    "attention_weights", "check", "expert_params", "forward_flops_per_token", "moe_block_params", "mtp_params",
    "total_params",
]
