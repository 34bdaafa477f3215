"""Context parallelism for the PyTorch-native runner: the sequence split over a cp group, and
attention over the whole sequence by ring attention (``workers.rank.ring_attention``) or
Ulysses' all-to-all (``workers.rank.ulysses``).

**Chunking** (load balance of causal attention). The sequence is cut into ``2 cp`` chunks and
cp rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (Megatron-LM's
``get_batch_on_this_cp_rank``, ``megatron/core/utils.py``: "we split sequence into 2*CP ranks
... chunk_0 and chunk_3 are assigned to GPU0, chunk_1 and chunk_2 to GPU1"; PyTorch's
``_HeadTailLoadBalancer``, ``torch/distributed/tensor/experimental/_context_parallel/
_load_balancer.py``, which torchtitan's ``HeadTailCPLoadBalancer`` uses,
``torchtitan/distributed/context_parallel.py``). A rank's queries then see ``2 cp - 1`` whole
key chunks and two diagonal ones, the same causal work on every rank (``causal_work``). The
sequence must be divisible by ``2 cp`` (torchtitan's and Megatron's rule). RoPE takes the
global positions of the rank's chunks (``positions``).

**Which implementation.** PyTorch's own ``torch.distributed.tensor.experimental.context_parallel``
(torch 2.13) runs its ring only for the CUDA attention kernels (``_scaled_dot_product_flash_
attention``, ``_efficient_``, ``_cudnn_``: its ``custom_ops`` table); on a CPU rank under gloo
SDPA dispatches ``aten._scaled_dot_product_flash_attention_for_cpu``, which it does not handle:
"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered" (run on the 2-core dev VM, torchrun with 2 gloo ranks, 2026-12-04). So
``attention_path`` picks PyTorch's API (``torch_ring_attention``: DTensor inputs sharded on the
sequence, the CP dispatcher of torchtitan's ``apply_cp_to_attention_module``) on a CUDA
device, and this module's own ring on any other; both shard the sequence the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from pipette.errors import SpecError
from workers.rank.ring_attention import CAUSAL, RingPlan, ring_attention
from workers.rank.ulysses import check_ulysses, ulysses_attention

Kind = Literal["ring", "ulysses"]
#: the name of the attention function registered with ``transformers``' ``AttentionInterface``
ATTENTION_NAME = "pipette_context_parallel"


def check_cp(seq_len: int, cp: int) -> None:
    """SpecError unless ``2 cp`` chunks of equal length make the sequence."""
    if cp < 1 or seq_len % (2 * cp):
        raise SpecError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}: load-balanced "
                        "context parallelism cuts it into 2 * cp equal chunks",
                        field="seq_len", fix=f"use a sequence length that is a multiple of {2 * cp}, or another cp")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 cp``) cp rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def balanced_plan(cp: int) -> RingPlan:
    return RingPlan(tuple(chunk_ids(cp, r) for r in range(cp)))


def contiguous_plan(cp: int) -> RingPlan:
    """The naive split, rank ``r`` holding the ``r``-th ``1/cp`` of the sequence (as two chunks of
    ``2 cp``, so its work is counted in the same units): what load balancing replaces."""
    return RingPlan(tuple((2 * r, 2 * r + 1) for r in range(cp)))


def positions(seq_len: int, plan: RingPlan, rank: int) -> torch.Tensor:
    """Global positions (int64) of the tokens ``rank`` holds, in its order."""
    check_cp(seq_len, plan.cp)
    chunk = seq_len // (2 * plan.cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in plan.chunks[rank]])


def shard_sequence(x: torch.Tensor, dim: int, plan: RingPlan, rank: int) -> torch.Tensor:
    """This rank's part of ``x`` along its sequence dimension ``dim`` (the batch's tokens, labels)."""
    return x.index_select(dim, positions(x.shape[dim], plan, rank).to(x.device))


def causal_work(plan: RingPlan, rank: int, chunk: int) -> int:
    """Query-key products ``rank`` computes over the whole ring with chunks of ``chunk`` tokens:
    a full pair ``chunk^2``, a diagonal ``chunk (chunk + 1) / 2`` (the causal triangle)."""
    return sum(chunk * (chunk + 1) // 2 if relation == CAUSAL else chunk * chunk
               for step in range(plan.cp) for _, _, relation in plan.pairs(rank, step))


def attention_path(device: torch.device) -> Literal["torch", "ring"]:
    """PyTorch's context-parallel API on a CUDA device, this module's ring elsewhere (see the
    module docstring: torch 2.13's API has no CPU attention kernel)."""
    return "torch" if device.type == "cuda" else "ring"


def torch_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Any, scale: float) -> torch.Tensor:
    """PyTorch's ring (``_templated_ring_attention`` under the CP dispatcher, head-tail load
    balanced as here) on this rank's [b, heads, s, d] queries and keys/values. Its SDPA ops
    take equal heads, so the keys and values are repeated to the query heads (``repeat_kv``):
    the ring carries ``heads`` heads where this module's carries ``kv_heads``."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _enable_context_parallel_dispatcher

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    _enable_context_parallel_dispatcher()  # idempotent; torchtitan leaves it on too
    dq, dk, dv = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, is_causal=True, scale=scale)
    return cast(DTensor, out).to_local()


@dataclass
class ContextParallel:
    """How this rank's attention sees the whole sequence: ``kind`` over the 1-D ``mesh`` (the
    layout's cp mesh dimension); ``seq_len`` is the whole sequence's length."""

    kind: Kind
    mesh: Any
    seq_len: int
    rank: int = field(init=False)
    degree: int = field(init=False)

    def __post_init__(self) -> None:
        group = self.mesh.get_group()
        self.rank, self.degree = dist.get_rank(group), dist.get_world_size(group)
        if self.kind == "ring":
            check_cp(self.seq_len, self.degree)
        elif self.seq_len % self.degree:
            raise SpecError(f"sequence length {self.seq_len} is not divisible by the Ulysses degree {self.degree}",
                            field="seq_len", fix=f"use a sequence length that is a multiple of {self.degree}")

    def positions(self) -> torch.Tensor:
        """Global positions of this rank's tokens (ring: its two chunks; Ulysses: its contiguous part)."""
        if self.kind == "ring":
            return positions(self.seq_len, balanced_plan(self.degree), self.rank)
        part = self.seq_len // self.degree
        return torch.arange(self.rank * part, (self.rank + 1) * part)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (the batch and its labels)."""
        return x.index_select(dim, self.positions().to(x.device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of this rank's [b, heads, s, d] queries over the whole sequence."""
        group = self.mesh.get_group()
        if self.kind == "ulysses":
            check_ulysses(q.shape[1], k.shape[1], self.seq_len, self.degree)
            return ulysses_attention(q, k, v, group, scale)
        if attention_path(q.device) == "torch":
            return torch_ring_attention(q, k, v, self.mesh, scale)
        return ring_attention(q, k, v, group, balanced_plan(self.degree), scale)


def _hf_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A ``transformers`` attention function (``AttentionInterface``): this rank's queries [b,
    heads, s, d] through ``module.context_parallel``; [b, s, heads, d] out, as SDPA's."""
    context: ContextParallel = module.context_parallel
    if attention_mask is not None or dropout:
        raise SpecError("context-parallel attention is causal without a mask or dropout",
                        field="cp", fix="train without an attention mask and with attention dropout 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return context.attend(query, key, value, scale).transpose(1, 2).contiguous(), None


def attention_classes() -> tuple[type, ...]:
    """The attention modules of the families the runners build (``workers.rank.hf_model.llama_config``):
    each calls the attention function its config names (``AttentionInterface``) on [b, heads, s, d] queries
    after its own position-wise steps (Qwen2's biases, Qwen3's per-head q/k norms), so the same ring takes
    them all."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    return LlamaAttention, Qwen2Attention, Qwen3Attention


def apply_context_parallel(stage: Any, context: ContextParallel) -> int:
    """Route every decoder layer's attention of a ``LlamaStage`` (``attention_classes``) through ``context``
    (through checkpoint wrappers too) and give the stage this rank's global positions; its inputs must
    be ``context.shard``'s part. Returns how many attention modules it routed."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _hf_attention)
    routed = 0
    families = attention_classes()
    for module in stage.modules():
        if isinstance(module, families):
            attention: Any = module
            attention.context_parallel = context
            attention.config._attn_implementation = ATTENTION_NAME
            routed += 1
    stage.position_ids = context.positions()
    return routed
