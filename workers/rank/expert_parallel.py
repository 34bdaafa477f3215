"""Expert parallelism: the tokens of each rank go to the ranks that hold their experts, are
computed there, and come back, by all-to-all over the ep process group (dispatch, experts,
combine: torchtitan's ``ExpertParallel`` in ``torchtitan/distributed/expert_parallel.py`` and
Megatron-Core's ``MoEAlltoAllTokenDispatcher`` in ``megatron/core/transformer/moe/token_dispatcher.py``).

One call, on each rank of the ep group (``ep`` ranks, ``E / ep`` experts each):

1. **permute**: the kept (token, expert) assignments of the rank's T tokens, sorted by expert,
   so the rows bound for ep rank r are one block (its experts are a consecutive block);
2. **counts**: the rows per expert, exchanged by an even all-to-all of E numbers, so each rank
   learns how many rows it gets from each peer for each of its experts; the row splits of the
   next collective are their sums, host integers (the one device-to-host wait, as torchtitan's);
3. **dispatch**: ``all_to_all_single`` of the rows with those uneven split sizes;
4. **experts**: the received rows, (source rank, local expert)-major, regrouped expert-major
   (torchtitan's ``_permute``, Megatron's ``sort_chunks_by_idxs``), each local expert on its
   block, and put back in arrival order;
5. **combine**: the reverse all-to-all (the splits swapped), then each row times its routing
   weight, added into its token (``index_add``).

Autograd runs through both exchanges: ``AllToAll``'s backward is the reverse all-to-all of the
gradient, as Megatron-Core's ``_AllToAll`` (``megatron/core/tensor_parallel/mappings.py``) and
``torch.distributed._functional_collectives.all_to_all_single_autograd`` do it; the gathers and
``index_add`` are autograd's own.

The same collective runs on every backend: gloo implements ``all_to_all_single`` with uneven
split sizes for host tensors (``ProcessGroupGloo::alltoall_base``, gloo's ``alltoallv``;
checked in torch 2.13 on 4 gloo ranks, ``tests/fsdp/test_expert_parallel.py``), NCCL for CUDA
tensors. No stand-in collective is needed for the CPU runner, so the CPU trials move tokens as a
GPU job does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Routing:
    """Where each of T tokens goes: its k experts, their weights (zero where dropped), which of
    the k assignments are kept, and the load-balancing loss of the routing."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor


@dataclass(frozen=True)
class Dispatch:
    """How one call moved its rows: sent to and received from each ep rank, and the rows each
    local expert computed."""

    input_splits: list[int]
    output_splits: list[int]
    rows_per_local_expert: list[int]


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Rows ``input_splits[r]`` of ``x`` go to ep rank r; ``output_splits[r]`` rows come from it."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_rows`` whose backward sends each gradient row back to where its row came
    from: the same collective with the split sizes swapped (Megatron-Core's ``_AllToAll``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def exchange_counts(rows_per_expert: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[ep, E / ep]``: the rows each ep rank sends to each of this rank's experts (an even
    all-to-all of the E counts: block r of every rank's counts goes to rank r)."""
    received = torch.empty_like(rows_per_expert)
    dist.all_to_all_single(received, rows_per_expert.contiguous(), group=group)
    return received.view(dist.get_world_size(group), -1)


def run_local_experts(rows: torch.Tensor, counts: list[list[int]], experts: nn.ModuleDict) -> torch.Tensor:
    """The received ``rows`` (``counts[source][expert]`` of them, source-major) through this
    rank's experts: regrouped expert-major, one call per expert, returned in arrival order."""
    starts: list[list[int]] = []
    at = 0
    for per_source in counts:
        starts.append([])
        for n in per_source:
            starts[-1].append(at)
            at += n
    blocks = [torch.arange(starts[s][e], starts[s][e] + counts[s][e], device=rows.device)
              for e in range(len(experts)) for s in range(len(counts))]
    order = torch.cat(blocks) if blocks else torch.empty(0, dtype=torch.long, device=rows.device)
    per_expert = [sum(per_source[e] for per_source in counts) for e in range(len(experts))]
    grouped = torch.split(rows[order], per_expert)
    computed = torch.cat([expert(block) for expert, block in zip(experts.values(), grouped, strict=True)])
    arrival = torch.empty_like(order)
    arrival[order] = torch.arange(order.numel(), device=rows.device)
    return computed[arrival]


def expert_parallel_forward(x: torch.Tensor, routing: Routing, experts: nn.ModuleDict,
                            group: dist.ProcessGroup) -> tuple[torch.Tensor, Dispatch]:
    """The routed experts' output for this rank's tokens ``x`` (``[T, hidden]``), computed where
    the experts live (see the module docstring), and how the rows moved."""
    ep = dist.get_world_size(group)
    tokens, k = routing.experts.shape
    num_experts = len(experts) * ep
    kept = routing.kept.reshape(-1)
    token = torch.arange(tokens, device=x.device).repeat_interleave(k)[kept]
    expert_of = routing.experts.reshape(-1)[kept]
    weight = routing.weights.reshape(-1)[kept]
    order = torch.argsort(expert_of, stable=True)
    token, weight = token[order], weight[order]
    rows_per_expert = torch.bincount(expert_of, minlength=num_experts)
    with torch.no_grad():
        counts = exchange_counts(rows_per_expert, group)
    input_splits = rows_per_expert.view(ep, -1).sum(dim=1).tolist()
    output_splits = counts.sum(dim=1).tolist()
    received: torch.Tensor = AllToAll.apply(x[token], output_splits, input_splits, group)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    computed = run_local_experts(received, counts.tolist(), experts)
    returned: torch.Tensor = AllToAll.apply(computed, input_splits, output_splits, group)  # type: ignore[no-untyped-call]
    out = torch.zeros_like(x).index_add(0, token, returned * weight[:, None])
    return out, Dispatch(input_splits, output_splits, counts.sum(dim=0).tolist())
