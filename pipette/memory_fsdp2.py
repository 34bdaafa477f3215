"""When one rank's memory peaks under FSDP2: the step's phases and the bytes alive in each.

FSDP2 (``torch.distributed.fsdp.fully_shard``; torch/distributed/fsdp/_fully_shard/) frees and
gathers parameters around each unit's forward and backward, so the unsharded parameters, the
reduce-scatter's copies, the gradients and the activations are not all alive at once. The rank's
peak is the heaviest of these moments (a trace of the runner, ``workers.rank.fsdp_trace``, sees
them; docs/results.md, "Traced memory"):

- **loss**: the last stage's loss backward, every layer's kept activations still alive, with the
  loss's fp32 copies of the logits. The training loop drops the d-byte logits before the backward
  (torchtitan's ``del pred``; the runner's ``lm_loss(stage(ids), ...)`` holds no name for them).
  With ``reshard_after_forward`` given to ``fully_shard`` (the runner, and torchtitan's
  ``apply_fsdp`` without a pipeline), the root unit (embedding, final norm, head) is resharded
  after the forward too: ``FSDPState._lazy_init`` keeps the root unsharded only where the flag was
  left to its default (``_auto_reshard_after_forward``). No layer is gathered then.
- **head**: the head's backward: the loss's fp32 copies freed, the logits' d-byte gradient alive,
  the root gathered again (its all-gather output and the unsharded parameters it is copied out
  to, ``foreach_all_gather_copy_out``, both alive while it runs).
- **layer**: a decoder layer's backward: the root held unsharded until the root's post-backward,
  the layer gathered and the next one prefetched (``FSDPParamGroup._backward_prefetch``: its
  all-gather output), one layer's reduce-scatter copies, its recomputed activations.
- **embed**: the embedding's backward, the last of the step's, where it makes its weight's
  gradient whole before cutting it to the rank's rows (tensor parallelism as DTensor runs it,
  ``MemoryOptions.tp_embedding_grad_whole``): the root gathered, its unsharded gradients, the
  layers' gradients (sharded, or a pipeline's accumulators) and the last layer's reduce-scatter
  copies alive; no activation is.
- **step**: after the backward: the sharded gradients whole, no activations.

The sharded gradients are alive in the backward only from a second micro-batch on (FSDP2
reduce-scatters every micro-batch without a pipeline; the previous step's were freed by
``zero_grad(set_to_none=True)``). Under a pipeline ``PipelineStage`` turns gradient sync off until
the last micro-batch (``set_requires_gradient_sync(False)``): the unsharded fp32 accumulators are
alive through the micro-batches, the sharded ones only at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the phases, in step order
PHASES: tuple[str, ...] = ("loss", "head", "layer", "embed", "step")


@dataclass(frozen=True)
class Fsdp2Bytes:
    """One rank's FSDP2 bytes of one pipeline stage, apart by when they are alive."""

    #: the sharded parameters (fp32: the optimizer's master) and the optimizer's states
    sharded: float
    optimizer: float
    #: the sharded gradients after the backward, and the pipeline's unsharded fp32 accumulators
    sharded_grads: float
    accumulated_grads: float
    #: unsharded parameters held from the forward to the backward (no reshard: every unit's)
    kept: float
    #: the root unit's unsharded parameters, one decoder layer's, one layer's reduce-scatter copies
    root: float
    layer: float
    reduce: float
    #: whether the layers and the root are resharded after their forward
    reshard: bool


@dataclass(frozen=True)
class StageBytes:
    """The transient bytes of the stage: kept activations (all micro-batches in flight), one
    layer's recomputed ones, the head's, the loss's copies of the logits and their gradient."""

    kept: float
    rebuilt: float
    head: float
    loss: float
    logits_grad: float
    layers: int
    last: bool
    #: gradients alive in the backward: a second micro-batch or a pipeline
    grads_in_backward: bool
    #: the loss's bytes over the step, the logits and every copy of them (``reserve``)
    all_logits: float = 0.0
    #: the embedding's gradient beyond the rank's rows while its backward makes it whole (the
    #: ``embed`` phase; 0 where it is made per row, or the stage has no trained embedding)
    embed_grad: float = 0.0


def phases(f: Fsdp2Bytes, s: StageBytes) -> dict[str, dict[str, float]]:
    """Each phase the stage goes through: its bytes over ``weights``, ``gradients``,
    ``optimizer``, ``activations``, ``logits``, ``buffers``."""
    grads = (f.sharded_grads if s.grads_in_backward else 0.0) + f.accumulated_grads
    held = f.sharded + f.kept
    out: dict[str, dict[str, float]] = {}
    if s.last:
        regather = 2 * f.root if f.reshard else 0.0
        out["loss"] = _part(held, grads, f.optimizer, s.kept + s.head, s.loss, 0.0)
        out["head"] = _part(held + regather, grads, f.optimizer, s.kept + s.head, s.logits_grad, 0.0)
    if s.layers:
        gathered = f.root + 2 * f.layer if f.reshard else 0.0
        out["layer"] = _part(held + gathered, grads, f.optimizer, s.kept + s.rebuilt, 0.0, f.reduce)
    if s.embed_grad:
        layer_grads = f.accumulated_grads or f.sharded_grads
        out["embed"] = _part(held + (f.root if f.reshard else 0.0), layer_grads + f.root + s.embed_grad,
                             f.optimizer, 0.0, 0.0, f.reduce)
    out["step"] = _part(held, f.sharded_grads + f.accumulated_grads, f.optimizer, 0.0, 0.0, 0.0)
    return out


def reserve(f: Fsdp2Bytes, s: StageBytes) -> dict[str, float]:
    """The bytes a GPU's caching allocator holds over the step: every phase's parts counted once. A
    freed block is kept for a later tensor it fits, in its own stream's pool: the all-gather outputs
    (the root's, the two layers') and the reduce-scatter copies do not serve the compute stream's
    tensors, nor the d-byte logits freed before the loss's backward its fp32 copies. The sharded
    gradients, made after the activations are freed, reuse those blocks where no gradient is alive
    in the backward. An upper bound, the figure the ``fsdp-gpu`` prior is fitted on
    (``pipette.fits.FSDP_GPU``; docs/results.md, "Traced memory"); the live peak is ``heaviest``."""
    transient = s.kept + s.rebuilt + s.head + s.all_logits
    grads = f.sharded_grads + f.accumulated_grads + s.embed_grad
    if not (s.grads_in_backward or f.accumulated_grads):
        grads = max(0.0, grads - transient)
    root, in_flight = (f.root, min(2, s.layers) * f.layer) if f.reshard else (0.0, 0.0)
    return _part(f.sharded + f.kept + root, grads, f.optimizer, s.kept + s.rebuilt + s.head, s.all_logits,
                 in_flight + f.reduce)


def beyond(cache: dict[str, float], parts: dict[str, float]) -> tuple[float, float]:
    """The bytes ``reserve``'s ``cache`` holds beyond one phase's ``parts``: in all, and of the short-lived
    ones (activations and logits)."""
    short = cache["activations"] + cache["logits"] - parts["activations"] - parts["logits"]
    return sum(cache.values()) - sum(parts.values()), short


def heaviest(every: dict[str, dict[str, float]]) -> str:
    """The phase of ``phases`` with the most bytes alive (the first of equals in step order)."""
    return max(every, key=lambda k: sum(every[k].values()))


def _part(weights: float, gradients: float, optimizer: float, activations: float, logits: float,
          buffers: float) -> dict[str, float]:
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer, "activations": activations,
            "logits": logits, "buffers": buffers}
