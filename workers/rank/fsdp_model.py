"""The Hugging Face Llama as pipeline stages, built on the meta device and given its values only
once it is sharded: each rank holds its shards and, for a moment, one whole parameter.

torchtitan builds its model on the meta device, splits it into stages (``pipeline_llama_manual_
split``: each stage keeps its own layers and drops the rest), applies TP, activation
checkpointing and FSDP to each stage, and only then calls ``to_empty`` and ``init_weights``
(``torchtitan/train.py``). Here the same order, on ``workers.rank.hf_model.build_llama``'s model, and
the values are ``workers.rank.init``'s (the DeepSpeed runner's: the same parameter name and seed give
the same values, however the parameter is sharded), or a local checkpoint's: for each parameter
the whole tensor is drawn or read on the rank's device and ``distribute_tensor`` (with
``src_data_rank=None``: no communication) keeps the part the rank holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.rank.init import init_for, initial_values

if TYPE_CHECKING:
    from workers.rank.moe_layer import MoeOptions

#: what ``checkpoint_wrapper`` puts into the names of the parameters it wraps
WRAPPED = "_checkpoint_wrapped_module."
#: prefix PEFT puts before the base model's parameter names (``workers.rank.build.PEFT_PREFIX``)
PEFT_PREFIX = "base_model.model."


class LlamaStage(nn.Module):
    """A run of consecutive decoder layers of a ``LlamaForCausalLM``, with the embedding on the
    first stage and the final norm and LM head on the last; the whole model when it is both.

    The layers keep their index as their name (``layers.<i>``), as torchtitan's ``ModuleDict``
    does, so a parameter's name says which layer it is on every stage. The attention is causal
    without a mask (SDPA's ``is_causal``: ``transformers``' ``sdpa_attention_forward``)."""

    def __init__(self, hf: Any, layer_ids: range, first: bool, last: bool, seq_len: int):
        super().__init__()
        inner = hf.model
        self.embed_tokens: nn.Module | None = inner.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layer_ids})
        self.norm: nn.Module | None = inner.norm if last else None
        self.lm_head: nn.Module | None = hf.lm_head if last else None
        self.rotary_emb = inner.rotary_emb
        self.config = hf.config
        self.seq_len = seq_len
        #: this rank's global positions under context parallelism (its chunks of the sequence,
        #: ``workers.rank.context_parallel.apply_context_parallel``); None: the whole sequence
        self.position_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last stage) out.
        Under sequence parallelism the hidden states between layers hold this rank's part of the
        sequence, so the positions are the whole sequence's, from ``seq_len``."""
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        if self.position_ids is not None:
            positions = self.position_ids.to(h.device).unsqueeze(0)
        else:
            positions = torch.arange(self.seq_len, device=h.device).unsqueeze(0)
        rotary = self.rotary_emb(h, positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


@dataclass
class MetaModel:
    """The whole model on the meta device, adapters added, every parameter named."""

    hf: Any
    #: the initialisation scale of the linear weights (``LlamaConfig.initializer_range``)
    std: float


def meta_model(model: ModelSpec, training: TrainingSpec, moe: MoeOptions | None = None) -> MetaModel:
    """The Llama on the meta device in fp32 (FSDP2 keeps fp32 master weights and casts for
    compute), PEFT's LoRA added before any sharding; each parameter tagged with its name in the
    full model (``workers.rank.build.tag_names``), the key of its initial values. With ``moe``
    each layer's MLP is an MoE feed-forward holding all its experts
    (``workers.rank.moe_layer.use_moe``; ``shard_experts`` keeps a rank's block); None: dense."""
    from workers.rank.build import tag_names
    from workers.rank.hf_model import build_llama

    hf: Any = build_llama(model, device="meta", dtype=torch.float32, seq_len=training.seq_len)
    if moe is not None:
        from workers.rank.moe_layer import use_moe

        use_moe(hf, moe)
    tag_names(hf)
    if training.is_lora and training.lora is not None:
        from workers.rank.lora import add_peft_lora

        peft = add_peft_lora(hf, training.lora)
        tag_names(peft, strip=PEFT_PREFIX)
        hf = peft.base_model.model  # type: ignore[union-attr]  # PEFT's tuner holds the Llama
    return MetaModel(hf, float(hf.config.initializer_range))


def stage_layers(layers: int, stages: int) -> list[range]:
    """Consecutive layers per stage, the earlier stages one heavier when uneven."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def build_stages(meta: MetaModel, stage_ids: list[int], stages: int, seq_len: int) -> list[LlamaStage]:
    """This rank's stages (still on meta) of a model cut into ``stages``."""
    split = stage_layers(len(meta.hf.model.layers), stages)
    return [LlamaStage(meta.hf, split[s], s == 0, s == stages - 1, seq_len) for s in stage_ids]


@dataclass(frozen=True)
class ParamInfo:
    """What sharding forgets of a parameter: its name in the full model, its full shape, and
    whether it trains."""

    name: str
    full_shape: tuple[int, ...]
    trainable: bool


def parameter_names(module: nn.Module) -> dict[str, ParamInfo]:
    """Each parameter of ``module`` by its name there; read before sharding, which makes new
    parameters without the tags."""
    return {fqn: ParamInfo(p.pipette_name, tuple(p.pipette_full_shape), p.requires_grad)  # type: ignore[attr-defined]
            for fqn, p in module.named_parameters()}


def restore_trainable(stage: nn.Module, names: dict[str, ParamInfo]) -> None:
    """Freeze again what PEFT froze: torch 2.13's ``SequenceParallel`` replaces a norm's weight by
    a new ``nn.Parameter`` without passing ``requires_grad`` (``_replicate_module_fn`` in
    ``torch/distributed/tensor/parallel/style.py``; ``ColwiseParallel`` passes it), so under TP
    with LoRA the frozen norms trained (measured: the loss left the single device's by 0.05
    nats after one step)."""
    for fqn, p in stage.named_parameters():
        p.requires_grad_(names[fqn.replace(WRAPPED, "")].trainable)


@torch.no_grad()
def materialize(stage: LlamaStage, names: dict[str, ParamInfo], device: torch.device, init: torch.device,
                seed: int, std: float, checkpoint: str | None = None) -> None:
    """Give the sharded stage its values: ``to_empty`` on ``init`` (the host where FSDP2
    offloads, as torchtitan's ``init_device``), then each parameter's part of its whole values,
    drawn on ``device``; rebuild the rotary buffers there."""
    stage.to_empty(device=init)
    source = _checkpoint(checkpoint)
    for fqn, p in stage.named_parameters():
        info = names[fqn.replace(WRAPPED, "")]
        name, full = info.name, info.full_shape
        if source is not None and name in source:
            values = source.read(name, None, None).to(device=device, dtype=torch.float32)
        else:
            values = initial_values(name, full, init_for(name, full, std), seed, device=device)
        if tuple(values.shape) != full:
            raise RuntimeError(f"{name}: {tuple(values.shape)} values for a parameter of shape {full}")
        if isinstance(p, DTensor):
            values = distribute_tensor(values, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(values)
        else:
            p.copy_(values)
    with torch.device(device):
        stage.rotary_emb = type(stage.rotary_emb)(stage.config)  # the family's (Llama's, Qwen3's, ...)


def _checkpoint(path: str | None) -> Any:
    if path is None:
        return None
    from workers.rank.checkpoint import Checkpoint

    return Checkpoint(path)


def held_param_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the parameter shards this rank holds."""
    total = 0
    for module in modules:
        for p in module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 (``workers.rank.pipe_model.lm_loss``). Logits sharded
    over the vocabulary (a DTensor, under TP) need ``loss_context``'s loss parallelism around the
    forward and backward; the loss comes back as this rank's plain tensor (every tp rank's the same)."""
    loss = nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss


def loss_context(tp: int) -> contextlib.AbstractContextManager[None]:
    """PyTorch's ``loss_parallel`` where the LM head's logits are sharded over tp ranks, else nothing."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if tp > 1 else contextlib.nullcontext()
