"""Ulysses sequence parallelism (DeepSpeed Ulysses, Jacobs et al. 2023): attention with the
sequence split over a group of ``degree`` ranks, turned into a split of the heads for the
attention itself by one all-to-all before it and one after.

As DeepSpeed's ``DistributedAttention`` (``deepspeed/sequence/layer.py``): queries, keys and
values arrive as this rank's part of the sequence with every head; the all-to-all
(``_SeqAllToAll``: scatter the head dimension, gather the sequence) gives each rank the whole
sequence for ``heads / degree`` of the heads; plain causal attention runs on them; the
output goes back by the inverse all-to-all (scatter the sequence, gather the heads). The
all-to-all is its own gradient's inverse: the backward of scatter-heads/gather-sequence is
scatter-sequence/gather-heads of the gradient (``_SeqAllToAll.backward``).

The degree is limited by the key/value heads: each rank needs whole KV heads, so ``kv_heads``
(and the query heads) must be divisible by the degree (DeepSpeed's even path asserts
``num_heads % seq_world_size == 0``; its uneven-heads path is not done here).

The sequence is split in contiguous parts here (attention sees the whole sequence, so there
is no causal imbalance to fix); the all-to-all gathers them in rank order, so the positions of
rank ``r``'s part are ``[r s/degree, (r + 1) s/degree)``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipette.errors import SpecError


def check_ulysses(heads: int, kv_heads: int, seq_len: int, degree: int) -> None:
    """SpecError unless the heads and the sequence divide among ``degree`` ranks."""
    if kv_heads % degree or heads % degree:
        raise SpecError(f"Ulysses degree {degree} must divide the attention heads ({heads}) and the key/value "
                        f"heads ({kv_heads}): each rank attends whole heads",
                        field="cp", fix=f"use a Ulysses degree that divides {kv_heads}, or ring attention")
    if seq_len % degree:
        raise SpecError(f"sequence length {seq_len} is not divisible by the Ulysses degree {degree}",
                        field="seq_len", fix=f"use a sequence length that is a multiple of {degree}")


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class SeqAllToAll(torch.autograd.Function):
    """Scatter ``scatter_dim`` over the group and gather ``gather_dim``; the gradient goes back
    the inverse way (DeepSpeed's ``_SeqAllToAll``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def seq_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return cast(torch.Tensor, SeqAllToAll.apply(x, scatter_dim, gather_dim, group))  # type: ignore[no-untyped-call]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                      scale: float) -> torch.Tensor:
    """Causal attention of queries [b, heads, s, d] and keys, values [b, kv_heads, s, d], ``s``
    this rank's contiguous part of the sequence; returns [b, heads, s, d]."""
    degree = dist.get_world_size(group)
    check_ulysses(q.shape[1], k.shape[1], q.shape[2] * degree, degree)
    # [b, heads, s/degree, d] -> [b, heads/degree, s, d]: scatter heads (1), gather sequence (2)
    qh, kh, vh = (seq_all_to_all(t, 1, 2, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return seq_all_to_all(out, 2, 1, group)
