"""Tensor parallelism, activation checkpointing and FSDP2 on one pipeline stage, in torchtitan's
order (``torchtitan/models/llama3/infra/parallelize.py``: ``apply_tp``, ``apply_ac``,
``apply_fsdp``): TP first, on the tp mesh; checkpointing wraps each decoder layer; FSDP2 last,
over the data-parallel mesh, so a parameter ends a 2-D DTensor (dp x tp) where both apply.

* TP (PyTorch's tutorial "Large Scale Transformer model training with Tensor Parallel", and
  ``apply_tp``): q, k, v, gate and up column-parallel, o and down row-parallel with their output
  scattered over the sequence; the norms sequence-parallel (``SequenceParallel``), the attention
  and MLP inputs gathered back (``PrepareModuleInput``); Qwen3's q/k norms over the rank's heads
  (``QK_NORMS``); Qwen2's q/k/v biases cut with their columns; the embedding row-parallel (vocabulary
  rows) with its output scattered over the sequence, the LM head column-parallel with its
  logits left sharded over the vocabulary (a DTensor) for loss parallelism (torchtitan's
  ``loss_parallel``: each tp rank holds and differentiates its 1/tp of the logits, where gathering
  them held 3 fp32 copies of the whole vocabulary's on every rank, 11.7 GiB at Llama 3 70B and
  8192 tokens; traced before and after: docs/results.md, "Traced memory").
* PEFT's LoRA layers under TP (PEFT knows nothing of DTensor, so each part is sharded here):
  the base layer as the plain layer would be; on a column-parallel layer ``A`` replicated and
  ``B`` column-parallel, so ``B A x`` is this rank's output columns; on a row-parallel layer
  ``A`` row-parallel (its rank-r output all-reduced) and ``B`` replicated, its output cut to
  this rank's part of the sequence, as the base layer's is.
* Activation checkpointing (``apply_ac``): ``full`` wraps each layer in ``checkpoint_wrapper``;
  ``selective`` is torchtitan's per-op policy (``_apply_op_sac``): the outputs of matmuls (every
  other one), attention and reductions are saved, everything else is recomputed.
* FSDP2 (``torch.distributed.fsdp.fully_shard``, its docs and ``apply_fsdp``): each decoder layer,
  then the stage; HSDP when the mesh is 2-D (replicate x shard); ``MixedPrecisionPolicy`` with
  the training dtype for parameters and fp32 for the gradient reduction; ``CPUOffloadPolicy``.
* Expert parallelism (torchtitan's ``apply_fsdp`` for MoE): with ``ep > 1`` each rank holds its
  block of experts (``moe_layer.shard_experts``, before this), and FSDP2 shards each of them over
  the expert mesh's ``efsdp`` (x ``dp_replicate``: HSDP) before the layer is sharded over dp, so
  the layer's own group leaves them out. The runner's experts are separate modules called one by
  one (torchtitan's ``GroupedExperts`` is one), so each expert is its own FSDP2 unit: a unit's
  all-gather runs when its module is called, and ``run_local_experts`` calls every local expert
  at every forward, rows or none. Their gradient reduction divides by the dense layers' data
  ranks, not the experts' (``set_gradient_divide_factor``; torchtitan issue #1551): an expert's
  gradient already sums the ep group's tokens, which the all-to-all's backward brought back.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workers.fsdp_spec import FsdpPlan
from workers.rank.fsdp_model import LlamaStage, ParamInfo, restore_trainable

#: each projection of a decoder layer and how TP cuts it (Megatron-LM's column/row split)
PROJECTIONS: dict[str, str] = {
    "self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
    "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row",
}


#: the per-head RMSNorms of q and k (Qwen3's attention, ``workers.rank.hf_model``): a column-parallel q or
#: k projection leaves this rank its heads, viewed as (batch, sequence, heads, head size); the norm's
#: weight (one head size wide) is replicated over tp and its input sharded over the heads (dim 2), as
#: torchtitan's Qwen3 plan does (``SequenceParallel(sequence_dim=2)``), so the weight is a DTensor whose
#: gradient, a partial sum over this rank's heads, is summed over the tp ranks; a plain parameter would
#: keep each rank's partial gradient and the replicas would drift apart
QK_NORMS = ("q_norm", "k_norm")


def apply_tp(stage: LlamaStage, tp_mesh: DeviceMesh) -> None:
    """Shard the stage over ``tp_mesh`` with sequence parallelism (torchtitan's ``apply_tp``)."""
    ends: dict[str, Any] = {}
    if stage.embed_tokens is not None:
        ends["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.norm is not None:
        ends["norm"] = SequenceParallel()
    if stage.lm_head is not None:
        ends["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    if ends:
        parallelize_module(stage, tp_mesh, ends)
    for layer in stage.layers.values():
        plan: dict[str, Any] = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
        for norm in QK_NORMS:
            if hasattr(layer.self_attn, norm):  # Qwen3's: over each head, so over this rank's heads
                plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        for path, kind in PROJECTIONS.items():
            style = ColwiseParallel() if kind == "column" else RowwiseParallel(output_layouts=Shard(1))
            module = layer.get_submodule(path)
            if isinstance(module, nn.Linear):
                plan[path] = style
            else:  # a PEFT LoRA layer: its base layer as the plain one, its adapters below
                plan[f"{path}.base_layer"] = style
                _shard_lora(module, kind, tp_mesh)
        parallelize_module(layer, tp_mesh, plan)


def _shard_lora(lora: nn.Module, kind: str, tp_mesh: DeviceMesh) -> None:
    """Shard PEFT's adapters of one layer (``lora_A`` and ``lora_B``, a ``ModuleDict`` of each
    adapter's ``nn.Linear``) to match the base layer's TP split (see the module docstring)."""
    for name in lora.lora_A:  # type: ignore[union-attr]
        a, b = cast(nn.Module, lora.lora_A[name]), cast(nn.Module, lora.lora_B[name])  # type: ignore[index]
        if kind == "column":
            distribute_module(a, tp_mesh)  # replicated: its output is the whole rank-r projection
            parallelize_module(b, tp_mesh, ColwiseParallel())
        else:
            parallelize_module(a, tp_mesh, RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate(),
                                                           use_local_output=False))
            distribute_module(b, tp_mesh)
            parallelize_module(b, tp_mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                               desired_output_layouts=Shard(1)))


def _op_sac_policy() -> Any:
    """torchtitan's per-op selective checkpointing policy (``_apply_op_sac``): save what is costly
    to recompute (matmuls, every other one; attention; reductions), recompute the rest. One
    policy per checkpointed call, as torchtitan makes it: with a count kept across calls, a
    layer of an odd number of matmuls saves a different set at each call, and a recompute whose
    count no longer matches its forward's takes another op's saved output (an H100 run's shape
    error, 2026-11-28: tests/fsdp/test_fsdp_sac.py)."""
    from torch.utils.checkpoint import CheckpointPolicy

    ops = torch.ops
    save = {ops.aten.mm.default, ops.aten._scaled_dot_product_efficient_attention.default,
            ops.aten._scaled_dot_product_flash_attention.default,
            ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            ops.aten._scaled_dot_product_cudnn_attention.default,
            ops._c10d_functional.reduce_scatter_tensor.default, ops.aten.max.default}
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == ops.aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_context() -> Any:
    """The forward and recompute contexts of one checkpointed call, with a fresh policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_op_sac_policy())  # type: ignore[no-untyped-call]


def apply_ac(stage: LlamaStage, recompute: str) -> None:
    """Wrap each decoder layer for activation checkpointing (none, full, or per-op selective)."""
    if recompute == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key, layer in list(stage.layers.items()):
        if recompute == "full":
            stage.layers[key] = checkpoint_wrapper(layer, preserve_rng_state=False)
        else:
            stage.layers[key] = checkpoint_wrapper(layer, context_fn=_op_sac_context, preserve_rng_state=False)


def apply_fsdp(stage: LlamaStage, dp_mesh: DeviceMesh, plan: FsdpPlan, device: torch.device,
               expert_mesh: DeviceMesh | None = None) -> None:
    """``fully_shard`` each decoder layer, then the stage (its embedding, norm and head), over
    ``dp_mesh`` (1-D: FSDP; 2-D replicate x shard: HSDP); with ``expert_mesh`` (ep > 1) the experts
    first, over its expert data-parallel ranks (``shard_experts_fsdp``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from workers.rank.hf_model import TORCH_DTYPES

    options: dict[str, Any] = {
        "mesh": dp_mesh, "reshard_after_forward": plan.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[plan.dtype], reduce_dtype=torch.float32),
        # pinned host memory needs a CUDA context: on a CPU device the offload has nothing to pin
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if plan.offload else OffloadPolicy(),
    }
    if expert_mesh is not None:
        shard_experts_fsdp(stage, expert_mesh, plan, dp_mesh.size(), options, device.type == "cuda")
    for layer in stage.layers.values():
        fully_shard(layer, **options)
    fully_shard(stage, **options)


def shard_experts_fsdp(stage: LlamaStage, expert_mesh: DeviceMesh, plan: FsdpPlan, divide_factor: int,
                       options: dict[str, Any], on_cuda: bool) -> None:
    """``fully_shard`` every expert of the stage over the expert data-parallel mesh (``efsdp``, with
    ``dp_replicate`` for HSDP), its gradients divided by ``divide_factor`` (the dense data ranks)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from workers.rank.moe_layer import MoeFeedForward

    edp = expert_mesh["dp_replicate", "efsdp"] if plan.dp_replicate > 1 else expert_mesh["efsdp"]
    # FSDP2 (torch 2.13, _fsdp_collectives.foreach_reduce) reduce-scatters with a custom factor as
    # NCCL's PREMUL_SUM, which gloo lacks: there it sums and divides after. Over one shard rank it
    # copies, divided by the factor, and would divide again after a forced sum (measured: expert
    # gradients ep^2 too small at ep=4): so the forced sum only where a reduce-scatter runs on gloo
    sum_then_divide = not on_cuda and expert_mesh["efsdp"].size() > 1
    for module in stage.modules():
        if isinstance(module, MoeFeedForward):
            for expert in module.experts.values():
                fully_shard(expert, **(options | {"mesh": edp}))
                unit = cast(FSDPModule, expert)
                unit.set_gradient_divide_factor(float(divide_factor))
                if sum_then_divide:
                    unit.set_force_sum_reduction_for_comms(True)


def dp_mesh_of(mesh: DeviceMesh, plan: FsdpPlan) -> DeviceMesh:
    """The mesh FSDP2 shards over: (dp_replicate, dp_shard) for HSDP and NO_SHARD, else dp_shard;
    under ``plan.shard_cp`` the shard dimension is ``dp_shard x cp`` flattened (torchtitan's
    ``mesh["dp_shard", "cp"]._flatten("dp_shard_cp")``: the cp ranks hold the same parameters, so
    they shard them as data-parallel ranks do; ``_flatten`` of one name again returns the same mesh)."""
    shard = "dp_shard"
    if plan.shard_cp:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        shard = "dp_shard_cp"
    if plan.dp_replicate > 1:
        return mesh["dp_replicate", shard]
    return mesh[shard]


def parallelize(stage: LlamaStage, mesh: DeviceMesh, plan: FsdpPlan, device: torch.device,
                names: dict[str, ParamInfo], expert_mesh: DeviceMesh | None = None) -> None:
    """TP, then activation checkpointing, then FSDP2 (torchtitan's ``parallelize_llama``);
    ``names``: the stage's parameters as they were before (``fsdp_model.parameter_names``);
    ``expert_mesh``: the experts' mesh under expert parallelism (``FsdpPlan.expert_mesh``)."""
    if plan.tp > 1:
        apply_tp(stage, mesh["tp"])
        restore_trainable(stage, names)  # before FSDP2 groups the parameters by it
    apply_ac(stage, plan.recompute)
    if plan.fsdp:
        apply_fsdp(stage, dp_mesh_of(mesh, plan), plan, device, expert_mesh)
