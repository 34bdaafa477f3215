"""Build the part of the model one rank holds, on its device, in the training dtype.

The whole model is first made on the meta device (shapes only, no memory); adapters are added
and the tensor-parallel layers are cut into this rank's shards while still on meta
(``workers.rank.tp_shard``, ``workers.rank.lora``); a pipeline rank keeps only its stage's layers
(``workers.rank.pipe_model.stage_modules``, DeepSpeed's own partition). Only then does each
parameter the rank holds get its values, directly on the device: the rank's rows or columns
of a local checkpoint (``workers.rank.checkpoint``), or seeded initial values that do not depend on
the sharding (``workers.rank.init``). So a rank's memory is its shard plus one tile, never the
model; a trial of llama2-70b needs no host that can hold 280 GB.

ZeRO-3 goes further: each block (the embedding, each decoder layer, the head) is partitioned
over the data-parallel ranks as soon as it has its values (``deepspeed.zero.Init(module=...)``),
so no rank ever holds more than its partition plus one block.

What a rank holds is what ``pipette.memory`` counts for it: its stage's layers, linear layers
and the vocabulary split over tp, norms replicated, LoRA adapters beside the frozen base.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipette.stacks import rank_layout
from workers.rank.init import init_for, initial_values
from workers.spec import TrialSpec

#: prefix PEFT puts before the base model's parameter names
PEFT_PREFIX = "base_model.model."


@dataclass
class RankModel:
    """What one rank built."""

    #: what ``deepspeed.initialize`` gets: the (PEFT-wrapped) model, or this rank's pipeline stage
    module: nn.Module
    #: the Hugging Face model inside it (its recomputation switches)
    hf: Any
    pipeline: bool
    #: the loss over this rank's logits (vocabulary-sharded under tensor parallelism)
    loss_fn: Any
    #: the tensor-parallel LoRA adapters to hook onto their layers once the group exists
    tp_lora: list[tuple[nn.Module, str]] = field(default_factory=list)
    #: the vocabulary-parallel loss, whose group is set with the layers'
    vocab_loss: Any = None


def tag_names(module: nn.Module, strip: str = "") -> None:
    """Record each parameter's name in the full model and its full shape, once (a parameter
    shared by two modules, a tied embedding, keeps its first name)."""
    for name, p in module.named_parameters():
        if not hasattr(p, "pipette_name"):
            p.pipette_name = name[len(strip):] if strip and name.startswith(strip) else name  # type: ignore[attr-defined]
            p.pipette_full_shape = tuple(p.shape)  # type: ignore[attr-defined]


@dataclass
class Prepared:
    """The rank's model on the meta device: adapters added, tensor-parallel layers sharded."""

    module: nn.Module
    hf: Any
    tp_lora: list[tuple[nn.Module, str]]
    vocab_loss: Any
    #: the pipeline's layers (pp > 1), else None
    layers: list[Any] | None
    std: float


def prepare(trial: TrialSpec, rank: int, dtype: torch.dtype) -> Prepared:
    """The rank's model with shapes only (meta device): what it will hold, and nothing yet."""
    from workers.rank.hf_model import build_llama
    from workers.rank.lora import add_peft_lora, add_tp_lora
    from workers.rank.pipe_model import pipeline_layers
    from workers.rank.tp_shard import shard_layers, shard_vocabulary

    c, t = trial.config, trial.training
    tp_index = rank_layout(c, trial.stack).index(rank, "tp")
    # an MoE model's experts as its Hugging Face family builds them: DeepSpeed's AutoEP replaces them
    model = build_llama(trial.model, device="meta", dtype=dtype, seq_len=t.seq_len, experts=True)
    tag_names(model)
    hf: Any = model
    module: nn.Module = model
    tp_lora: list[tuple[nn.Module, str]] = []
    if t.is_lora and t.lora is not None:
        if c.tp > 1:
            tp_lora = add_tp_lora(model, t.lora, c.tp, tp_index)
        else:
            module = add_peft_lora(model, t.lora)
            hf = module.base_model.model  # type: ignore[union-attr]
            tag_names(module, strip=PEFT_PREFIX)
    vocab_loss = None
    if c.tp > 1:
        shard_layers(hf, c.tp, tp_index)
        vocab_loss = shard_vocabulary(hf, c.tp, tp_index)
    layers = pipeline_layers(hf) if c.pp > 1 else None
    return Prepared(module, hf, tp_lora, vocab_loss, layers, float(model.config.initializer_range))


def held_modules(prepared: Prepared, trial: TrialSpec, rank: int) -> list[nn.Module]:
    """The modules whose parameters this rank holds: its pipeline stage's, or the whole (sharded) model."""
    from workers.rank.pipe_model import stage_modules

    if prepared.layers is None:
        return [prepared.module]
    pp_index = rank_layout(trial.config, trial.stack).index(rank, "pp")
    return stage_modules(prepared.layers, trial.config.pp, pp_index)


def build_rank_model(trial: TrialSpec, rank: int, device: torch.device, dtype: torch.dtype,
                     ds_config: dict[str, Any] | None = None) -> RankModel:
    """This rank's model for ``trial``, with values only where the rank holds them."""
    from workers.rank.pipe_model import lm_loss, pipeline_module
    from workers.rank.tp_shard import set_groups

    c = trial.config
    prep = prepare(trial, rank, dtype)
    source = _source(trial)
    loss_fn: Any = prep.vocab_loss if prep.vocab_loss is not None else lm_loss
    made: dict[int, nn.Parameter] = {}  # one parameter shared by two modules (tied) gets one value

    def fill(modules: Iterable[nn.Module]) -> None:
        materialize(modules, device, dtype, trial.seed, prep.std, source, made)

    if prep.layers is not None:
        fill(held_modules(prep, trial, rank))
        module = pipeline_module(prep.layers, rank_layout(c, trial.stack), recompute_layers=c.recompute == "full",
                                 loss_fn=loss_fn)
        if c.tp > 1:
            set_groups(module, module.mpu().get_slice_parallel_group(), prep.vocab_loss)
        return RankModel(module, prep.hf, True, loss_fn, prep.tp_lora, prep.vocab_loss)
    if c.zero_stage == 3 and c.tp == 1 and ds_config is not None:
        # (under tp > 1 a rank holds 1/tp of the model already; DeepSpeed partitions that shard
        # over the data-parallel group at initialize)
        _fill_partitioned(prep.module, prep.hf, fill, ds_config, dtype)
    else:
        fill([prep.module])
    return RankModel(prep.module, prep.hf, False, loss_fn, prep.tp_lora, prep.vocab_loss)


def _source(trial: TrialSpec) -> Any:
    if trial.checkpoint is None:
        return None
    from workers.rank.checkpoint import Checkpoint

    return Checkpoint(trial.checkpoint)


def _fill_partitioned(module: nn.Module, hf: Any, fill: Any, ds_config: dict[str, Any], dtype: torch.dtype) -> None:
    """ZeRO-3: give each block its values and partition it at once over the data-parallel ranks."""
    import deepspeed

    inner = hf.model
    blocks: list[nn.Module] = [inner.embed_tokens, *inner.layers, inner.norm, hf.lm_head]
    for block in blocks:
        fill([block])
        # Constructed with a module, Init converts its parameters to ZeRO-3 partitioned ones
        # (over the world group: tp = pp = 1 here, so it is the data-parallel group).
        deepspeed.zero.Init(module=block, config_dict_or_path=ds_config, dtype=dtype)
    fill([module])  # what is left (rotary buffers)


def materialize(modules: Iterable[nn.Module], device: torch.device, dtype: torch.dtype, seed: int, std: float,
                source: Any = None, made: dict[int, nn.Parameter] | None = None) -> None:
    """Give every meta parameter under ``modules`` its values on ``device`` in ``dtype``: its part
    of the checkpoint ``source`` when that holds it, else its seeded initial values
    (``workers.rank.init``); and rebuild the rotary-embedding buffers there."""
    made = made if made is not None else {}
    for root in modules:
        for owner in root.modules():
            for leaf, p in list(owner._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                new = made.get(id(p))
                if new is None:
                    new = made[id(p)] = _values(p, device, dtype, seed, std, source)
                owner._parameters[leaf] = new
            for child_name, child in list(owner.named_children()):
                if is_rotary(child) and any(b.is_meta for b in child.buffers()):
                    with torch.device(device):
                        setattr(owner, child_name, type(child)(child.config))


def is_rotary(module: nn.Module) -> bool:
    """Whether ``module`` is a family's rotary embedding (``LlamaRotaryEmbedding``, ``Qwen3RotaryEmbedding``,
    ...: each is built from the model's config alone)."""
    return type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config")


def _values(p: nn.Parameter, device: torch.device, dtype: torch.dtype, seed: int, std: float,
            source: Any) -> nn.Parameter:
    name: str = getattr(p, "pipette_name", "")
    if not name:
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no name to initialise it by")
    full = tuple(getattr(p, "pipette_full_shape", p.shape))
    rows, cols = getattr(p, "pipette_rows", None), getattr(p, "pipette_cols", None)
    if source is not None and name in source:
        values = source.read(name, rows, cols).to(device=device, dtype=dtype)
    else:
        values = initial_values(name, full, init_for(name, full, std), seed, rows, cols, device, dtype)
    if tuple(values.shape) != tuple(p.shape):
        raise RuntimeError(f"{name}: built {tuple(values.shape)} for a parameter of shape {tuple(p.shape)}")
    new = nn.Parameter(values, requires_grad=p.requires_grad)
    for key, value in vars(p).items():
        setattr(new, key, value)
    return new


def held_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its ZeRO-3 partition where partitioned)."""
    total = 0
    for p in module.parameters():
        t = getattr(p, "ds_tensor", None)
        t = t if t is not None else p
        total += t.numel() * t.element_size()
    return total
