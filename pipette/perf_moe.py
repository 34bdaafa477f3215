"""The step time of a Mixture-of-Experts model's MLPs, on top of ``pipette.perf`` (whose dense path
prices the attention, the norms, the head and the pipeline): what each MoE layer adds per
micro-batch and stage, and what its all-to-all costs on the expert-parallel group's links.

Per MoE layer, forward, on one rank with ``T_r = s b / t`` tokens to route (sequence parallel under
``t > 1``), ``k`` copies each (``routed_tokens``; with a capacity factor, the candidate's routing
or the model's (``pipette.routing``), padded to the capacity under the all-to-all dispatcher),
``E`` experts of width ``f_e`` over ``ep`` ranks (``pipette.memory_moe.ExpertDegrees``):

* the router GEMM ``2 T_r h E`` at the dense GEMM curve, and its softmax / top-k over ``T_r E``
  fp32 scores (``ROUTER_PASSES`` memory passes);
* the permutation and un-permutation of the token copies (Megatron-Core's ``permute`` /
  ``unpermute``, torchtitan's ``generate_permute_indices``): ``PERMUTE_PASSES`` passes of
  ``T_r k h`` elements each way;
* the grouped expert GEMMs: ``2 x 3 h f_e / etp`` FLOPs per token copy, ``T_r k x imbalance`` copies
  on the busiest rank. Each local expert gets ``M = T_r k ep / E`` tokens (the group's tokens
  ``T_r ep`` times ``k / E``), small matrices that do not reach the dense curve: the efficiency is
  the device's large-GEMM efficiency times ``grouped_share x M / (M + grouped_half_tokens)``, fitted
  on the measured grouped GEMMs of data/kernels/grouped_gemm.csv (SimuMax's Transformer Engine
  grouped GEMM on B200, 108 rows, forward and both backward GEMMs: 0.485 M / (M + 268) of the
  peak, where a large dense bf16 GEMM of that device runs at 0.488 in the same stack's fit,
  ``pipette.efficiency.B200_MAX_FRACTION``);
* the shared experts (``3`` GEMMs of ``2 T h f_s / t``) and a dense layer's MLP at the dense curve;
* the all-to-all dispatch and combine: each rank sends ``T_r k`` token copies of ``h`` elements,
  ``(n - 1) / n`` of them to the other ``n = ep`` members: ``alltoall_time``. Under the candidate's
  ``flex`` dispatcher (DeepEP / HybridEP) a token crosses to each other link domain once
  (``remote_copies``) and the host waits on the tokens per expert whatever the routing (``host_floor``).

The backward runs each GEMM twice (data and weight gradients; once for a frozen LoRA base) and
the two all-to-alls again; full recomputation repeats the forward (its all-to-alls too).
``moe_overlap`` is the share of the all-to-all a stack hides under the other micro-batch's compute
(Megatron-Core's ``--overlap-moe-expert-parallel-comm``, the 1F1B A2A overlap of DeepSeek-V3's
DualPipe idea, DeepSeek-V3 report sec. 3.2.1; 0 where the stack runs them in line).

**Router imbalance** (``imbalance``): with dropless routing the busiest rank of the expert-parallel
group gets more than the mean ``T_r k`` copies, and every rank waits for it at the combine. It
multiplies the grouped GEMMs and the all-to-all bytes; with a capacity factor the capacity bounds it
(``routed_load``: Megatron-Core's padding fixes the load at the capacity under the all-to-all; the flex
dispatcher drops without padding, the imbalance up to the capacity). Fitted per stack
(tests/benchmarks/moe_fit.py).

Expert gradients are reduced over the expert data-parallel group ``edp`` (a ring of the group's
links), once per step, as the dense gradients over ``dp``; the optimizer updates ``1 / edp`` of
the local experts under a sharded optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipette import comm
from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.memory_moe import (
    ExpertDegrees,
    lora_mlp_params,
    mlp_params,
    moe_of,
    routed_load,
    routed_tokens,
    stage_mlp_layers,
)
from pipette.model import ModelSpec
from pipette.routing import capacity_of
from pipette.training import TrainingSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: memory passes of the router's softmax / sigmoid and top-k over the fp32 scores (read, write, top-k read)
ROUTER_PASSES = 3.0
#: read and write of each token copy when permuting (and again when un-permuting)
PERMUTE_PASSES = 2.0


@dataclass(frozen=True)
class MoeConstants:
    """A stack's constants for the MoE terms (``PerfConstants.moe``)."""

    #: the grouped GEMM's efficiency at many tokens per expert, as a share of the dense curve's large-GEMM one
    grouped_share: float = 0.993
    #: tokens per expert at which the grouped GEMM reaches half of that
    grouped_half_tokens: float = 268.0
    #: the busiest expert-parallel rank's token copies over the mean, dropless routing
    imbalance: float = 1.0
    #: share of the all-to-all hidden under compute
    a2a_overlap: float = 0.0
    #: the achieved share of the NICs' bandwidth by an all-to-all across nodes
    a2a_cut_fraction: float = 1.0
    #: seconds the host needs to launch one MoE layer's forward and backward for one micro-batch: the
    #: layer takes at least that (``--moe-token-dispatcher-type alltoall`` waits on the tokens per
    #: expert on the host before sizing its all-to-all; a small layer is launch-bound). 0: not counted
    layer_host_s: float = 0.0
    #: whether the MoE layer's forward runs again in its backward (Megatron-Core's ``--recompute-modules
    #: mlp``, which checkpoints the whole MoE layer: router, permutation, experts)
    layer_recompute: bool = False


#: Counted: the grouped GEMM from the kernel table, every all-to-all exposed, no imbalance, no launch floor
DEFAULT_MOE = MoeConstants()
#: The megatron stack's, fitted by tests/benchmarks/moe_fit.py on the MoE rows of Megatron-Bridge's current
#: release line (26.x: 15, one per layout and recipe, B300's 3 among them; the 25.x rows are kept aside, a
#: release being part of the stack for MoE) and SimuMax's B200 DeepSeek runs (12) together (cross-validated
#: figures: docs/moe.md):
#: ``grouped_share`` on all 27, ``layer_host_s`` on the 12 whose host waits (``host_floor``; no whole-step CUDA
#: graph). ``imbalance`` is 1, not fitted: these rows cannot tell it from ``grouped_share``. ``a2a_overlap`` is
#: 0 because that is what the emitted megatron_args.txt runs (no ``--overlap-moe-expert-parallel-comm``;
#: each row is priced with its recipe's dispatcher, a candidate's choice: ``ParallelConfig.dispatcher``);
#: where a recipe overlaps, the fit hides 0.95 of it (5 rows; the fit's upper bound, where 10 of its 11
#: folds put it).
MEGATRON_MOE = MoeConstants(grouped_share=0.723, a2a_overlap=0.0, layer_host_s=5.59e-3, imbalance=1.0)


@dataclass(frozen=True)
class MoeTimes:
    """Placement-independent MoE times per stage and micro-batch (seconds, (p,) arrays)."""

    forward: FloatArray
    backward: FloatArray
    #: all-to-alls per micro-batch on each stage, and the bytes each rank sends in one
    a2a_count: FloatArray
    a2a_bytes: float
    #: expert gradient bytes per rank of each stage (reduced over edp once per step)
    expert_grad_bytes: FloatArray
    #: expert parameters per rank of each stage the optimizer updates (after sharding over edp)
    expert_update_params: FloatArray


def attention_width(model: ModelSpec) -> float:
    """What ``pipette.perf`` multiplies by ``2 T s`` for the attention core: ``h`` for a dense model
    (``heads x head_dim``), ``heads (qk_head_dim + v_head_dim) / 2`` under MLA (QK^T at the query-key
    width, softmax x V at the value width)."""
    a = model.attention
    if a is None:
        return float(model.hidden)
    if a.mla is None:
        return float(model.heads * a.head_dim)
    return model.heads * (a.mla.qk_head_dim + a.mla.v_head_dim) / 2.0


def grouped_efficiency(tokens_per_expert: float, large: float, k: MoeConstants) -> float:
    """The grouped GEMM's share of the peak (the module docstring)."""
    m = max(tokens_per_expert, 1e-9)
    return large * k.grouped_share * m / (m + k.grouped_half_tokens)


def layer_times(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, *, gemm: Callable[[float], float],
                grouped_peak: float, large: float, bandwidth: float, ffn_passes: float,
                k: MoeConstants) -> tuple[float, float, float, float]:
    """Forward and backward seconds of (a dense MLP layer, an MoE layer) without their all-to-alls,
    for one micro-batch. ``gemm(flops)`` prices one dense GEMM at the stack's curve (its dtype)."""
    moe, h, t, d = moe_of(model), model.hidden, config.tp, training.dtype_bytes
    deg = ExpertDegrees.of(config, moe.experts)
    tokens = float(config.mbs * training.seq_len)
    t_r = tokens / t
    copies = routed_tokens(moe, t_r, config)
    load = routed_load(moe, t_r, config, k.imbalance)
    frozen = training.method != "full"
    back = 1.0 if frozen else 2.0

    def mlp(width: float, n: float) -> float:  # a SwiGLU MLP: gate, up (h x f) and down (f x h)
        return 3.0 * gemm(2.0 * n * h * width) + ffn_passes * n * width * d / bandwidth

    dense_f = mlp(model.ffn_hidden / t, tokens)
    per_expert = copies * deg.ep / moe.experts
    eff = grouped_efficiency(per_expert, large, k)
    experts_f = 2.0 * load * 3.0 * h * moe.expert_ffn / deg.etp / (grouped_peak * eff)
    experts_f += ffn_passes * load * moe.expert_ffn / deg.etp * d / bandwidth
    router_f = gemm(2.0 * t_r * h * moe.experts) + ROUTER_PASSES * t_r * moe.experts * 4.0 / bandwidth
    permute_f = 2.0 * PERMUTE_PASSES * load * h * d / bandwidth
    shared_f = mlp(moe.shared_ffn / t, tokens) if moe.shared_ffn else 0.0
    moe_f = experts_f + router_f + permute_f + shared_f
    adapters = _adapter_times(model, training, config, gemm, tokens, load)
    dense_b = back * dense_f + 2.0 * adapters[0]
    moe_b = back * (experts_f + shared_f) + 2.0 * (router_f + permute_f) + 2.0 * adapters[1]
    moe_b += (moe_f + adapters[1]) if k.layer_recompute else 0.0
    host = host_floor(capacity_of(moe.capacity_factor, config.routing) is not None, config.dispatcher, k)
    # the host's share a third forward, two thirds backward (twice the kernels)
    return dense_f + adapters[0], dense_b, max(moe_f + adapters[1], host / 3.0), max(moe_b, 2.0 * host / 3.0)


def host_floor(capacity: bool, dispatcher: str | None, k: MoeConstants) -> float:
    """Seconds the host needs for one MoE layer and micro-batch (forward and backward), which the layer
    cannot beat when the host must wait for the tokens per expert before launching the experts. The
    all-to-all dispatcher with a capacity factor (drop and pad) never waits (Megatron-Core's
    ``MoEAlltoAllTokenDispatcher.preprocess`` returns before any sync point), so the host runs ahead
    there. DeepEP's dispatch (Megatron-Core's flex dispatcher) has the host wait either way: it hands the
    experts' GEMMs their sizes as a host list (``handle.num_recv_tokens_per_expert_list``), and only a
    dispatch reusing a cached layout skips the CPU synchronization (github.com/deepseek-ai/DeepEP README,
    "Example use in model training" and "in inference decoding")."""
    if capacity and dispatcher is None:
        return 0.0
    return k.layer_host_s


def _adapter_times(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, gemm: Callable[[float], float],
                   tokens: float, load: float) -> tuple[float, float]:
    """LoRA adapters on the MLP targets, forward: ``2 x tokens x adapter parameters`` FLOPs (a dense
    layer's over its tokens; the experts' over their token copies, each copy through one expert's)."""
    if training.lora is None:
        return 0.0, 0.0
    moe = moe_of(model)
    deg = ExpertDegrees.of(config, moe.experts)
    dense_a, shared_a, expert_a = lora_mlp_params(model, training, config)
    per_expert = expert_a / (moe.experts / deg.ep)
    return gemm(2.0 * tokens * dense_a), gemm(2.0 * tokens * shared_a) + gemm(2.0 * load * per_expert)


def moe_times(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, *, gemm: Callable[[float], float],
              grouped_peak: float, large: float, bandwidth: float, ffn_passes: float, k: MoeConstants) -> MoeTimes:
    """Per stage and micro-batch: the MLPs' forward and backward, the all-to-alls, the expert gradients."""
    moe = moe_of(model)
    dense_f, dense_b, moe_f, moe_b = layer_times(model, training, config, gemm=gemm, grouped_peak=grouped_peak,
                                                 large=large, bandwidth=bandwidth, ffn_passes=ffn_passes, k=k)
    split = np.asarray(stage_mlp_layers(model, config.layers_per_stage(model.layers)), dtype=np.float64)
    dense, sparse = split[:, 0], split[:, 1]
    forward = dense * dense_f + sparse * moe_f
    backward = dense * dense_b + sparse * moe_b + (forward if config.recompute == "full" else 0.0)
    per_layer = 4.0 + (2.0 if config.recompute == "full" else 0.0)  # dispatch + combine, both passes
    load = routed_load(moe, config.mbs * training.seq_len / config.tp, config, k.imbalance)
    deg = ExpertDegrees.of(config, moe.experts)
    _, _, local = mlp_params(model, config)
    trained = local if training.method == "full" else lora_mlp_params(model, training, config)[2]
    grad = sparse * trained * training.dtype_bytes
    update = sparse * trained / (deg.edp if config.zero_stage >= 1 else 1)
    return MoeTimes(forward, backward, sparse * per_layer, float(load * model.hidden * training.dtype_bytes),
                    grad, update)


def replicated_params(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> FloatArray:
    """Per stage: the MLP parameters every rank of the data-parallel group holds (dense MLPs, routers,
    shared experts; their adapters under LoRA), reduced over dp with the attention's."""
    dense_p, shared_p, _ = mlp_params(model, config)
    if training.method != "full":
        dense_p, shared_p, _ = lora_mlp_params(model, training, config)
    split = np.asarray(stage_mlp_layers(model, config.layers_per_stage(model.layers)), dtype=np.float64)
    return np.asarray(split[:, 0] * dense_p + split[:, 1] * shared_p, dtype=np.float64)


def expert_groups(config: ParallelConfig, experts: int, dim: str) -> IntArray:
    """``(g, n)``: the ranks of each expert-parallel (``dim="ep"``) or expert data-parallel
    (``"edp"``) group. Megatron-Core's expert ``RankGenerator`` (megatron/core/parallel_state.py):
    order ``tp-cp-ep-dp-pp`` fastest first with ``tp = etp``, so per stage the ranks reshape to
    ``(edp, ep, etp)``; torchtitan's ``ep`` mesh is the same block of ``dp_shard x cp`` ranks."""
    deg = ExpertDegrees.of(config, experts)
    grid = np.arange(config.world, dtype=np.int64).reshape(config.pp, deg.edp, deg.ep, deg.etp)
    if dim == "ep":
        return grid.transpose(0, 1, 3, 2).reshape(-1, deg.ep)
    return grid.transpose(0, 2, 3, 1).reshape(-1, deg.edp)


def remote_copies(top_k: int, domains: int) -> float:
    """Copies of a token that leave its link domain under DeepEP's dispatch, over the ``k`` copies
    the all-to-all sends: a token goes once to each other domain one of its experts is in. With its
    ``k`` experts spread uniformly over ``D`` domains of the group, ``(D - 1)(1 - (1 - 1/D)^k)``
    other domains are touched; the all-to-all sends ``k (D - 1) / D`` copies off the domain."""
    if domains <= 1:
        return 1.0
    touched = (domains - 1) * (1.0 - (1.0 - 1.0 / domains) ** top_k)
    return min(1.0, touched / (top_k * (domains - 1) / domains))


def alltoall_time(cluster: ClusterProfile, groups: IntArray, nbytes: float, cut_fraction: float,
                  inter_share: float | FloatArray = 1.0) -> FloatArray:
    """Seconds of one all-to-all in each group (rows of devices) where every member sends ``nbytes``
    spread evenly over the ``n`` members. Inside a link domain (a node, an NVLink rack) a member's
    ``(k - 1) / n`` share goes over its slowest link to the members beside it; the ``(n - k) / n``
    share to other domains leaves through its own NIC (rail-aligned NCCL channels, as
    ``pipette.comm.channel_links``) at its slowest link off the domain times ``cut_fraction``; both
    run at once, so the slower of the two sets a member's time, the slowest member the group's, plus
    the worst latency (NCCL posts the member's sends and receives together). ``inter_share`` (per
    group) scales what leaves the domain (DeepEP: ``remote_copies``)."""
    groups = np.asarray(groups, dtype=np.int64)
    g, n = groups.shape
    if n <= 1 or nbytes <= 0:
        return np.zeros(g)
    bw = cluster.bandwidth[groups[:, :, None], groups[:, None, :]]  # (g, n, n)
    lat = cluster.latency[groups[:, :, None], groups[:, None, :]].max(axis=(1, 2))
    domain = cluster.link_domain_of[groups]
    same = domain[:, :, None] == domain[:, None, :]
    k = same.sum(axis=2)  # members in each member's domain, itself included
    intra = np.where(same, bw, np.inf).min(axis=2)
    inter = np.where(same, np.inf, bw).min(axis=2) * cut_fraction
    t_in = np.where(k > 1, nbytes * (k - 1) / n / intra, 0.0)
    off = nbytes * (n - k) / n * np.asarray(inter_share, dtype=np.float64).reshape(-1, 1)
    t_out = np.where(k < n, off / inter, 0.0)
    return np.asarray(np.maximum(t_in, t_out).max(axis=1) + lat, dtype=np.float64)


def a2a_per_stage(cluster: ClusterProfile, config: ParallelConfig, model: ModelSpec, devices: IntArray,
                  nbytes: float, k: MoeConstants) -> FloatArray:
    """(p,): one all-to-all's time on each stage, its slowest expert-parallel group's."""
    moe = moe_of(model)
    groups = np.asarray(devices, dtype=np.int64)[expert_groups(config, moe.experts, "ep")]
    share: float | FloatArray = 1.0
    if config.dispatcher == "flex":
        domains = cluster.link_domain_of[groups]
        count = np.array([len(np.unique(row)) for row in domains])
        share = np.array([remote_copies(moe.top_k, int(c)) for c in count])
    times = alltoall_time(cluster, groups, nbytes, k.a2a_cut_fraction, share)
    return np.asarray(times.reshape(config.pp, -1).max(axis=1), dtype=np.float64)


def expert_sync_per_stage(cluster: ClusterProfile, config: ParallelConfig, experts: int, devices: IntArray,
                          grad_bytes: FloatArray, link_fraction: float) -> FloatArray:
    """(p,): the expert gradients' reduction over each stage's slowest expert data-parallel ring
    (an all-reduce: ZeRO-1's reduce-scatter and all-gather move the same bytes)."""
    deg = ExpertDegrees.of(config, experts)
    groups = np.asarray(devices, dtype=np.int64)[expert_groups(config, experts, "edp")]
    bw, lat = comm.ring_links(cluster, groups)
    bw, lat = bw.reshape(config.pp, -1).min(axis=1) * link_fraction, lat.reshape(config.pp, -1).max(axis=1)
    return comm.allreduce_time(grad_bytes, deg.edp, bw, lat)


__all__ = ["DEFAULT_MOE", "MEGATRON_MOE", "PERMUTE_PASSES", "ROUTER_PASSES", "MoeConstants", "MoeTimes",
           "a2a_per_stage",
           "alltoall_time", "attention_width", "expert_groups", "expert_sync_per_stage", "grouped_efficiency",
           "host_floor", "layer_times", "moe_times", "remote_copies", "replicated_params"]
