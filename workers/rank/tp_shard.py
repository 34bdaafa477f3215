"""Megatron-style tensor parallelism for the Llama model (Shoeybi et al. 2019, sec. 3), with
or without a pipeline: q, k, v, gate and up split by output rows (column-parallel, input
through ``copy_to_tp``), o and down split by input columns (row-parallel, output through
``reduce_from_tp``); the embedding and the LM head split by vocabulary rows (sec. 3, "we
parallelize the input embedding weight matrix along the vocabulary dimension"), with the
cross-entropy computed on the vocabulary shards without gathering the logits
(``vocab_parallel_cross_entropy``, Megatron-LM's ``_VocabParallelCrossEntropy``). HF attention
views heads as ``(-1, head_dim)``, so each rank simply runs its ``heads / tp`` heads.

This is what ``pipette.memory`` counts (linear layers and the vocabulary over tp, norms
replicated). The layers are sharded before they hold values (on the meta device): each new
parameter records which rows or columns of the full one it is (``pipette_rows`` /
``pipette_cols``), and ``workers.rank.build`` then gives it just those values. The process group
is set once it exists (``set_group``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workers.rank.lora import COLUMN, ROW, copy_to_tp, reduce_from_tp


def shard_parameter(full: torch.Tensor, dim: int, tp: int, tp_index: int) -> nn.Parameter:
    """This rank's part of ``full`` along ``dim`` (0: rows, 1: columns), tagged with where it
    lies in the full parameter."""
    size = full.shape[dim] // tp
    start = tp_index * size
    part = nn.Parameter(full.detach().narrow(dim, start, size).clone(), requires_grad=full.requires_grad)
    for key, value in vars(full).items():  # pipette_name, and whatever else was tagged
        setattr(part, key, value)
    part.pipette_full_shape = tuple(getattr(full, "pipette_full_shape", full.shape))  # type: ignore[attr-defined]
    setattr(part, "pipette_rows" if dim == 0 else "pipette_cols", (start, start + size))
    part.model_parallel = True  # type: ignore[attr-defined]  # DeepSpeed's gradient norm reads it
    return part


class _Sharded(nn.Module):
    group: Any = None

    def set_group(self, group: Any) -> None:
        self.group = group


class ColumnParallelLinear(_Sharded):
    def __init__(self, linear: nn.Linear, tp: int, tp_index: int, group: Any = None):
        super().__init__()
        self.weight = shard_parameter(linear.weight, 0, tp, tp_index)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = nn.functional.linear(copy_to_tp(x, self.group), self.weight)
        return out


class RowParallelLinear(_Sharded):
    def __init__(self, linear: nn.Linear, tp: int, tp_index: int, group: Any = None):
        super().__init__()
        self.weight = shard_parameter(linear.weight, 1, tp, tp_index)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = reduce_from_tp(nn.functional.linear(x, self.weight), self.group)
        return out


class VocabParallelEmbedding(_Sharded):
    """The embedding rows of this rank's vocabulary range; a token outside it contributes
    zeros, and the sum over the ranks (``reduce_from_tp``) is the lookup."""

    def __init__(self, embedding: nn.Embedding, tp: int, tp_index: int, group: Any = None,
                 weight: nn.Parameter | None = None):
        super().__init__()
        self.weight = weight if weight is not None else shard_parameter(embedding.weight, 0, tp, tp_index)
        self.start = tp_index * (embedding.num_embeddings // tp)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        result: torch.Tensor = reduce_from_tp(out, self.group)
        return result


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split over the vocabulary (Megatron-LM,
    ``tensor_parallel/cross_entropy.py``): the max, the target's logit and the sum of
    exponentials are all-reduced over the group; the gradient is softmax - one-hot, locally."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, group: Any) -> torch.Tensor:
        logits = logits.float()
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp, total, local, outside)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        exp, total, local, outside = ctx.saved_tensors
        softmax = exp / total.unsqueeze(-1)
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
        return (softmax - onehot) * (grad / local.numel()), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, group: Any) -> torch.Tensor:
    """Mean next-token loss of ``logits`` holding the vocabulary ``[start, start + V/tp)``."""
    flat = logits.reshape(-1, logits.shape[-1])
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), start, group)  # type: ignore[no-untyped-call]
    return out


class VocabParallelLoss:
    """The trial's loss over vocabulary-sharded logits (its group set once it exists)."""

    def __init__(self, start: int):
        self.start = start
        self.group: Any = None

    def set_group(self, group: Any) -> None:
        self.group = group

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.start, self.group)


def shard_layers(module: nn.Module, tp: int, tp_index: int, group: Any = None) -> int:
    """Replace every q/k/v/o/gate/up/down ``nn.Linear`` under ``module``; returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name in (*COLUMN, *ROW):
            linear = getattr(parent, name, None)
            if not isinstance(linear, nn.Linear):
                continue
            if linear.bias is not None:
                raise NotImplementedError("tensor-parallel linear layers with a bias")
            cls = ColumnParallelLinear if name in COLUMN else RowParallelLinear
            setattr(parent, name, cls(linear, tp, tp_index, group))
            count += 1
    return count


def shard_vocabulary(model: nn.Module, tp: int, tp_index: int) -> VocabParallelLoss:
    """Split a ``LlamaForCausalLM``'s embedding and LM head by vocabulary rows (one shared
    shard when they are tied); returns the loss for its sharded logits."""
    inner: Any = model.model
    head: Any = model.lm_head
    tied = head.weight is inner.embed_tokens.weight
    embed = VocabParallelEmbedding(inner.embed_tokens, tp, tp_index)
    inner.embed_tokens = embed
    column = ColumnParallelLinear.__new__(ColumnParallelLinear)
    _Sharded.__init__(column)
    column.weight = embed.weight if tied else shard_parameter(head.weight, 0, tp, tp_index)
    column.group = None
    model.lm_head = column
    return VocabParallelLoss(embed.start)


def set_groups(module: nn.Module, group: Any, loss: VocabParallelLoss | None = None) -> None:
    """Give every sharded layer under ``module`` (and the loss) its tensor-parallel group."""
    for m in module.modules():
        if isinstance(m, _Sharded):
            m.set_group(group)
    if loss is not None:
        loss.set_group(group)
