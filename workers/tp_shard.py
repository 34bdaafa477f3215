"""Megatron-style tensor parallelism for the decoder layers of a ``PipelineModule``.

DeepSpeed's AutoTP cannot parse a ``PipelineModule`` (it finds no model policy), so
inside the pipeline the runner shards the layers itself, over the pipeline grid's
model-parallel group: q, k, v, gate, up split by output rows (column-parallel, input
through ``copy_to_tp``), o and down split by input columns (row-parallel, output through
``reduce_from_tp``): Shoeybi et al. 2019, sec. 3. HF attention views heads as
``(-1, head_dim)``, so each rank simply runs its ``heads / tp`` heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.lora import COLUMN, ROW, copy_to_tp, reduce_from_tp


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, tp: int, tp_index: int, group: Any):
        super().__init__()
        rows = linear.out_features // tp
        self.weight = nn.Parameter(linear.weight.detach()[tp_index * rows : (tp_index + 1) * rows].clone())
        self.weight.requires_grad_(linear.weight.requires_grad)  # frozen under LoRA
        self.weight.model_parallel = True  # type: ignore[attr-defined]  # DeepSpeed's norm reads it
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = nn.functional.linear(copy_to_tp(x, self.group), self.weight)
        return out


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, tp: int, tp_index: int, group: Any):
        super().__init__()
        cols = linear.in_features // tp
        self.weight = nn.Parameter(linear.weight.detach()[:, tp_index * cols : (tp_index + 1) * cols].clone())
        self.weight.requires_grad_(linear.weight.requires_grad)
        self.weight.model_parallel = True  # type: ignore[attr-defined]
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = reduce_from_tp(nn.functional.linear(x, self.weight), self.group)
        return out


def shard_layers(module: nn.Module, tp: int, tp_index: int, group: Any) -> int:
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
