"""``AttentionSpec``: attention shapes other than ``hidden / heads`` per head, with their extras.

The dense ``ModelSpec`` derives its attention from ``hidden``, ``heads`` and ``kv_heads``.
The MoE families read by ``pipette.moe_config`` need more:

* an explicit ``head_dim`` (Qwen3-MoE: 128 with hidden 2048 and 32 heads; gpt-oss: 64 with
  hidden 2880 and 64 heads), so q is ``hidden x heads*head_dim``, not square;
* biases on q, k, v (Qwen2-MoE's ``qkv_bias``) and on o too (gpt-oss's ``attention_bias``);
* RMSNorm of q and k per head (Qwen3's ``q_norm``/``k_norm``, ``head_dim`` weights each);
* attention sinks (gpt-oss: one learned logit per head and layer, ``self.sinks``);
* a sliding window on some layers (gpt-oss: ``layer_types`` alternating ``sliding_attention``
  with window ``sliding_window`` = 128 and ``full_attention``);
* multi-head latent attention, ``MlaSpec`` (DeepSeek-V2, sec. 2.1; DeepSeek-V3).

The parameter shapes are those of transformers' ``modeling_*.py`` of each family (cited where
counted, in ``pipette.moe_count``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pipette.errors import SpecError


def is_layer_list(layers: object) -> bool:
    """Whether ``layers`` is a tuple of increasing layer indices from 0."""
    return isinstance(layers, tuple) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                             for i in layers) and list(layers) == sorted(set(layers))


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, sec. 2.1.2-2.1.3).

    Queries through a rank-``q_lora_rank`` bottleneck (None: one ``hidden x heads*(nope+rope)``
    matrix, as DeepSeek-V2-Lite); keys and values from one ``kv_lora_rank`` latent, plus one
    shared rotary key of ``qk_rope_head_dim``; each head's query and key are
    ``qk_nope_head_dim + qk_rope_head_dim`` wide, its value ``v_head_dim``.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if value is None and name == "q_lora_rank":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > 1 << 16:
                raise SpecError(f"must be a whole number from 1 to {1 << 16:,}, got {value!r}",
                                field=f"model.attention.mla.{name}", fix="check the MLA fields of config.json")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class AttentionSpec:
    """The attention of one layer, the same in every layer but for the sliding window."""

    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False
    #: the window of the sliding-window layers (None: every layer attends to the whole sequence)
    window: int | None = None
    #: which layers slide (indices from 0); the others attend to the whole sequence
    window_layers: tuple[int, ...] = ()
    mla: MlaSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or not 1 <= self.head_dim <= 1 << 12:
            raise SpecError(f"must be a whole number from 1 to 4,096, got {self.head_dim!r}",
                            field="model.attention.head_dim", fix="check head_dim in config.json")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise SpecError(f"must be a positive whole number or None, got {self.window!r}",
                            field="model.attention.window", fix="check sliding_window in config.json")
        layers = self.window_layers
        if not is_layer_list(layers):
            raise SpecError(f"must be increasing layer indices from 0, got {layers!r}",
                            field="model.attention.window_layers", fix="list each sliding layer once, in order")
        if self.mla is not None and (self.qkv_bias or self.o_bias or self.qk_norm or self.sinks):
            raise SpecError("latent attention (MLA) with biases, q/k norms or sinks is not modelled",
                            field="model.attention.mla", fix="give MLA without them, as DeepSeek-V2/V3 have it")
        if bool(layers) != (self.window is not None):
            raise SpecError(f"window {self.window} with window_layers {list(layers)}",
                            field="model.attention.window", fix="give a window and the layers that use it, or neither")

    def check_layers(self, layers: int) -> None:
        if any(i >= layers for i in self.window_layers):
            raise SpecError(f"sliding-window layer(s) beyond the model's {layers} layers",
                            field="model.attention.window_layers", fix=f"layer indices go from 0 to {layers - 1}")

    def differences(self, hidden: int, heads: int) -> str:
        """What of this attention is not Llama's (``hidden / heads`` per head, no bias, norm, window,
        latent or sink), in words: what a runner that builds Llama's attention would leave out."""
        what = []
        if self.mla is not None:
            what.append("latent attention (MLA)")
        elif self.head_dim != hidden // heads:
            what.append(f"heads of {self.head_dim} (not {hidden} / {heads} = {hidden // heads})")
        if self.qkv_bias or self.o_bias:
            what.append("biases on " + ("q, k, v and o" if self.qkv_bias and self.o_bias else
                                        "q, k and v" if self.qkv_bias else "o"))
        if self.qk_norm:
            what.append("q/k norms")
        if self.window is not None:
            what.append(f"a sliding window of {self.window} on {len(self.window_layers)} layers")
        if self.sinks:
            what.append("attention sinks")
        return ", ".join(what) or "Llama's attention"

    def is_llamas(self, hidden: int, heads: int, seq_len: int | None = None) -> bool:
        """Whether it computes as Llama's under sequences of ``seq_len`` tokens: heads of hidden / heads,
        no bias, norm, latent or sink, and a window (if any) the sequences never exceed."""
        return (self.head_dim == hidden // heads and not (self.qkv_bias or self.o_bias or self.qk_norm or self.sinks)
                and self.mla is None and (self.window is None or (seq_len is not None and seq_len <= self.window)))

    def unbuilt(self, hidden: int, heads: int, seq_len: int | None = None) -> str:
        """What of this attention none of the families Pipette's runners build has ('' when one does:
        Llama's with a head size and biases on all four, Qwen2's q/k/v biases, Qwen3's q/k norms;
        ``workers.rank.hf_model.llama_config``). A window no sequence of ``seq_len`` tokens exceeds
        changes nothing."""
        qwen2 = self.qkv_bias and not self.o_bias and not self.qk_norm
        window = self.window is not None and (seq_len is None or seq_len > self.window)
        what = ((f"a sliding window of {self.window} under longer sequences", window),
                ("latent attention (MLA)", self.mla is not None),
                ("attention sinks", self.sinks),
                ("an o bias without q, k and v biases", self.o_bias and not self.qkv_bias),
                (f"Qwen2's biases with heads of {self.head_dim} (not {hidden} / {heads})",
                 qwen2 and self.head_dim != hidden // heads))
        return ", ".join(w for w, present in what if present)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["window_layers"] = list(self.window_layers)
        out["mla"] = None if self.mla is None else {f.name: getattr(self.mla, f.name) for f in fields(self.mla)}
        return out

    @classmethod
    def from_dict(cls, data: object) -> AttentionSpec:
        if not isinstance(data, dict) or "head_dim" not in data:
            raise SpecError(f"must be a mapping with head_dim, got {data!r}", field="model.attention",
                            fix="give head_dim (and the optional fields of AttentionSpec)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown key(s) {', '.join(unknown)}", field="model.attention",
                            fix=f"use only {', '.join(sorted(known))}")
        mla = data.get("mla")
        if mla is not None:
            if not isinstance(mla, dict) or set(mla) != {f.name for f in fields(MlaSpec)}:
                raise SpecError(f"must give exactly {', '.join(f.name for f in fields(MlaSpec))}, got {mla!r}",
                                field="model.attention.mla", fix="give every MLA field (q_lora_rank may be null)")
            mla = MlaSpec(**mla)
        layers = data.get("window_layers", ())
        return cls(**{**data, "mla": mla, "window_layers": tuple(layers) if isinstance(layers, list) else layers})


__all__ = ["AttentionSpec", "MlaSpec", "is_layer_list"]
