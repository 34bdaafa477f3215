"""A Llama-like Mixture-of-Experts feed-forward for the PyTorch-native runner: a router, E SwiGLU
experts, an optional shared expert, dropless or capacity-factor routing, and the Switch
load-balancing loss.

* **Router** (Mixtral: Hugging Face's ``MixtralSparseMoeBlock``; Megatron-Core's softmax router
  with ``use_pre_softmax``, ``topk_routing_with_score_function`` in
  ``megatron/core/transformer/moe/moe_utils.py``): logits ``x W_g^T`` over the E experts, their
  softmax in fp32, the k largest kept and renormalised to sum to one per token (Mixtral's
  ``routing_weights /= routing_weights.sum(-1)``).
* **Capacity** (GShard, Lepikhin et al. 2020, sec. 2.2; Megatron-Core's ``get_capacity`` and
  ``apply_router_token_dropping``): each expert takes at most ``C = ceil(T k / E * capacity_factor)``
  of the assignments of this rank's T tokens; the others are dropped (weight zero: the token
  keeps its other experts, the shared expert and the residual). ``probs`` keeps an expert's C
  highest-weight assignments (Megatron's default ``moe_token_drop_policy``), ``position`` its
  first C in token order (GShard's position in expert). ``capacity_factor=None`` is dropless.
  Dropping is decided on the rank's own tokens, before any exchange, as Megatron's router does:
  an expert-parallel layer drops exactly what the one-device layer drops on the same tokens.
* **Load-balancing loss** (Switch Transformer, Fedus et al. 2021, eq. 4-6; Megatron-Core's
  ``switch_load_balancing_loss_func``): ``L_aux = alpha E sum_i f_i P_i``, with ``f_i`` the
  fraction of the ``T k`` assignments routed to expert i (counted before dropping, as Megatron's
  ``compute_routing_scores_for_aux_loss`` counts them) and ``P_i`` the mean router probability of
  expert i over the T tokens; on this rank's tokens. It reaches the gradients as Megatron's
  ``MoEAuxLossAutoScaler`` makes it reach them: attached to the layer's output, with a gradient of
  ``aux_loss_scale`` (1: the loss is added once; a runner averaging ``n`` micro-batches sets 1/n),
  so the training loop needs no change.
* **Experts**: Llama's SwiGLU MLP ``down(silu(gate(x)) * up(x))``, named as Hugging Face's
  Qwen2-MoE / Qwen3-MoE modules name them (``gate``, ``experts.<i>.{gate,up,down}_proj``,
  ``shared_expert.*``, ``shared_expert_gate``): PEFT's LoRA targets ``gate_proj``/``up_proj``/``down_proj`` reach the
  experts, and a parameter's name (its initial values' key, ``workers.rank.init``) is the same
  on whichever rank holds it.
* **Expert parallelism**: given an ep process group the layer holds the ep rank's block of
  ``E / ep`` consecutive experts (by global index) and moves tokens by all-to-all
  (``workers.rank.expert_parallel``); without one it holds all E and runs the per-expert loop of
  Hugging Face's Mixtral block: the one-device reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pipette.errors import SpecError
from pipette.model import ModelSpec
from workers.rank.expert_parallel import Dispatch, Routing, expert_parallel_forward

#: which assignments an expert over its capacity keeps (see the module docstring)
DROP_POLICIES: tuple[str, ...] = ("probs", "position")


@dataclass(frozen=True)
class MoeOptions:
    """The shape and routing of one MoE feed-forward."""

    experts: int
    top_k: int
    #: the FFN width of each routed expert
    expert_hidden: int
    #: the FFN width of the shared expert (DeepSeek-MoE, Qwen2-MoE); 0: none
    shared_hidden: int = 0
    #: Qwen2-MoE's sigmoid gate on the shared expert's output (``shared_expert_gate``, one
    #: ``hidden x 1`` matrix: ``Qwen2MoeSparseMoeBlock``); DeepSeek's shared experts have none
    shared_gate: bool = False
    #: None: dropless; else each expert's capacity is ``capacity_factor * T k / E`` (GShard)
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    #: alpha of the load-balancing loss (Switch Transformer's 1e-2)
    aux_loss_coeff: float = 1e-2

    def __post_init__(self) -> None:
        fix = "give experts >= 1 and 1 <= top_k <= experts"
        if self.experts < 1:
            raise SpecError(f"{self.experts} experts", field="moe.experts", fix=fix)
        if not 1 <= self.top_k <= self.experts:
            raise SpecError(f"top-{self.top_k} of {self.experts} experts", field="moe.top_k", fix=fix)
        if self.expert_hidden < 1 or self.shared_hidden < 0:
            raise SpecError(f"expert width {self.expert_hidden}, shared expert width {self.shared_hidden}",
                            field="moe.expert_hidden", fix="give expert_hidden >= 1 and shared_hidden >= 0")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise SpecError(f"capacity factor {self.capacity_factor}", field="moe.capacity_factor",
                            fix="give a positive capacity factor, or none for dropless routing")
        if self.drop_policy not in DROP_POLICIES:
            raise SpecError(f"drop policy {self.drop_policy!r}", field="moe.drop_policy",
                            fix=f"use one of {', '.join(DROP_POLICIES)}")
        if self.aux_loss_coeff < 0:
            raise SpecError(f"load-balancing coefficient {self.aux_loss_coeff}", field="moe.aux_loss_coeff",
                            fix="give a coefficient >= 0")

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert takes of ``tokens`` tokens (Megatron-Core's ``get_capacity``
        with ``num_tokens = tokens * top_k``); None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(tokens * self.top_k / self.experts * self.capacity_factor)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, options: MoeOptions) -> torch.Tensor:
    """Megatron-Core's ``switch_load_balancing_loss_func``: ``sum_i P_i^sum n_i * E alpha /
    (k T^2)``, which is ``alpha E sum_i f_i P_i`` (Switch Transformer eq. 4) with ``n_i`` the
    assignments to expert i, ``f_i = n_i / (T k)`` and ``P_i = P_i^sum / T``."""
    tokens = probs.shape[0]
    per_expert = torch.bincount(experts.reshape(-1), minlength=options.experts).to(probs.dtype)
    scale = options.experts * options.aux_loss_coeff / (options.top_k * tokens * tokens)
    return (probs.sum(dim=0) * per_expert).sum() * scale


def within_capacity(weights: torch.Tensor, experts: torch.Tensor, options: MoeOptions) -> torch.Tensor:
    """Which of the ``[T, k]`` assignments their experts keep (all when dropless, or when the
    capacity is at least T: an expert gets each token at most once)."""
    tokens = weights.shape[0]
    capacity = options.capacity(tokens)
    if capacity is None or capacity >= tokens:
        return torch.ones_like(experts, dtype=torch.bool)
    chosen = torch.zeros(tokens, options.experts, dtype=torch.bool, device=weights.device).scatter(1, experts, True)
    if options.drop_policy == "probs":
        dense = torch.zeros(tokens, options.experts, dtype=weights.dtype, device=weights.device)
        best = torch.topk(dense.scatter(1, experts, weights), k=capacity, dim=0).indices
        room = torch.zeros_like(chosen).scatter(0, best, True)
    else:
        room = torch.cumsum(chosen.to(torch.int64), dim=0) <= capacity
    return (chosen & room).gather(1, experts)


def route(logits: torch.Tensor, options: MoeOptions) -> Routing:
    """Softmax, top-k, renormalise (Mixtral); drop over capacity; the load-balancing loss."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, options.top_k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True)
    kept = within_capacity(weights.detach(), experts, options)
    aux = load_balancing_loss(probs, experts, options)
    return Routing(experts, (weights * kept).to(logits.dtype), kept, aux)


class AttachAuxLoss(torch.autograd.Function):
    """Megatron-Core's ``MoEAuxLossAutoScaler``: the output passes through unchanged, and the
    backward gives the auxiliary loss the gradient ``scale``, as if ``scale * aux_loss`` had
    been added to the loss."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class SwiGLU(nn.Module):
    """Llama's MLP (``LlamaMLP``): ``down(silu(gate(x)) * up(x))``, without biases."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


def local_experts_forward(x: torch.Tensor, routing: Routing, experts: nn.ModuleDict) -> torch.Tensor:
    """Every expert on this rank, each on the tokens routed to it, weighted and summed per token
    (the loop of Hugging Face's ``MixtralSparseMoeBlock``)."""
    out = torch.zeros_like(x)
    for key, expert in experts.items():
        token, slot = torch.where((routing.experts == int(key)) & routing.kept)
        out = out.index_add(0, token, expert(x[token]) * routing.weights[token, slot, None])
    return out


def expert_block(experts: int, ep_group: dist.ProcessGroup | None) -> range:
    """The global indices of the experts this ep rank holds: its block of ``experts / ep``."""
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    if experts % ep:
        raise SpecError(f"{experts} experts cannot be split evenly over ep={ep}", field="ep",
                        fix=f"use an ep that divides {experts}")
    local = experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)


class MoeFeedForward(nn.Module):
    """The MoE feed-forward of one decoder layer, in place of its ``LlamaMLP`` (same input and
    output: ``[..., hidden]``). ``ep_group``: the expert-parallel group (None: all experts here)."""

    def __init__(self, hidden: int, options: MoeOptions, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.options = options
        self.ep_group = ep_group
        self.gate = nn.Linear(hidden, options.experts, bias=False)
        self.experts = nn.ModuleDict({str(i): SwiGLU(hidden, options.expert_hidden)
                                      for i in expert_block(options.experts, ep_group)})
        self.shared_expert = SwiGLU(hidden, options.shared_hidden) if options.shared_hidden else None
        gated = options.shared_gate and options.shared_hidden
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if gated else None
        #: the gradient the load-balancing loss gets (``AttachAuxLoss``)
        self.aux_loss_scale = 1.0
        #: the last forward's load-balancing loss (detached) and token exchange, for reports
        self.last_aux_loss: torch.Tensor | None = None
        self.last_dispatch: Dispatch | None = None

    def shard_experts(self, ep_group: dist.ProcessGroup) -> None:
        """Keep only the ep rank's block of experts and route through ``ep_group`` (torchtitan's
        ``ExpertParallel`` partition: the experts ``Shard(0)`` over the ep mesh); on a layer that
        holds all E, as the runner's meta-device model does before it is parallelised."""
        if len(self.experts) != self.options.experts:
            raise RuntimeError(f"the experts are already sharded: {len(self.experts)} of {self.options.experts} here")
        block = expert_block(self.options.experts, ep_group)
        self.experts = nn.ModuleDict({key: expert for key, expert in self.experts.items() if int(key) in block})
        self.ep_group = ep_group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routing = route(self.gate(x), self.options)
        if self.ep_group is None:
            out = local_experts_forward(x, routing, self.experts)
        else:
            out, self.last_dispatch = expert_parallel_forward(x, routing, self.experts, self.ep_group)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:  # Qwen2MoeSparseMoeBlock: sigmoid(x W_s) * shared(x)
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        self.last_aux_loss = routing.aux_loss.detach()
        attached: torch.Tensor = AttachAuxLoss.apply(out, routing.aux_loss, self.aux_loss_scale)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        return attached.reshape(shape)


def moe_options(model: ModelSpec) -> MoeOptions | None:
    """The runner's MoE feed-forward of ``model`` (None: dense): its experts, top-k, widths, the
    shared expert (DeepSeek's several shared experts of width w are one of their summed width: the
    outputs add) and its gate, the capacity factor. What this layer does not model (sigmoid or
    group-limited routing, biases, dense layers) is refused before any rank starts
    (``pipette.fsdp_rules``)."""
    spec = model.moe
    if spec is None:
        return None
    return MoeOptions(experts=spec.experts, top_k=spec.top_k, expert_hidden=spec.expert_ffn,
                      shared_hidden=spec.shared_ffn, shared_gate=spec.shared_gate,
                      capacity_factor=spec.capacity_factor)


def use_moe(hf: Any, options: MoeOptions) -> None:
    """Give every decoder layer of a Hugging Face Llama (``hf.model.layers``) an MoE feed-forward
    with all E experts in place of its ``LlamaMLP``, on the device and in the dtype of the model
    (the meta device for the runner: ``workers.rank.fsdp_model.meta_model``)."""
    weight = hf.model.embed_tokens.weight
    for layer in hf.model.layers:
        with torch.device(weight.device):
            layer.mlp = MoeFeedForward(hf.config.hidden_size, options).to(dtype=weight.dtype)


def shard_experts(module: nn.Module, ep_group: dist.ProcessGroup) -> None:
    """``MoeFeedForward.shard_experts`` on every MoE feed-forward of ``module``."""
    for sub in list(module.modules()):  # listed first: each call replaces a child
        if isinstance(sub, MoeFeedForward):
            sub.shard_experts(ep_group)
