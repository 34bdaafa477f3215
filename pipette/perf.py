"""The performance model: one optimizer step's time on the schedule's critical path.

``PerfModel`` precomputes everything that does not depend on the placement (FLOPs,
compute times, message sizes) once per candidate; ``step_time(placement)`` then prices
only the communication on the measured links, vectorised, for the placement optimizer.

Per micro-batch and pipeline stage ``s`` (Narayanan et al. 2021, sec. 2.2 and 3):

    t_s = t_f,s + t_b,s + t_tp,s + t_pp,s (+ ZeRO-2/3 per-micro-batch traffic)

and the 1F1B pipeline of ``m`` micro-batches over ``p`` stages, with ``v`` virtual
stages per device (interleaved), takes

    T_pipe = m * max_s t_s + beta * (sum_s t_s - max_s t_s) / v

which is ``(m + p - 1) (t_f + t_b)`` for even stages and a bubble of ``(p-1)/(v m)``
of the ideal time (Narayanan et al. 2021, sec. 2.2, eq. for the bubble fraction). ``beta``
(``PerfConstants.bubble_share``) is the share of the bubble that costs wall time: 1 on devices
of their own; less where the ranks share cores and an idle stage leaves its core to the others.
The step adds the exposed data-parallel gradient reduction, the tied-embedding
synchronisation and the optimizer update:

    step = T_pipe + dp_exposed + embedding_sync + optimizer

DP rings and pipeline boundaries run at the speed of their slowest link under the
placement; a TP group that spans nodes crosses each node cut on one NCCL channel per
member (``pipette.comm.channel_links``), still dragged down by any slow link it uses. The
slowest group (pipeline replica, DP ring) sets the pace, since the step ends with a
collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pipette import comm, flops, perf_moe
from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.efficiency import EfficiencyCurve, default_curve, family, kernel_curve
from pipette.errors import SpecError
from pipette.estimates import TIME_PARTS, PerfEstimate
from pipette.memory import estimate_memory
from pipette.memory_cp import fold
from pipette.model import ModelSpec
from pipette.perf_compute import Kernels, compute_times, moe_times
from pipette.perf_constants import (
    ADAM_BYTES_PER_PARAM,
    DEFAULT_CONSTANTS,
    FUSED_LOSS_BYTES_PER_LOGIT,
    HF_DEEPSPEED_CONSTANTS,
    MEGATRON_CONSTANTS,
    SGD_BYTES_PER_PARAM,
    MemoryPressure,
    PerfConstants,
)
from pipette.perf_cp import CP_PART, stage_exposed, with_ring
from pipette.stacks import Stack, get_stack
from pipette.training import TrainingSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]



class PerfModel:
    """Placement-independent parts precomputed once per candidate."""

    def __init__(
        self,
        model: ModelSpec,
        training: TrainingSpec,
        config: ParallelConfig,
        cluster: ClusterProfile,
        *,
        constants: PerfConstants | None = None,
    ) -> None:
        _check(model, training, config, cluster)
        #: the candidate as given; under cp the model prices the job one cp rank equals
        #: (``pipette.memory_cp.fold``: s/cp tokens on dp x cp replicas) with the attention over
        #: the whole sequence's keys (``kv_seq``) and the KV exchange (``pipette.perf_cp``)
        self.job_training, self.job_config = training, config
        self.k = constants or DEFAULT_CONSTANTS
        #: packed documents attend within themselves where the stack's kernels keep to them
        self.kv_seq = training.attention_span if self.k.varlen_attention else training.seq_len
        training, config = fold(training, config)
        self.model, self.training, self.config, self.cluster = model, training, config, cluster
        self.layout = config.layout
        self.kernels = _kernels(self.k, cluster, training, config)
        self.device, self.peak, self.curve = self.kernels.device, self.kernels.peak, self.kernels.curve
        self.layers = np.asarray(config.layers_per_stage(model.layers), dtype=np.float64)
        self.m = config.grad_accum
        self.v = config.virtual_stages if config.schedule == "interleaved" else 1
        self.tokens = config.mbs * training.seq_len  # T: tokens per micro-batch
        b = training.dtype_bytes
        self.act_bytes = float(self.tokens * model.hidden * b)  # one activation tensor
        #: the MLPs of a model with experts (pipette.perf_moe); None for a dense model
        self.moe = moe_times(self.kernels, model, training, config) if model.moe is not None else None
        self.compute = compute_times(self.kernels, model, training, config, self.layers, self.kv_seq, self.moe)
        if self.job_config.cp > 1:
            self.compute = with_ring(self.compute, model, self.job_training, self.job_config, self.k,
                                     self.device, self.layers)
        self.pressure_stall = self._pressure_stall()
        self.stage_params = _stage_params(model, training, config)  # (p,) per device
        self.grad_bytes = self.stage_params * b
        # What ZeRO-3 gathers: every parameter it partitions, a LoRA run's frozen base too.
        self.weight_bytes = _stage_params(model, training, config, trainable=False) * b
        self.opt_time = self._optimizer_time()
        if self.moe is not None:  # the local experts' shard the optimizer updates
            per_param = SGD_BYTES_PER_PARAM if training.optimizer == "sgd" else ADAM_BYTES_PER_PARAM
            self.opt_time = self.opt_time + self.moe.expert_update_params * per_param / self.device.memory_bandwidth
        counted = flops.per_step(model, self.job_training, config.recompute, span=self.kv_seq)
        self.model_flops, self.hardware_flops = counted.model, counted.hardware

    def _pressure_stall(self) -> float:
        """Seconds per micro-batch and stage lost to the caching allocator near capacity
        (``PerfConstants.memory_pressure``; 0 when off)."""
        mp = self.k.memory_pressure
        if mp is None or mp.stall_s <= 0:
            return 0.0
        capacity = self.cluster.min_usable_memory
        est = estimate_memory(self.model, self.job_training, self.job_config, capacity, options=mp.options)
        return mp.stall(float(est.peak_bytes), float(capacity))

    def _optimizer_time(self) -> FloatArray:
        """Memory-bound update of the local shard (Rajbhandari et al. 2020, ZeRO >= 1)."""
        per_param = SGD_BYTES_PER_PARAM if self.training.optimizer == "sgd" else ADAM_BYTES_PER_PARAM
        shard = self.config.dp if self.config.zero_stage >= 1 else 1
        return np.asarray(
            self.stage_params * per_param / shard / self.device.memory_bandwidth, dtype=np.float64
        )

    # ---- communication under a placement --------------------------------------------
    def _placement(self, placement: Sequence[int] | npt.NDArray[np.integer] | None) -> IntArray:
        if placement is None:
            return np.asarray(self.config.devices(), dtype=np.int64)
        arr = np.asarray(placement, dtype=np.int64)
        if arr.shape != (self.config.world,):
            raise SpecError(
                f"placement has {arr.size} entries, the candidate has {self.config.world} ranks",
                field="config.placement", fix="give one device index per rank",
            )
        if arr.min() < 0 or arr.max() >= self.cluster.world:
            raise SpecError(
                f"placement uses device {int(arr.max())}, the cluster has {self.cluster.world}",
                field="config.placement", fix=f"use device indices 0..{self.cluster.world - 1}",
            )
        return arr

    def _parts(self, placement: Sequence[int] | npt.NDArray[np.integer] | None) -> dict[str, float]:
        """The step's time parts under ``placement``: each kind of communication's exposed time per
        micro-batch and stage, then the critical path over the pipeline replicas."""
        cfg, k = self.config, self.k
        p, dp, m, v = cfg.pp, cfg.dp, self.m, self.v
        devices = self._placement(placement)
        t_dp, t_dp_mb, t_z3 = _dp_times(self, devices)
        t_ep = np.zeros((p, dp))
        if self.moe is not None:
            t_ep, t_dp = self._moe_comm(devices, t_dp)
        t_dp_exposed = np.maximum(t_dp - k.dp_overlap * self.compute.backward, 0.0)
        if k.unit_collective_s > 0 and dp > 1:
            per_mb, per_step = _unit_collectives(cfg.zero_stage, p)
            units = self.layers + 1.0  # each decoder layer and the stage's root unit
            t_dp_mb = t_dp_mb + per_mb * units * k.unit_collective_s
            t_dp_exposed = t_dp_exposed + per_step * units * k.unit_collective_s

        # Critical path: per pipeline replica, then the slowest replica. A memory-pressure stall
        # (``MemoryPressure``) lengthens every stage's micro-batch, as compute on its stream does.
        comp = self.compute.forward + self.compute.backward + self.pressure_stall  # (p,)
        comms = {"tp_comm": _tp_time(self, devices), "pp_comm": _pp_time(self, devices), "zero3_gather": t_z3,
                 "ep_comm": t_ep, "dp_comm": np.repeat(t_dp_mb[:, None], dp, axis=1)}
        if self.job_config.cp > 1:
            cp_mb = stage_exposed(self.model, self.job_training, self.job_config, self.cluster, k,
                                  self.compute.attention, self.layers, devices)
            comms[CP_PART] = np.repeat(cp_mb[:, None], dp, axis=1)
        ideal, share = _critical_path(comp, comms, m, v, k.bubble_share)
        return {
            "compute": m * float(comp.max()),
            "tp_comm": share["tp_comm"],
            "pp_comm": share["pp_comm"],
            "dp_comm": share["dp_comm"] + float(t_dp_exposed.max()),
            "zero3_gather": share["zero3_gather"],
            "bubble": ideal - m * float(comp.max()),
            "optimizer": float(self.opt_time.max()),
            "embedding_sync": _embedding_sync(self, devices),
            **({CP_PART: share[CP_PART]} if CP_PART in share else {}),
            **({"ep_comm": share["ep_comm"]} if self.moe is not None else {}),
        }

    def _moe_comm(self, devices: IntArray, t_dp: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(p, dp) exposed all-to-all time per micro-batch, and ``t_dp`` with the expert gradients'
        reduction over the expert data-parallel rings (``pipette.perf_moe``)."""
        cfg, k, moe = self.config, self.k, self.moe
        if moe is None or self.model.moe is None:
            return np.zeros((cfg.pp, cfg.dp)), t_dp
        experts = self.model.moe.experts
        one = perf_moe.a2a_per_stage(self.cluster, cfg, self.model, devices, moe.a2a_bytes, k.moe)
        one = (one + k.collective_overhead_s) * (cfg.ep > 1)
        t_ep = np.maximum(moe.a2a_count * one * (1.0 - k.moe.a2a_overlap), 0.0)
        sync = perf_moe.expert_sync_per_stage(self.cluster, cfg, experts, devices, moe.expert_grad_bytes,
                                              k.link_fraction)
        return np.repeat(t_ep[:, None], cfg.dp, axis=1), t_dp + sync

    # ---- public -----------------------------------------------------------------------
    def step_time(self, placement: Sequence[int] | npt.NDArray[np.integer] | None = None) -> float:
        """Seconds per optimizer step (the fast path of the placement optimizer)."""
        return float(sum(self._parts(placement).values()))

    def estimate(self, placement: Sequence[int] | npt.NDArray[np.integer] | None = None) -> PerfEstimate:
        parts = self._parts(placement)
        breakdown = {key: parts[key] for key in (*TIME_PARTS, "ep_comm", CP_PART) if key in parts}
        step = float(sum(breakdown.values()))
        tokens = float(self.training.tokens_per_step)
        flops_peak = step * self.config.world * self.peak
        return PerfEstimate(
            step_time=step,
            breakdown=breakdown,
            tokens_per_s=tokens / step,
            mfu=self.model_flops / flops_peak,
            hfu=self.hardware_flops / flops_peak,
        )


def estimate_perf(
    model: ModelSpec, training: TrainingSpec, config: ParallelConfig, cluster: ClusterProfile,
    *, stack: str | Stack | None = None, constants: PerfConstants | None = None,
) -> PerfEstimate:
    """``PerfModel(...).estimate()`` for the config's own placement, priced for ``stack`` (a name such
    as ``"megatron"`` or ``"fsdp+compile"``, or a ``pipette.stacks.Stack``): its constants for the
    cluster's devices (``Stack.constants_for``). ``constants`` prices with those instead (the
    calibration benchmarks refit them); neither: Pipette's runner's GPU constants. An unknown stack
    is a ``SpecError`` naming the known ones."""
    if stack is not None and constants is not None:
        raise SpecError("both a stack and constants were given", field="stack",
                        fix="give the stack (its own constants) or the constants, not both")
    if stack is not None:
        constants = get_stack(stack).constants_for(cluster.device_spec.kind)
    return PerfModel(model, training, config, cluster, constants=constants).estimate()


# ---- communication under a placement: each kind's exposed time per micro-batch, (p, dp) -----------
def _tp_time(pm: PerfModel, devices: IntArray) -> FloatArray:
    """Tensor parallelism (Shoeybi et al. 2019, sec. 3): per layer 2 all-reduces of T h forward, 2
    backward, 2 more when full recomputation re-runs the forward; plus the vocabulary-parallel
    embedding's and LM head's input all-reduce. A TP group spanning nodes crosses each node cut on
    one channel per member (comm.channel_links); within a node this is the clique's slowest link."""
    cfg, k = pm.config, pm.k
    p, dp, tp = cfg.pp, cfg.dp, cfg.tp
    bw, lat = comm.channel_links(pm.cluster, comm.device_groups(pm.layout, devices, "tp"), k.cut_fraction)
    per_ar = comm.allreduce_time(pm.act_bytes, tp, bw * k.link_fraction, lat).reshape(p, dp)
    if tp > 1:
        per_ar = per_ar + k.collective_overhead_s
    n_ar = 4.0 + (2.0 if cfg.recompute == "full" else 0.0)
    if cfg.recompute == "selective" and k.op_sac_linear_share > 0 and k.sequence_parallel:
        # per-op checkpointing saves the reduce-scatters' outputs but recomputes the two
        # sequence-parallel all-gathers (torchtitan's ``_save_list`` holds
        # ``_c10d_functional.reduce_scatter_tensor``, not the all-gather): half an all-reduce each
        n_ar += 1.0
    n_layer_ar = pm.layers * n_ar
    n_layer_ar[0] += 2.0
    n_layer_ar[-1] += 2.0
    t_tp = per_ar * n_layer_ar[:, None]  # (p, dp)
    if k.tp_overlap > 0:
        t_tp = np.maximum(t_tp - k.tp_overlap * pm.compute.linear[:, None], 0.0)
    return np.asarray(t_tp, dtype=np.float64)


def _pp_time(pm: PerfModel, devices: IntArray) -> FloatArray:
    """Pipeline p2p: one activation forward and one gradient backward per boundary and micro-batch;
    v chunks per device cross v times, the last wrapping to stage 0 (Narayanan et al. 2021, sec. 2.2)."""
    cfg, k = pm.config, pm.k
    p, dp, tp, v = cfg.pp, cfg.dp, cfg.tp, pm.v
    if p == 1:
        return np.zeros((p, dp))
    pipes = comm.device_groups(pm.layout, devices, "pp").reshape(dp, tp, p)
    nxt = np.roll(pipes, -1, axis=2)
    bw_n, lat_n = comm.pair_links(pm.cluster, pipes, nxt)
    p2p_bytes = pm.act_bytes / tp if k.p2p_sequence_sharded else pm.act_bytes
    hop = comm.p2p_time(p2p_bytes, bw_n * k.link_fraction, lat_n).max(axis=1).T  # (p, dp)
    hop = hop + (k.collective_overhead_s if k.p2p_overhead_s is None else k.p2p_overhead_s)
    if v == 1:
        hop[-1] = 0.0  # no wrap-around for plain 1F1B
    elif k.overlap_p2p_comm:
        hop = hop * _blocking_hop_share(p, v, pm.m)
    # Stage s sends forward over hop s and receives the backward gradient over it.
    return np.asarray(v * (hop + np.roll(hop, 1, axis=0)), dtype=np.float64)


def _blocking_hop_share(p: int, v: int, m: int) -> float:
    """The share of an interleaved schedule's hops that still block under ``overlap_p2p_comm``: its
    warmup's forward chunks (and the flush's backward ones), ``2 (p - 1) + (v - 1) p`` on the first stage
    (Megatron-Core's ``get_pp_rank_microbatches`` with the default group of p micro-batches per virtual
    stage), of the ``m v`` chunks each pass runs; the steady state's hops run beside the next chunk."""
    return min(1.0, (2 * (p - 1) + (v - 1) * p) / (m * v))


def _dp_times(pm: PerfModel, devices: IntArray) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Data parallelism: (once a step per stage, per micro-batch per stage, ZeRO-3's gathers per
    micro-batch (p, dp)). A ring all-reduce of the gradients (ZeRO-1 reduce-scatter + all-gather moves
    the same bytes; Rajbhandari et al. 2020, sec. 7); ZeRO-2/3 reduce-scatter the gradients at every
    micro-batch's backward and all-gather the updated parameters once (stage 2) or at use (stage 3)."""
    cfg, k = pm.config, pm.k
    p, dp, tp = cfg.pp, cfg.dp, cfg.tp
    if k.dp_cut_fraction is None:
        bw_d, lat_d = comm.ring_links(pm.cluster, comm.device_groups(pm.layout, devices, "dp"))
    else:
        bw_d, lat_d = comm.channel_links(pm.cluster, comm.device_groups(pm.layout, devices, "dp"),
                                         k.dp_cut_fraction)
    bw_d = (bw_d * k.link_fraction).reshape(p, tp)
    lat_d = lat_d.reshape(p, tp)
    gb = pm.grad_bytes[:, None]
    t_z3 = np.zeros((p, dp))
    back = pm.compute.backward
    if cfg.zero_stage <= 1:
        return comm.allreduce_time(gb, dp, bw_d, lat_d).max(axis=1), np.zeros(p), t_z3
    rs = comm.reduce_scatter_time(gb, dp, bw_d, lat_d).max(axis=1)
    t_dp_mb = np.maximum(rs - k.dp_overlap * back, 0.0)
    ag = comm.allgather_time(gb, dp, bw_d, lat_d).max(axis=1)
    t_dp = ag if cfg.zero_stage == 2 else np.zeros(p)
    gather = np.zeros(p)
    n_g = 0.0
    if cfg.zero_stage == 3:
        # Parameter gathers before each forward and backward (and the recomputed
        # forward), prefetched under compute (Rajbhandari et al. 2020, sec. 5.3), of
        # every partitioned parameter: under LoRA the frozen base is sharded too and
        # gathered at every use, though only the adapters' gradients are reduced.
        wb = pm.weight_bytes[:, None]
        gather = comm.allgather_time(wb, dp, bw_d, lat_d).max(axis=1)
        regather = cfg.recompute == "full" and k.recompute_regathers
        n_g = 2.0 + (1.0 if regather else 0.0)
        comp = pm.compute.forward + back
        t_z3 = np.maximum(n_g * gather - k.dp_overlap * comp, 0.0)[:, None] * np.ones(dp)
    if k.shard_overlap is not None:
        t_z3_p, t_dp_mb = _shard_exposed(gather, n_g, rs, pm.compute.forward, back, k.shard_overlap)
        t_z3 = t_z3_p[:, None] * np.ones(dp)
    return t_dp, t_dp_mb, t_z3


def _critical_path(
    comp: FloatArray, comms: dict[str, FloatArray], m: int, v: int, beta: float
) -> tuple[float, dict[str, float]]:
    """(the pipeline's time without communication, what each kind of communication adds to the
    slowest replica's critical path). Compute and its bubble are the pipeline without communication
    (placement-independent); what communication adds is split over its kinds by their weight in the
    same formula (``_pipeline``)."""
    stage = comp[:, None] + sum(comms.values())  # (p, dp)
    pipe = _pipeline(stage, m, v, beta)
    d = int(np.argmax(pipe))
    ideal = float(_pipeline(comp[:, None], m, v, beta)[0])
    exposed = float(pipe[d]) - ideal
    weights = {key: float(_pipeline(c[:, d : d + 1], m, v, beta)[0]) for key, c in comms.items()}
    total = sum(weights.values())
    return ideal, {key: (exposed * w / total if total > 0 else 0.0) for key, w in weights.items()}


def _embedding_sync(pm: PerfModel, devices: IntArray) -> float:
    """Tied embeddings split over stages: all-reduce of the embedding gradient between the first and
    last stage (Shoeybi et al. 2019, Megatron-LM's embedding group)."""
    if pm.config.pp == 1 or not pm.model.tied_embeddings:
        return 0.0
    chains = comm.device_groups(pm.layout, devices, "pp")  # (dp * tp, pp)
    first, last = chains[:, 0], chains[:, -1]
    bw_e, lat_e = comm.pair_links(pm.cluster, first, last)
    nbytes = pm.model.vocab * pm.model.hidden / pm.config.tp * pm.training.dtype_bytes
    return float(comm.allreduce_time(nbytes, 2, bw_e * pm.k.link_fraction, lat_e).max())


# ---- helpers ----------------------------------------------------------------------------
def _check(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, cluster: ClusterProfile) -> None:
    if config.world > cluster.world:
        raise SpecError(
            f"the candidate needs {config.world} devices, the cluster has {cluster.world}",
            field="config", fix="lower tp x pp x dp or use a larger cluster",
        )
    if config.global_batch != training.global_batch:
        raise SpecError(
            f"config global batch {config.global_batch} differs from training {training.global_batch}",
            field="config.global_batch", fix="use the training spec's global batch",
        )


def _pipeline(stage: FloatArray, m: int, v: int, bubble_share: float = 1.0) -> FloatArray:
    """1F1B time of each pipeline (column) from per-stage micro-batch times (rows):
    ``m * max_s t_s + beta * (sum_s t_s - max_s t_s) / v`` (Narayanan et al. 2021, sec. 2.2;
    ``beta``: ``PerfConstants.bubble_share``)."""
    top = stage.max(axis=0)
    return np.asarray(m * top + bubble_share * (stage.sum(axis=0) - top) / v, dtype=np.float64)


def _unit_collectives(zero_stage: int, pp: int) -> tuple[float, float]:
    """Collectives per FSDP2 unit over its data-parallel group: (per micro-batch, once per step);
    ZeRO-1, which FSDP has not, as NO_SHARD. Without a pipeline every micro-batch's forward and
    backward run them: NO_SHARD (``replicate``) all-reduces the gradients (1); SHARD_GRAD_OP
    gathers in the forward and reduce-scatters in the backward (2); FULL_SHARD gathers again for
    the backward (3) (``fully_shard``'s docs; workers.rank.fsdp_rank's loop syncs at every
    micro-batch). Under ``torch.distributed.pipelining`` the stage runs every backward but the
    last with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``
    (``PipelineStage.backward_maybe_with_nosync``): the gradients are reduced once, at the last
    micro-batch; SHARD_GRAD_OP gathers once; FULL_SHARD reshards after each forward and gathers
    again in each backward (one a micro-batch), plus the first forward's."""
    sharded = zero_stage >= 2
    if pp == 1:
        return 1.0 + sharded + (zero_stage == 3), 0.0
    return float(zero_stage == 3), 1.0 + sharded


def _shard_exposed(gather: FloatArray, n_gathers: float, reduce_scatter: FloatArray, forward: FloatArray,
                   backward: FloatArray, overlap: float) -> tuple[FloatArray, FloatArray]:
    """Exposed (gather, reduce-scatter) time per micro-batch and stage when FSDP/ZeRO-3 runs them
    on a communication stream beside the compute (``PerfConstants.shard_overlap``): the forward
    hides its one gather under ``overlap`` of the forward compute; the backward its other gathers
    and the reduce-scatter under ``overlap`` of the backward compute (two streams: the phase takes
    the longer of the two, so ``max(comm - overlap * compute, 0)`` is exposed). The backward's
    exposed part is split over gathers and reduce-scatter by their shares."""
    fwd = np.maximum(gather * min(n_gathers, 1.0) - overlap * forward, 0.0)
    bwd_gather = gather * max(n_gathers - 1.0, 0.0)
    bwd_comm = bwd_gather + reduce_scatter
    bwd = np.maximum(bwd_comm - overlap * backward, 0.0)
    share = np.divide(bwd_gather, bwd_comm, out=np.zeros_like(bwd_comm), where=bwd_comm > 0)
    return fwd + bwd * share, bwd * (1.0 - share)


def _curve(k: PerfConstants, device: DeviceSpec) -> EfficiencyCurve:
    """The GEMM efficiency curve: the constants' own, else the device's measured points (the
    probe), else (``kernel_tables_first``) the family's measured kernel timings, else the constants' curve for
    the device's family, else the family default."""
    if k.curve is not None:
        return k.curve
    kernels = kernel_curve(device) if k.kernel_tables_first and not device.efficiency else None
    if kernels is not None:
        return kernels
    by_family = dict(k.curves)
    if not device.efficiency and family(device) in by_family:
        return by_family[family(device)]
    return default_curve(device)


def _curve_scale(device: DeviceSpec, dtype: str) -> float:
    """How much larger a bf16 GEMM of the same duration is than a ``dtype`` GEMM of the same FLOPs.

    The curves were calibrated on bf16 and fp16 GEMMs; a GEMM fills the SMs in a given time, so a
    TF32 GEMM of x FLOPs, at half the bf16 peak, sits on the curve where a bf16 GEMM of twice x does
    (the rule ``_linear_time`` applies to FP8). 1 for every other dtype: fp32 on a GPU is read at its
    own size, as the curves always were, and a device without TF32 tensor cores runs ``tf32`` as fp32.
    """
    if dtype != "tf32" or "tf32" not in device.peak_flops:
        return 1.0
    half = device.peak_flops.get("bf16", device.peak_flops.get("fp16"))
    return half / device.peak_flops["tf32"] if half else 1.0


def _kernels(k: PerfConstants, cluster: ClusterProfile, training: TrainingSpec, config: ParallelConfig) -> Kernels:
    """The GEMM pricing of the slowest device: its peak in the training dtype; the linear layers' peak,
    FP8 where the stack runs them so and the device has it; the curve (``_curve``) read at GEMM sizes
    scaled to the duration of the bf16 GEMM it was calibrated on (``_curve_scale``)."""
    device = _slowest_device(cluster, training.dtype)
    share = tensor_rate_share(k, device)
    peak = device.peak(training.dtype) * share
    fp8 = k.fp8_gemms and k.low_precision_peak in device.peak_flops
    linear_peak = device.peak_flops[k.low_precision_peak] * share if fp8 else peak
    return Kernels(k, device, peak, fp8, linear_peak, _curve(k, device), _curve_scale(device, training.dtype),
                   config.tp, training.dtype_bytes, share)


def tensor_rate_share(k: PerfConstants, device: DeviceSpec) -> float:
    """``PerfConstants.tensor_rate_shares`` of ``device`` (the first name token it contains), else 1."""
    name = device.name.upper()
    return next((share for token, share in k.tensor_rate_shares if token.upper() in name), 1.0)


def _slowest_device(cluster: ClusterProfile, dtype: str) -> DeviceSpec:
    """The device with the lowest peak: synchronous training runs at its pace everywhere."""
    return min((d.spec for d in cluster.devices), key=lambda spec: spec.peak(dtype))


def _stage_params(model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                  *, trainable: bool = True) -> FloatArray:
    """Parameters held by one device of each stage (Megatron split by tp): the trainable ones
    (what gradients and optimizer states cover), or all of them (``trainable=False``: what
    ZeRO-3 partitions and gathers, the frozen base of a LoRA run included)."""
    layers = np.asarray(config.layers_per_stage(model.layers), dtype=np.float64)
    adapters = np.zeros_like(layers)
    if training.is_lora and training.lora is not None:
        lora = training.lora
        shapes = model.linear_shapes()
        per_layer = sum(lora.rank * (shapes[t][0] + shapes[t][1]) for t in lora.targets if t in shapes)
        adapters = layers * per_layer / config.tp
        if trainable:
            return np.asarray(adapters, dtype=np.float64)
    params = layers * model.layer_params()
    params[0] += model.embedding_params()
    # The last stage holds the head; tied embeddings keep a copy there only when pp > 1.
    head = model.head_params()
    if model.tied_embeddings and config.pp > 1:
        head += model.vocab * model.hidden
    params[-1] += head
    if model.moe is not None:  # dense MLPs, routers and shared experts (the experts: pipette.perf_moe)
        params = params + perf_moe.replicated_params(model, training, config) * config.tp
    return np.asarray(params / config.tp + adapters, dtype=np.float64)


__all__ = [
    "DEFAULT_CONSTANTS",
    "FUSED_LOSS_BYTES_PER_LOGIT",
    "HF_DEEPSPEED_CONSTANTS",
    "MEGATRON_CONSTANTS",
    "MemoryPressure",
    "PerfConstants",
    "PerfModel",
    "estimate_perf",
]
