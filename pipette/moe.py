"""``MoeSpec``: the Mixture-of-Experts part of a model.

A Mixture-of-Experts (MoE) layer replaces the MLP with ``experts`` routed MLPs of width
``expert_ffn``, of which a router picks ``top_k`` per token (Shazeer et al. 2017; Fedus et
al. 2022, Switch Transformer), plus ``shared_experts`` that every token goes through
(DeepSeekMoE, Dai et al. 2024, sec. 3.2), whose widths add up to ``shared_ffn``. Some layers
keep a dense MLP (``dense_layers``): DeepSeek-V2/V3's first ``first_k_dense_replace``
layers, Qwen-MoE's ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips.

Every expert is a gated (SwiGLU) MLP of three matrices, as in Mixtral, Qwen-MoE, DeepSeek
and gpt-oss. ``capacity_factor`` None is dropless routing (every token reaches its k
experts: MegaBlocks, Gale et al. 2023; Megatron-Core's default); a number caps each
expert at ``capacity_factor x tokens x top_k / experts`` tokens (GShard, Lepikhin et al.
2021, sec. 2.2).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from pipette.attention import is_layer_list
from pipette.errors import SpecError

Scoring = Literal["softmax", "sigmoid"]
SCORINGS: tuple[str, ...] = ("softmax", "sigmoid")
#: beyond any published MoE (DeepSeek-V3 and Kimi K2: 256 and 384 routed experts)
MAX_EXPERTS = 1 << 14
#: upper bounds, as pipette.model.MODEL_LIMITS for the dense shape (widths as ``ffn_hidden``'s)
_LIMITS: dict[str, int] = {"experts": MAX_EXPERTS, "shared_experts": MAX_EXPERTS, "expert_ffn": 1 << 20,
                           "shared_ffn": 1 << 20, "mtp_layers": 64}


@dataclass(frozen=True)
class MoeSpec:
    """The experts of an MoE model; the same in every MoE layer."""

    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    #: the width of the shared experts together (Megatron-Core's
    #: ``moe_shared_expert_intermediate_size``; DeepSeek: n_shared_experts x moe_intermediate_size)
    shared_ffn: int = 0
    #: the indices of the layers with a dense MLP of the model's ``ffn_hidden`` instead
    dense_layers: tuple[int, ...] = ()
    #: the router's scores: softmax (Mixtral, Qwen, DeepSeek-V2, gpt-oss) or sigmoid (DeepSeek-V3)
    scoring: Scoring = "softmax"
    router_bias: bool = False  # gpt-oss: the router's linear layer has a bias
    expert_bias: bool = False  # gpt-oss: every expert's matrices have biases
    shared_gate: bool = False  # Qwen-MoE: a sigmoid gate (one h x 1 matrix) on the shared expert
    capacity_factor: float | None = None
    #: group-limited routing (DeepSeek-V2's device-limited and DeepSeek-V3's node-limited routing):
    #: the experts form ``groups`` groups and a token's ``top_k`` come from its best ``group_top_k``
    #: groups (``n_group``, ``topk_group``); 1 and 1: no limit
    groups: int = 1
    group_top_k: int = 1
    #: DeepSeek-V3's multi-token-prediction modules (``num_nextn_predict_layers``), trained beside
    #: the model and left out of its total (the card's 671B; the checkpoint's 685B adds them)
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        for name, low in (("experts", 2), ("top_k", 1), ("expert_ffn", 1), ("shared_experts", 0),
                          ("shared_ffn", 0), ("mtp_layers", 0), ("groups", 1), ("group_top_k", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise SpecError(f"must be a whole number of at least {low}, got {value!r}", field=f"model.moe.{name}",
                                fix="check the experts' fields of config.json" if low < 2 else
                                "a model with fewer than 2 experts is dense: give its dense model_type")
        for name, high in _LIMITS.items():
            if getattr(self, name) > high:
                raise SpecError(f"is {getattr(self, name):,}, beyond any model this tuner plans (at most {high:,})",
                                field=f"model.moe.{name}", fix="check config.json: a value this large is a typo")
        if self.top_k > self.experts:
            raise SpecError(f"top_k {self.top_k} is more than the {self.experts} experts", field="model.moe.top_k",
                            fix=f"a token is routed to at most all {self.experts} experts: use top_k <= {self.experts}")
        if self.experts % self.groups or self.group_top_k > self.groups \
                or (self.groups > 1 and self.top_k > self.group_top_k * (self.experts // self.groups)):
            raise SpecError(f"{self.groups} groups, {self.group_top_k} picked, of {self.experts} experts for top-"
                            f"{self.top_k}", field="model.moe.groups", fix="groups must divide experts, group_top_k "
                            "be at most groups, and the picked groups hold at least top_k experts")
        if (self.shared_experts == 0) != (self.shared_ffn == 0):
            raise SpecError(f"shared_experts {self.shared_experts} with shared_ffn {self.shared_ffn}",
                            field="model.moe.shared_ffn", fix="give both (a shared expert has a width) or neither")
        if self.scoring not in SCORINGS:
            raise SpecError(f"unknown router scoring {self.scoring!r}", field="model.moe.scoring",
                            fix=f"use one of {', '.join(SCORINGS)}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise SpecError(f"must be a positive number or None (dropless), got {cf!r}",
                            field="model.moe.capacity_factor",
                            fix="leave it out for dropless routing, or give e.g. 1.25")
        if not is_layer_list(self.dense_layers):
            raise SpecError(f"must be increasing layer indices from 0, got {self.dense_layers!r}",
                            field="model.moe.dense_layers",
                            fix="list each dense layer once, in order (0 is the first layer)")

    def check_layers(self, layers: int) -> None:
        """Refuse dense layers the model does not have, or a model with no MoE layer."""
        beyond = [i for i in self.dense_layers if i >= layers]
        if beyond:
            raise SpecError(f"dense layer(s) {beyond} beyond the model's {layers} layers",
                            field="model.moe.dense_layers", fix=f"layer indices go from 0 to {layers - 1}")
        if len(self.dense_layers) == layers:
            raise SpecError("every layer is dense: the model has no MoE layer", field="model.moe.dense_layers",
                            fix="give it as a dense model (no moe), or fix first_k_dense_replace / mlp_only_layers")

    def moe_layers(self, layers: int) -> int:
        return layers - len(self.dense_layers)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["dense_layers"] = list(self.dense_layers)
        return out

    @classmethod
    def from_dict(cls, data: object) -> MoeSpec:
        if not isinstance(data, dict):
            raise SpecError(f"must be a mapping, got {data!r}", field="model.moe",
                            fix="give experts, top_k, expert_ffn (and the optional fields of MoeSpec)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted({"experts", "top_k", "expert_ffn"} - set(data))
        if unknown or missing:
            what = f"unknown key(s) {', '.join(unknown)}" if unknown else f"missing key(s) {', '.join(missing)}"
            raise SpecError(what, field="model.moe", fix=f"use {', '.join(sorted(known))}; experts, top_k, expert_ffn "
                            "are required")
        dense = data.get("dense_layers", ())
        return cls(**{**data, "dense_layers": tuple(dense) if isinstance(dense, list) else dense})


__all__ = ["MAX_EXPERTS", "SCORINGS", "MoeSpec", "Scoring"]
