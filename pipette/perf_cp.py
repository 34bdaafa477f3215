"""What context parallelism adds to a step (issue 48): the attention's exchange of keys and values
over the real links of each cp group, and how much of it the attention blocks hide.

The GEMMs of a cp rank are those of its ``s / cp`` tokens (``pipette.memory_cp.fold``: the model
prices the folded job). Its attention is not: a rank's queries attend over the whole sequence, and
with the load-balanced chunking (2 cp chunks, rank i holding chunks i and 2cp-1-i: Megatron-Core's
``get_batch_on_this_cp_rank``, PyTorch's ``_HeadTailLoadBalancer``) every rank does ``1 / cp`` of
the causal work, ``2 b s^2 h / (t cp)`` FLOPs a layer forward (the causal half of QK^T and PV; Dao
et al. 2022): ``pipette.perf`` prices the attention of the folded job's tokens against the whole
sequence's keys (``PerfModel.kv_seq``). The exchange, per layer and micro-batch:

* ``p2p`` (ring; Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Transformer Engine's
  ``AttnFuncWithCPAndKVP2P``): ``cp - 1`` steps, each sending the KV block ``2 b (s/cp) kv d / t`` to
  the next rank of the ring while the attention of the block in hand runs (``1 / cp`` of the rank's
  attention); the backward sends the KV block and its gradient. A step exposes what its transfer
  takes beyond ``cp_overlap`` of its block's compute: ``max(x - o c, 0)``, so a long block hides it
  and a short one does not;
* ``allgather`` (torchtitan's default rotation: PyTorch's ``_AllGatherRotater``): the whole KV
  all-gathered once a pass, started before the rank's own block and waited for after it; the
  backward gathers again and reduce-scatters the KV gradient;
* ``a2a`` (DeepSpeed Ulysses, Jacobs et al. 2023): q, k and v all-to-all before the attention and
  the context after it, in each pass; the attention waits on them (nothing to hide them under).

A ring runs at its slowest hop (``pipette.comm.ring_links``), an all-gather or all-to-all of the cp
group too; each stage's time is its slowest cp group's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pipette import comm
from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.memory_cp import CP_COMMS, kv_block_bytes
from pipette.model import ModelSpec
from pipette.perf_constants import PerfConstants
from pipette.training import TrainingSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: The breakdown key of the exposed exchange (``PerfEstimate.breakdown``, only where cp > 1).
CP_PART = "cp_comm"


def ring_step_exposed(transfer: float | FloatArray, block: float, overlap: float) -> FloatArray:
    """What one ring step adds to the critical path: its transfer beyond ``overlap`` of the
    attention block it runs beside."""
    return np.maximum(np.asarray(transfer, dtype=np.float64) - overlap * block, 0.0)


def layer_exposed(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, k: PerfConstants,
                  attention: tuple[float, float], bw: FloatArray, lat: FloatArray) -> FloatArray:
    """Exposed exchange seconds of one layer and micro-batch (forward, backward and a recomputed
    forward) for cp groups of bottleneck bandwidth ``bw`` and latency ``lat``; ``attention``: the
    rank's attention seconds of one layer, forward and backward (all of its ``1 / cp`` work)."""
    cp, (attn_f, attn_b) = config.cp, attention
    passes_f = 2.0 if config.recompute == "full" else 1.0
    kv = kv_block_bytes(model, training, config)
    bw = bw * k.link_fraction
    if k.cp_comm == "p2p":
        x = comm.p2p_time(kv, bw, lat)
        fwd = ring_step_exposed(x, attn_f / cp, k.cp_overlap)
        bwd = ring_step_exposed(2.0 * x, attn_b / cp, k.cp_overlap)  # the KV block and its gradient
        return np.asarray((cp - 1) * (passes_f * fwd + bwd), dtype=np.float64)
    if k.cp_comm == "allgather":
        gather = comm.allgather_time(cp * kv, cp, bw, lat)
        reduce = comm.reduce_scatter_time(cp * kv, cp, bw, lat)
        fwd = ring_step_exposed(gather, attn_f / cp, k.cp_overlap)
        bwd = ring_step_exposed(gather + reduce, attn_b / cp, k.cp_overlap)
        return np.asarray(passes_f * fwd + bwd, dtype=np.float64)
    if k.cp_comm != "a2a":
        raise ValueError(f"unknown cp_comm {k.cp_comm!r}: one of {CP_COMMS}")
    # Ulysses: each all-to-all moves (cp - 1) / cp of a rank's q, k, v (before) and context (after)
    local = config.mbs * training.seq_len / cp * training.dtype_bytes
    t_kv = min(config.tp, model.kv_heads)
    moved = local * (2.0 * model.hidden / config.tp + 2.0 * model.kv_dim / t_kv) * (cp - 1) / cp
    a2a = moved / bw + 2.0 * (cp - 1) * lat
    return np.asarray((passes_f + 1.0) * a2a, dtype=np.float64)


def stage_exposed(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, cluster: ClusterProfile,
                  k: PerfConstants, attention: tuple[float, float], layers: FloatArray,
                  devices: Sequence[int] | IntArray) -> FloatArray:
    """``(p,)``: the exposed exchange of one micro-batch on each pipeline stage, its slowest cp group
    (``config`` is the candidate itself, not the folded one: its ``groups("cp")``)."""
    groups = comm.device_groups(config.layout, devices, "cp")  # (pp * dp * tp, cp), pp outermost
    bw, lat = comm.ring_links(cluster, groups)
    per_group = layer_exposed(model, training, config, k, attention, bw, lat)
    per_stage = per_group.reshape(config.pp, -1).max(axis=1)
    return np.asarray(layers * per_stage, dtype=np.float64)
