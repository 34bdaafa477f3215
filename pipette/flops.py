"""FLOPs of one training step, counted from what is computed.

A matmul of an ``n x k`` input by a ``k x m`` weight is ``2 n k m`` FLOPs (Narayanan et al.
2021, appendix). Per token and per linear layer of ``i x o`` weights:

* forward ``2 i o``;
* backward: the activation gradient ``2 i o`` always (the layers below need it), the weight
  gradient ``2 i o`` only when the weight trains. Full fine-tuning: backward = 2 x forward,
  the familiar ``6N``. LoRA (Hu et al. 2021): the frozen base gets no weight gradient, so
  backward = 1 x forward for the base, and each adapter ``B A`` (``r (i + o)`` parameters)
  adds ``2 r (i + o)`` forward, the same for its activation gradient and for its weight
  gradient.

A model with experts: the attention's matrices and, per MoE layer, the router, the shared experts
and the ``top_k`` routed experts a token goes through (``pipette.moe_count.active_linear_weights``),
not the idle ones.

Attention (no weights): the scores ``Q K^T`` and the context ``P V``, ``2 x 2 s h`` per token
per layer for Llama (at the query-key and value widths, over a sliding window's keys where a layer
has one: ``pipette.moe_count.attention_core_flops``), counted whole as PaLM and Megatron-LM count
it (``causal=False``), or half, as a causal kernel that skips the masked blocks computes it
(FlashAttention; Dao et al. 2022, ``causal=True``); its backward is ``2 x`` its forward (the
gradients of both inputs of both matmuls).

**Model FLOPs** are those: forward and backward without recomputation, the numerator of the
model FLOPs utilisation (MFU) of PaLM (Chowdhery et al. 2022, app. B) and Megatron-LM
(Korthikanti et al. 2022, sec. 6), with the weight gradients a LoRA run really computes.
**Hardware FLOPs** add the recomputation (Korthikanti et al. 2022, sec. 5): a full
recomputation re-runs the forward in the backward, a selective one the attention core.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipette import moe_count
from pipette.model import ModelSpec
from pipette.training import TrainingSpec


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step over all devices."""

    model: float
    hardware: float
    #: the forward alone (for reference: full fine-tuning's model FLOPs are 3 x this)
    forward: float


def per_token(model: ModelSpec, training: TrainingSpec, recompute: str = "none",
              *, causal: bool = False, span: int | None = None) -> StepFlops:
    """FLOPs per token of one training step (forward, backward, recomputation); ``span``: the keys a
    query's document holds where the attention keeps to packed documents (default: the sequence)."""
    lora = training.lora if training.is_lora else None
    targets = set(lora.targets) if lora is not None else set()
    shapes = model.linear_shapes()
    if model.moe is None:
        linear = model.layers * float(sum(i * o for i, o in shapes.values()))
    else:  # the attention's matrices and the experts a token is routed to, not all of them
        linear = moe_count.active_linear_weights(model)
    adapters = model.layers * float(sum(lora.rank * (i + o) for name, (i, o) in shapes.items() if name in targets)
                                    if lora else 0)
    attention = moe_count.attention_core_flops(model, span or training.seq_len, causal=causal)  # every layer's
    head = model.hidden * model.vocab

    layers_fwd = 2.0 * linear + 2.0 * adapters + attention
    if lora is None:
        layers_bwd = 4.0 * linear + 2.0 * attention
        head_bwd = 4.0 * head
    else:
        layers_bwd = 2.0 * linear + 4.0 * adapters + 2.0 * attention
        head_bwd = 2.0 * head  # the frozen head: its input's gradient only
    fwd = layers_fwd + 2.0 * head
    bwd = layers_bwd + head_bwd
    extra = 0.0
    if recompute == "full":
        extra = layers_fwd
    elif recompute == "selective":
        extra = attention
    return StepFlops(model=fwd + bwd, hardware=fwd + bwd + extra, forward=fwd)


def per_step(model: ModelSpec, training: TrainingSpec, recompute: str = "none", *, causal: bool = False,
             span: int | None = None) -> StepFlops:
    """FLOPs of one optimizer step (``global_batch x seq_len`` tokens)."""
    f = per_token(model, training, recompute, causal=causal, span=span)
    tokens = float(training.tokens_per_step)
    return StepFlops(model=f.model * tokens, hardware=f.hardware * tokens, forward=f.forward * tokens)


__all__ = ["StepFlops", "per_step", "per_token"]
