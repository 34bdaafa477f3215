"""What context parallelism adds to a step (issue 48): the attention's exchange of keys and values
over the real links of each cp group, how much of it the attention blocks hide, and what a ring
attention does beside its kernels.

The GEMMs of a cp rank are those of its ``s / cp`` tokens (``pipette.memory_cp.fold``: the model
prices the folded job). Its attention is not: a rank's queries attend over the whole sequence, and
with the load-balanced chunking (2 cp chunks, rank i holding chunks i and 2cp-1-i: Megatron-Core's
``get_batch_on_this_cp_rank``, PyTorch's round-robin load balance) every rank does ``1 / cp`` of
the causal work, ``2 b s^2 h / (t cp)`` FLOPs a layer forward (the causal half of QK^T and PV; Dao
et al. 2022): ``pipette.perf`` prices the attention of the folded job's tokens against the whole
sequence's keys (``PerfModel.kv_seq``). The exchange, per layer and micro-batch:

* ``p2p`` (ring; Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Transformer Engine's
  ``AttnFuncWithCPAndKVP2P``): ``cp - 1`` steps, each sending the KV block ``2 b (s/cp) kv d / t`` to
  the next rank of the ring while the attention of the block in hand runs (``1 / cp`` of the rank's
  attention); the backward sends the KV block and its gradient. A step exposes what its transfer
  takes beyond ``cp_overlap`` of its block's compute: ``max(x - o c, 0)``, so a long block hides it
  and a short one does not;
* ``allgather`` (PyTorch's ring, torch/distributed/tensor/experimental/_attention.py,
  ``_templated_ring_attention`` and its backward, with torchtitan's default rotation
  ``_AllGatherRotater``): the whole KV all-gathered once a pass, started before the rank's own block
  and waited for after it; the backward gathers it again the same way and passes the KV gradient
  round the ring in fp32 (``_AllToAllRotater``, one send a step, each waited for after the next
  step's block, the last after the loop: nothing hides it);
* ``a2a`` (DeepSpeed Ulysses, Jacobs et al. 2023): q, k and v all-to-all before the attention and
  the context after it, in each pass; the attention waits on them (nothing to hide them under).

A ring runs at its slowest hop (``pipette.comm.ring_links``), an all-gather or all-to-all of the cp
group too; each stage's time is its slowest cp group's.

PyTorch's ring also works beside its kernels (``ring_compute``): its steps after the first attend a
whole chunk without the causal mask, at the fused kernel's full-over-causal rate
(``pipette.kernel_tables``: FlashAttention-2's timings), and it merges each step's output into the
rank's in fp32 (``_SDPAMerger``) and accumulates the gradients in fp32, memory-bound passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from pipette import comm
from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.efficiency import family, read_by_sequence
from pipette.kernel_tables import FLASH_FULL_OVER_CAUSAL
from pipette.memory_cp import CP_COMMS, kv_block_bytes
from pipette.model import ModelSpec
from pipette.perf_compute import Compute
from pipette.perf_constants import PerfConstants
from pipette.training import TrainingSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: The breakdown key of the exposed exchange (``PerfEstimate.breakdown``, only where cp > 1).
CP_PART = "cp_comm"
#: Bytes of an fp32 accumulator element (PyTorch's ring: ``_ContextParallelOptions.convert_to_f32``).
F32 = 4.0


def exchanged_kv_bytes(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, k: PerfConstants) -> float:
    """K and V of one cp rank's chunk as the ring carries them: ``kv_block_bytes``, or with
    ``cp_repeat_kv`` the keys and values repeated to every query head before the attention."""
    return kv_block_bytes(model, training, config, repeat_kv=k.cp_repeat_kv)


def ring_step_exposed(transfer: float | FloatArray, block: float, overlap: float) -> FloatArray:
    """What one ring step adds to the critical path: its transfer beyond ``overlap`` of the
    attention block it runs beside."""
    return np.maximum(np.asarray(transfer, dtype=np.float64) - overlap * block, 0.0)


def recomputes_attention(config: ParallelConfig, k: PerfConstants) -> bool:
    """Whether the backward re-runs the attention's forward: full recomputation, or Korthikanti's
    selective (attention-only) mode; per-op checkpointing saves the fused kernel's output."""
    return config.recompute == "full" or (config.recompute == "selective" and k.op_sac_linear_share <= 0)


def layer_exposed(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, k: PerfConstants,
                  attention: tuple[float, float], bw: FloatArray, lat: FloatArray) -> FloatArray:
    """Exposed exchange seconds of one layer and micro-batch (forward, backward and a recomputed
    forward) for cp groups of bottleneck bandwidth ``bw`` and latency ``lat``; ``attention``: the
    rank's attention seconds of one layer, forward and backward (all of its ``1 / cp`` work)."""
    cp, (attn_f, attn_b) = config.cp, attention
    passes_f = 2.0 if recomputes_attention(config, k) else 1.0
    kv = exchanged_kv_bytes(model, training, config, k)
    bw = bw * k.link_fraction
    if k.cp_comm == "p2p":
        x = comm.p2p_time(kv, bw, lat)
        fwd = ring_step_exposed(x, attn_f / cp, k.cp_overlap)
        bwd = ring_step_exposed(2.0 * x, attn_b / cp, k.cp_overlap)  # the KV block and its gradient
        return np.asarray((cp - 1) * (passes_f * fwd + bwd), dtype=np.float64)
    if k.cp_comm == "allgather":
        gather = comm.allgather_time(cp * kv, cp, bw, lat)
        fwd = ring_step_exposed(gather, attn_f / cp, k.cp_overlap)
        # the fp32 KV gradient passed on after every step: hidden by the next step's block but the last
        dkv = comm.p2p_time(kv * F32 / training.dtype_bytes, bw, lat)
        bwd = ring_step_exposed(gather, attn_b / cp, k.cp_overlap) + \
            (cp - 1) * ring_step_exposed(dkv, attn_b / cp, k.cp_overlap) + dkv
        return np.asarray(passes_f * fwd + bwd, dtype=np.float64)
    if k.cp_comm != "a2a":
        raise ValueError(f"unknown cp_comm {k.cp_comm!r}: one of {CP_COMMS}")
    # Ulysses: each all-to-all moves (cp - 1) / cp of a rank's q, k, v (before) and context (after); they
    # wrap the core attention, so only full recomputation runs them again
    passes_f = 2.0 if config.recompute == "full" else 1.0
    local = config.mbs * training.seq_len / cp * training.dtype_bytes
    t_kv = min(config.tp, model.kv_heads)
    moved = local * (2.0 * model.hidden / config.tp + 2.0 * model.kv_dim / t_kv) * (cp - 1) / cp
    a2a = moved / bw + 2.0 * (cp - 1) * lat
    return np.asarray((passes_f + 1.0) * a2a, dtype=np.float64)


def full_over_causal(device: DeviceSpec, head_dim: int, seq: float) -> float:
    """How much faster the fused kernel attends a ``seq``-long block without the causal mask than with
    it (``pipette.kernel_tables``, the nearest head size timed, log-interpolated in the sequence and
    held at the ends); 1 on a family none was timed on."""
    by_dim = FLASH_FULL_OVER_CAUSAL.get(family(device))
    return read_by_sequence(by_dim, head_dim, seq) if by_dim else 1.0


def ring_compute(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, k: PerfConstants,
                 device: DeviceSpec, attention: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) seconds PyTorch's ring (``allgather``) adds to one layer's compute of a cp
    rank; 0 for the other exchanges. Step 0 is the rank's two chunks against themselves under the
    causal mask; each later step is one chunk of c = s / 2cp against two, or two against one, without
    it: those ``cp - 1`` of the rank's ``cp`` equal shares run ``full_over_causal`` faster. Beside the
    kernels, memory-bound passes over the rank's output (O elements) and its K and V (each KV
    elements) at the memory bandwidth, counted on the slowest rank (the last: every later step merges
    its whole output), bytes per element:

    * forward, a pass: each step's output cast to fp32 (``convert_to_f32``, b + 4) and merged into the
      rank's (``_SDPAMerger``: ``out - sigmoid(lse_b - lse) (out - out_b)``, three ops on fp32, 32);
      K and V concatenated for the exchange (2b) at each step but the last; the result cast back;
    * backward: fp32 accumulators zeroed (4), each step's gradients added in (b + 8; the KV's to one
      chunk, then the two concatenated, + 16), the KV gradient packed for its send (16) at each step,
      K and V concatenated as forward, the results cast back.

    The passes are scaled by ``ring_pass_share`` (what a stack's compile leaves of them)."""
    cp, (attn_f, attn_b) = config.cp, attention
    if cp == 1 or k.cp_comm != "allgather":
        return 0.0, 0.0
    b = training.dtype_bytes
    cast, merge, acc, cat_kv, cat_f32 = b + F32, 8 * F32, b + 2 * F32, 2 * b, 2 * F32
    out = config.mbs * training.seq_len / cp * model.heads * model.head_dim / config.tp
    kv = exchanged_kv_bytes(model, training, config, k) / (2.0 * b)
    fwd_bytes = (2 * cast + (cp - 1) * (cast + merge)) * out + (cp - 1) * cat_kv * 2 * kv
    bwd_bytes = ((F32 + cp * acc + cast) * out
                 + (2 * F32 + 2 * acc + (cp - 1) * (acc + 2 * cat_f32) + cp * 2 * cat_f32
                    + (cp - 1) * 2 * cat_kv + 2 * cast) * kv)
    speedup = full_over_causal(device, model.head_dim, training.seq_len / (2 * cp))
    saved = (cp - 1) / cp * (1.0 - 1.0 / speedup)
    bw = device.memory_bandwidth / k.ring_pass_share if k.ring_pass_share > 0 else np.inf
    return -saved * attn_f + fwd_bytes / bw, -saved * attn_b + bwd_bytes / bw


def with_ring(compute: Compute, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
              k: PerfConstants, device: DeviceSpec, layers: FloatArray) -> Compute:
    """``compute`` of the folded job with what the ring adds to each layer (``ring_compute``; ``config``
    the candidate itself): its forward in the forward, and in the backward the backward's and, where
    the backward re-runs the attention, the forward's again."""
    fwd, bwd = ring_compute(model, training, config, k, device, compute.attention)
    if fwd == 0.0 and bwd == 0.0:
        return compute
    bwd += fwd if recomputes_attention(config, k) else 0.0
    return replace(compute, forward=compute.forward + layers * fwd, backward=compute.backward + layers * bwd)


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
