"""What context parallelism changes in a rank's memory (issue 48), and the words that explain it.

A cp rank of a candidate holds what a data-parallel rank of the same job with ``dp * cp`` replicas
and sequences of ``s / cp`` tokens holds (``fold``), plus the attention's exchange buffers
(``exchange_bytes``):

* activations: every term of Korthikanti et al. 2022 (sec. 4, eq. 1-2: ``sbh(34 + 5as/h)`` per layer,
  ``/t`` under tensor and sequence parallelism) is linear in the tokens a rank holds once the scores
  are not stored (a fused attention kernel keeps only its output and log-sum-exp: Dao 2023, sec. 3.1),
  so it is taken at ``s / cp``: every layer of a cp rank runs on the tokens Megatron-Core's
  ``get_batch_on_this_cp_rank`` (megatron/core/utils.py) or torchtitan's ``context_parallel`` buffers
  left it, ``s / cp`` of each sequence, and only the attention sees the others' keys and values;
* logits and loss: each cp rank computes the loss over its own chunk (Megatron-Core's
  ``get_batch_on_this_cp_rank`` splits the labels with the tokens; torchtitan's ``context_parallel``
  shards the labels as the inputs), so the logits are ``b s/cp V / t`` -- vocab-parallel over tp on a
  stack whose loss is (``MemoryOptions.loss_fp32_copies``), chunked where it fuses it;
* states: gradients are reduced, and a sharded optimizer or FSDP shards, over ``dp * cp`` ranks
  (Megatron-Core's ``data_parallel_group`` ``with_context_parallel``; torchtitan's ``dp_shard_cp``
  mesh); the weights stay replicated over cp unless sharded (ZeRO-3 / FSDP);
* what is in flight while a layer's attention runs (``exchange_bytes``): the ring's two buffers of a
  KV block (double buffering: one block computed on while the next arrives) and, in the backward, two
  of its gradient; torchtitan's all-gather rotation the whole sequence's K and V and the fp32
  gradients passed around the ring (``allgather_backward_bytes``), with K and V repeated to the query
  heads where the model does it before the attention; Ulysses' all-to-all inputs and outputs of q, k,
  v and the context.
"""

from __future__ import annotations

from dataclasses import replace

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

#: How a stack exchanges the sequence's keys and values (``MemoryOptions.cp_comm``,
#: ``PerfConstants.cp_comm``): ``p2p`` the ring of KV blocks (Megatron-Core / Transformer Engine's
#: ``cp_comm_type="p2p"``; Pipette's CPU ring), ``allgather`` the whole KV all-gathered once per pass
#: (PyTorch's ``_RotateMethod.ALL_GATHER``, torchtitan's default ``context_parallel_rotate_method``),
#: ``a2a`` Ulysses' all-to-alls (DeepSpeed's ``DistributedAttention``).
CP_COMMS: tuple[str, ...] = ("p2p", "allgather", "a2a")


def fold(training: TrainingSpec, config: ParallelConfig) -> tuple[TrainingSpec, ParallelConfig]:
    """The job one cp rank's memory and GEMMs equal: sequences of ``s / cp`` tokens on ``dp * cp``
    replicas (global batch ``cp`` times as many sequences, so the micro-batches per replica are the
    same; the HSDP shard degree ``dp_shard * cp``). The folded mesh ``(pp, dp * cp, tp)`` numbers the
    ranks as ``(pp, dp, cp, tp)`` does (``pipette.layout``: cp sits just inside dp in every stack's
    order), so its dp groups are the candidate's ``dp_cp`` groups. cp 1: unchanged."""
    if config.cp == 1:
        return training, config
    if training.seq_len % config.cp:
        raise SpecError(f"seq_len {training.seq_len} is not divisible by cp={config.cp}", field="config.cp",
                        fix=f"use a cp that divides {training.seq_len}")
    return (replace(training, seq_len=training.seq_len // config.cp, global_batch=training.global_batch * config.cp),
            fold_config(config))


def fold_config(config: ParallelConfig) -> ParallelConfig:
    """``fold``'s candidate alone: ``dp * cp`` replicas of ``cp = 1`` (the placement kept)."""
    if config.cp == 1:
        return config
    c = config.cp
    return replace(config, dp=config.dp * c, cp=1, global_batch=config.global_batch * c,
                   dp_shard=None if config.dp_shard is None else config.dp_shard * c)


def kv_block_bytes(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, *,
                   repeat_kv: bool = False) -> float:
    """K and V of one cp rank's chunk on one tensor-parallel rank: ``2 b (s/cp) kv d / min(t, kv_heads)``
    (grouped-query attention replicates a k/v head over ``t / kv_heads`` ranks beyond that); with
    ``repeat_kv``, K and V repeated to every query head first (torchtitan's Llama): ``2 b (s/cp) h d / t``."""
    width, ranks = (model.heads * model.head_dim, config.tp) if repeat_kv \
        else (model.kv_dim, min(config.tp, model.kv_heads))
    return 2.0 * config.mbs * training.seq_len / config.cp * width / ranks * training.dtype_bytes


def exchange_bytes(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, cp_comm: str, *,
                   repeat_kv: bool = False) -> float:
    """Bytes the attention's exchange keeps in flight on a cp rank during one layer's backward (the
    peak of the two passes): see the module docstring. 0 at cp 1. ``repeat_kv``: the keys and values
    reach the attention repeated to every query head (torchtitan's Llama, Pipette's runner on CUDA)."""
    if cp_comm not in CP_COMMS:
        raise SpecError(f"unknown cp_comm {cp_comm!r}", field="options.cp_comm",
                        fix=f"use one of {', '.join(CP_COMMS)}")
    if config.cp == 1:
        return 0.0
    kv = kv_block_bytes(model, training, config, repeat_kv=repeat_kv)
    if cp_comm == "p2p":
        return 4.0 * kv  # two KV buffers and two dKV buffers (double buffering)
    if cp_comm == "allgather":
        return allgather_backward_bytes(model, training, config, kv)
    # Ulysses: q, k, v and the context through the all-to-all, its input and its output buffer
    local = config.mbs * training.seq_len / config.cp * training.dtype_bytes
    return 2.0 * local * (2.0 * model.hidden / config.tp + 2.0 * model.kv_dim / min(config.tp, model.kv_heads))


def allgather_backward_bytes(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, kv: float) -> float:
    """PyTorch's ring backward with the all-gather rotation at a step after the first
    (``_templated_ring_attention_backward``, torch/distributed/tensor/experimental/_context_parallel/
    _attention.py): the whole sequence's K and V gathered once (``cp`` blocks ``kv``) and the copy it
    was gathered from (one); the kernel's bf16 gradients of the step (K and V: one block; q); the
    gradients of K and V accumulated in fp32 (``convert_to_f32``) and passed on point to point (the
    ``ALL_TO_ALL`` rotater whatever the KV's): the ones held, the copy sent and the one received,
    three blocks in fp32; and q's fp32 accumulator."""
    fp32 = 4.0 / training.dtype_bytes
    q = config.mbs * training.seq_len / config.cp * model.heads * model.head_dim / config.tp * training.dtype_bytes
    return (config.cp + 1.0 + 1.0 + 3.0 * fp32) * kv + (1.0 + fp32) * q


#: What each part of a cp rank's memory holds, in the words of ``explain``.
PART_WORDS: dict[str, str] = {
    "weights": "parameters; replicated over cp unless sharded (ZeRO-3 / FSDP over dp x cp)",
    "gradients": "gradients of what trains, reduced over dp x cp",
    "optimizer": "optimizer states (and fp32 master) of what trains, sharded over dp x cp where sharded",
    "activations": "Korthikanti's per-layer terms at s/cp tokens x layers held (x micro-batches in flight)",
    "logits": "the loss over the rank's own s/cp tokens (vocab-parallel over tp where the stack does it)",
    "buffers": "gradient buckets / gathered layers, and the attention's KV exchange in flight",
    "overhead": "CUDA context and allocator fragmentation on the transient parts",
}


def explain(breakdown: dict[str, int], model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
            cp_comm: str, repeat_kv: bool = False) -> list[str]:
    """Lines that say, term by term, what one cp rank of ``config`` holds (``breakdown``: its
    ``MemoryEstimate.breakdown``; ``repeat_kv`` as ``exchange_bytes``)."""
    gib = 1024.0 ** 3
    local = training.seq_len // config.cp
    kind = {"p2p": "ring, KV blocks point to point", "allgather": "ring, KV all-gathered",
            "a2a": "Ulysses all-to-all"}[cp_comm]
    head = (f"cp={config.cp} ({kind}): each rank holds {local:,} of {training.seq_len:,} tokens; states sharded "
            f"over dp x cp = {config.dp * config.cp}" if config.cp > 1 else
            f"cp=1: each rank holds all {training.seq_len:,} tokens")
    lines = [head]
    for part, value in breakdown.items():
        lines.append(f"  {part:<12}{value / gib:8.2f} GiB  {PART_WORDS.get(part, '')}")
    exchange = exchange_bytes(model, training, config, cp_comm, repeat_kv=repeat_kv)
    if exchange:
        block = kv_block_bytes(model, training, config, repeat_kv=repeat_kv)
        width = "h d / t, K and V repeated to the query heads" if repeat_kv else "kv d / t"
        lines.append(f"  (of buffers: KV exchange {exchange / gib:.2f} GiB = "
                     f"{exchange / block:.1f} blocks of {block / gib:.3f} GiB, 2 b (s/cp) {width})")
    lines.append(f"  {'total':<12}{sum(breakdown.values()) / gib:8.2f} GiB")
    return lines
