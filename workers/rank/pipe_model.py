"""The Llama model as a DeepSpeed ``PipelineModule``: embedding, decoder layers, head.

Each stage is a plain module whose input and output is one tensor (the hidden states),
as DeepSpeed's pipeline engine passes activations between stages. Rotary embeddings are
recomputed per layer from the sequence length (cheap, and it keeps the interface one
tensor); attention is causal through SDPA with no mask.

A model with tied embeddings (one matrix for the input embedding and the LM head) keeps
that matrix in one ``TiedEmbedding`` module that DeepSpeed places on the first and on the
last stage (``TiedLayerSpec``): it broadcasts the weights from the first stage at start and
all-reduces the two stages' gradients after every backward pass
(``PipelineEngine._exec_reduce_tied_grads``), so both copies stay one parameter, as in
Megatron-LM's shared word embeddings (Narayanan et al. 2021, sec. 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.pipe.topology import ProcessTopology
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from pipette.layout import Layout
from pipette.stacks import stack_layout
from workers.rank.lora import copy_to_tp


class EmbedStage(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out


class DecoderStage(nn.Module):
    def __init__(self, layer: LlamaDecoderLayer, rotary: LlamaRotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        out: torch.Tensor = self.layer(hidden, position_embeddings=self.rotary(hidden, positions))
        return out


class HeadStage(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out


class NormStage(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(hidden)
        return out


class TiedEmbedding(nn.Module):
    """The tied embedding matrix (the HF model's ``embed_tokens``, which its ``lm_head`` shares)."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed


def tied_embed(module: TiedEmbedding, input_ids: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = module.embed(input_ids)
    return out


def tied_head(module: TiedEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    # A vocabulary-sharded embedding (tensor parallelism) makes this a column-parallel head:
    # its input's gradient is all-reduced over the group (workers.rank.tp_shard).
    group = getattr(module.embed, "group", None)
    x = copy_to_tp(hidden, group) if group is not None else hidden
    out: torch.Tensor = nn.functional.linear(x, module.embed.weight)
    return out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


Layer: TypeAlias = nn.Module | TiedLayerSpec


def pipeline_layers(model: LlamaForCausalLM) -> list[Layer]:
    """The model as the pipeline's sequence of layers: embedding, decoder layers, head."""
    inner = model.model
    tied = bool(model.config.tie_word_embeddings)
    head_weight = getattr(model.lm_head, "weight", None)
    if tied and head_weight is not inner.embed_tokens.weight:
        raise ValueError("the model says its embeddings are tied, but its LM head has its own weight")
    layers: list[Layer] = []
    if tied:
        layers.append(TiedLayerSpec("embed", TiedEmbedding, inner.embed_tokens, forward_fn=tied_embed,
                                    tied_weight_attr=["embed.weight"]))
    else:
        layers.append(EmbedStage(inner.embed_tokens))
    rotary = type(inner.rotary_emb)  # the family's (Llama's, Qwen3's, ...)
    layers += [DecoderStage(layer, rotary(model.config)) for layer in inner.layers]
    if tied:
        layers += [NormStage(inner.norm), TiedLayerSpec("embed", TiedEmbedding, inner.embed_tokens,
                                                        forward_fn=tied_head, tied_weight_attr=["embed.weight"])]
    else:
        layers.append(HeadStage(inner.norm, model.lm_head))
    return layers


def stage_bounds(layers: list[Layer], pp: int) -> list[int]:
    """Where each stage's layers begin (and the last ends): DeepSpeed's own ``type:DecoderStage``
    partition (decoder layers spread evenly), so a rank knows what it holds before it builds."""
    from deepspeed.runtime import utils as ds_utils

    weights = [1 if isinstance(layer, DecoderStage) else 0 for layer in layers]
    return list(ds_utils.partition_balanced(weights=weights, num_parts=pp))


def stage_modules(layers: list[Layer], pp: int, stage: int) -> list[nn.Module]:
    """The modules stage ``stage`` holds (a tied embedding as its embedding module)."""
    bounds = stage_bounds(layers, pp)
    out: list[nn.Module] = []
    for layer in layers[bounds[stage] : bounds[stage + 1]]:
        if isinstance(layer, TiedLayerSpec):
            out.append(layer.module_args[0])
        else:
            out.append(layer)
    return out


def topology(mesh: Layout) -> ProcessTopology:
    """DeepSpeed's process topology of ``mesh`` (the ``pipette`` stack's layout, ``pipette.layout``):
    its dimensions under DeepSpeed's axis names, outermost first, as ``PipeModelDataParallelTopology``
    builds them (axes pipe, data, model)."""
    return ProcessTopology(axes=stack_layout("pipette").axes_of(mesh), dims=list(mesh.sizes))


def pipeline_module(layers: list[Layer], mesh: Layout, recompute_layers: bool,
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss) -> PipelineModule:
    """Split ``layers`` into ``mesh``'s pp stages, decoder layers spread evenly (DeepSpeed's type-based
    partition, as ``stage_bounds``), on the ranks of ``mesh`` (``topology``). A stage keeps only its
    own layers."""
    return PipelineModule(
        layers=layers,
        topology=topology(mesh),
        loss_fn=loss_fn,
        partition_method="type:DecoderStage",
        activation_checkpoint_interval=1 if recompute_layers else 0,
        checkpointable_layers=["DecoderStage"],
        # Non-reentrant: with LoRA the embedding is frozen, so stage 0's first decoder layer gets
        # an input that does not require grad, and DeepSpeed's default (reentrant) checkpoint
        # then returns an output with no grad_fn ("element 0 of tensors does not require grad";
        # every pp>1 LoRA trial with full recomputation failed so in tests/benchmarks/real_tuning.py).
        activation_checkpoint_func=checkpointing.non_reentrant_checkpoint,
    )
