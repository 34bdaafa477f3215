"""The performance model's compute part: one micro-batch's forward and backward time per pipeline
stage, independent of the placement (``pipette.perf.PerfModel`` prices the communication).

Per layer (Narayanan et al. 2021, sec. 5.1 FLOP counts): the linear layers' GEMMs at the stack's
efficiency curve (``Kernels``), the attention core, the memory-bound passes at the memory bandwidth
(roofline; Williams et al. 2009), and what recomputation re-runs (Korthikanti et al. 2022, sec. 4);
the LM head and the loss on the last stage; the MLPs of a model with experts (``pipette.perf_moe``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipette import memory_moe, perf_moe
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.efficiency import EfficiencyCurve, family, flash_attention_rate, kernel_attention
from pipette.model import ModelSpec
from pipette.perf_constants import FP8_CAST_BYTES, PerfConstants
from pipette.training import TrainingSpec

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Compute:
    """Placement-independent per-stage times of one micro-batch (seconds)."""

    forward: FloatArray  # (p,)
    backward: FloatArray  # (p,), recomputation included
    #: the linear layers' GEMM time of both passes (recomputation included): what TP overlap hides under
    linear: FloatArray  # (p,)
    #: one layer's attention (forward, backward): what a cp ring's transfers hide under (pipette.perf_cp)
    attention: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class Kernels:
    """How long one GEMM, one linear layer and one LoRA adapter take on the slowest device, at the
    stack's constants: the efficiency curve read at ``curve_scale`` times the GEMM's size, the
    linear layers at ``linear_peak`` (FP8 where ``fp8``)."""

    k: PerfConstants
    device: DeviceSpec
    peak: float
    fp8: bool
    linear_peak: float
    curve: EfficiencyCurve
    curve_scale: float
    tp: int
    dtype_bytes: int
    #: ``PerfConstants.tensor_rate_shares`` of the device, already in ``peak`` and ``linear_peak``
    tensor_share: float = 1.0

    def gemm_time(self, flops_per_gemm: float, count: float) -> float:
        """Time of ``count`` GEMMs of ``flops_per_gemm`` each at the curve's efficiency."""
        if count <= 0 or flops_per_gemm <= 0:
            return 0.0
        eff = float(self.curve(flops_per_gemm * self.curve_scale))
        return count * flops_per_gemm / (self.peak * eff)

    def linear_time(self, flops_per_gemm: float, tokens: float, fan_in: int, fan_out: int) -> float:
        """One linear layer's forward GEMM, in the training dtype or in FP8 (``fp8_gemms``). An FP8
        GEMM runs at the FP8 peak times the bf16 curve at the same duration (the curve's size
        scaled by bf16 / fp8 peak: a kernel fills the SMs in the same time), times
        ``fp8_efficiency``; plus the dynamic-scaling casts of its input, weight and (in the
        backward, counted here at 2x with the GEMMs) output gradient: an amax read (2 B) and a
        scaled cast (2 B read, 1 B written) per element (torchao float8 / Transformer Engine
        delayed or dynamic scaling), at the memory bandwidth."""
        if not self.fp8:
            return self.gemm_time(flops_per_gemm, 1)
        if flops_per_gemm <= 0:
            return 0.0
        eff = (
            float(self.curve(flops_per_gemm * self.curve_scale * self.peak / self.linear_peak)) * self.k.fp8_efficiency
        )
        gemm = flops_per_gemm / (self.linear_peak * eff)
        if self.k.fp8_casts_fused:
            return gemm
        tp = self.tp
        cast_elements = tokens * fan_in / (tp if self.k.sequence_parallel else 1) + fan_in * fan_out / tp
        return gemm + FP8_CAST_BYTES * cast_elements / self.device.memory_bandwidth

    def adapter_time(self, tokens: float, rank: int, fan_in: int, fan_out: int) -> float:
        """One LoRA adapter's forward (``x A`` then ``(x A) B``), or with ``thin_gemm_roofline`` the
        roofline of it: its FLOPs at the curve's large-GEMM efficiency or its bytes (``x`` read, the
        rank-wide product written and read, the output added to; weights negligible) at the memory
        bandwidth, whichever is longer (Williams et al. 2009)."""
        tp, work = self.tp, 2.0 * tokens * rank * (fan_in + fan_out) / self.tp
        if not self.k.thin_gemm_roofline:
            return self.gemm_time(work, 1)
        b = self.dtype_bytes
        nbytes = b * tokens * (fan_in / tp + 2.0 * rank + 2.0 * fan_out / tp)
        return max(work / (self.peak * float(self.curve(1e15))), nbytes / self.device.memory_bandwidth)


def compute_times(
    kernels: Kernels,
    model: ModelSpec,
    training: TrainingSpec,
    config: ParallelConfig,
    layers: FloatArray,
    kv_seq: int,
    moe: perf_moe.MoeTimes | None,
) -> Compute:
    """Forward and backward of one micro-batch on each stage of ``layers`` decoder layers (the
    recipe and layout as one cp rank runs them; ``kv_seq`` the keys a query attends over)."""
    k, t, tp, s = kernels.k, float(config.mbs * training.seq_len), config.tp, kv_seq
    lin_f, lin_b = _linear_times(kernels, model, training, t)
    attn_f, attn_b = _attention_times(kernels, model, t, s)
    # Memory-bound ops: activation passes and attention-score passes, at the device's
    # memory bandwidth (roofline: bytes / bandwidth; Williams et al. 2009). A fused
    # attention kernel never writes the scores.
    b, bw = training.dtype_bytes, kernels.device.memory_bandwidth
    sp = tp if k.sequence_parallel else 1
    passes = k.elementwise_passes * model.hidden / sp + k.ffn_passes * memory_moe.dense_ffn(model) / tp
    elementwise = passes * t * b / bw
    score_passes = 0.0 if k.flash_attention else k.score_passes
    scores = score_passes * t * s * model.heads / tp * b / bw
    over = k.layer_overhead_s
    layer_f = lin_f + attn_f + elementwise + scores + over
    layer_b = lin_b + attn_b + 2.0 * (elementwise + scores + over)
    layer_b += _recomputed(k, config, lin_f, attn_f, elementwise, over, layer_f)
    forward = layers * layer_f
    backward = layers * layer_b
    linear = layers * (lin_f + lin_b + (lin_f if config.recompute == "full" else 0.0))
    # LM head on the last stage: the logits GEMM 2 T h V / tp (2x backward) and the
    # memory-bound fp32 loss over the T V / tp logits.
    head = kernels.gemm_time(2.0 * t * model.hidden * model.vocab / tp, 1)
    loss = t * model.vocab / tp * k.loss_bytes_per_logit / kernels.device.memory_bandwidth
    forward[-1] += head + loss / 2.0
    backward[-1] += (head if training.is_lora and training.lora is not None else 2.0 * head) + loss / 2.0
    if moe is not None:
        forward, backward = forward + moe.forward, backward + moe.backward
    return Compute(forward=forward, backward=backward, linear=linear, attention=(attn_f, attn_b))


def _linear_times(kernels: Kernels, model: ModelSpec, training: TrainingSpec, t: float) -> tuple[float, float]:
    """(forward, backward) of one layer's linear layers and adapters for ``t`` tokens. Forward
    2 T in out / tp FLOPs each; backward 2x (data and weight gradients), 1x for a frozen LoRA base,
    which needs no weight gradient."""
    lora = training.lora if training.is_lora else None
    targets = set(lora.targets) if lora is not None else set()
    lin_f = lin_b = 0.0
    for name, (i, o) in model.linear_shapes().items():
        g = kernels.linear_time(2.0 * t * i * o / kernels.tp, t, i, o)
        lin_f += g
        lin_b += g if lora is not None else 2.0 * g
        if lora is not None and name in targets:
            # Adapter B A x (Hu et al. 2021): two thin GEMMs, forward and 2x backward.
            a = kernels.adapter_time(t, lora.rank, i, o)
            lin_f += a
            lin_b += 2.0 * a
    return lin_f, lin_b


def _attention_times(kernels: Kernels, model: ModelSpec, t: float, s: int) -> tuple[float, float]:
    """(forward, backward) of one layer's attention core for ``t`` queries over ``s`` keys: QK^T and
    softmax x V, 2 x 2 T s h / tp FLOPs, causal half skipped by fused kernels (FlashAttention; Dao
    et al. 2022)."""
    k, peak = kernels.k, kernels.device.attention_flops or kernels.peak
    attn_gemm = 2.0 * t * s * perf_moe.attention_width(model) / kernels.tp * 0.5
    attention_efficiency = dict(k.attention_efficiencies).get(family(kernels.device), k.attention_efficiency)
    tables = k.kernel_tables_first or k.measured_attention
    measured = kernel_attention(kernels.device) if tables and k.flash_attention else None
    if measured is not None:
        # the fused kernel's measured rates, forward and backward (pipette.kernel_tables), as fractions of
        # the data-sheet peak: the GEMMs' sustained-rate share does not apply to them
        peak = peak / kernels.tensor_share
        attn_f = 2.0 * attn_gemm / (peak * measured[0])
    elif k.flash_attention and attention_efficiency > 0:
        attn_f = 2.0 * attn_gemm / (peak * attention_efficiency)
    elif k.flash_attention and k.flash_attention_rates and \
            (rate := flash_attention_rate(kernels.device, model.head_dim, s)) is not None:
        attn_f = 2.0 * attn_gemm / (peak * rate)
    else:
        attn_f = kernels.gemm_time(attn_gemm, 2)
    # FlashAttention-2's backward recomputes the scores: 5 matmuls against the forward's 2
    # (Dao 2023, sec. 3.1); an unfused backward runs 4 (the gradients of both inputs).
    attn_b = (2.5 if k.flash_attention else 2.0) * attn_f
    if measured is not None:
        attn_b = 2.5 * 2.0 * attn_gemm / (peak * measured[1])
    return attn_f, attn_b


def _recomputed(
    k: PerfConstants,
    config: ParallelConfig,
    lin_f: float,
    attn_f: float,
    elementwise: float,
    over: float,
    layer_f: float,
) -> float:
    """What recomputation adds to one layer's backward (Korthikanti et al. 2022, sec. 4): full re-runs
    the layer's forward; selective re-runs only the attention core."""
    if config.recompute == "full":
        return layer_f
    if config.recompute == "selective" and k.op_sac_linear_share > 0:
        # Per-op selective checkpointing (torchtitan's "op" mode): the attention kernel's
        # output and a share of the matmuls' outputs are saved, everything else (the other
        # matmuls, norms, activations) is recomputed in the backward.
        return k.op_sac_linear_share * lin_f + elementwise + over
    if config.recompute == "selective":
        return attn_f
    return 0.0


def moe_times(kernels: Kernels, model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> perf_moe.MoeTimes:
    """The MLPs of a model with experts, per stage and micro-batch (``pipette.perf_moe``): their
    GEMMs at this stack's curve and dtype (FP8 where it runs the linear layers so)."""
    k = kernels.k
    large = float(kernels.curve(1e15 * kernels.curve_scale)) * (k.fp8_efficiency if kernels.fp8 else 1.0)
    tokens = float(config.mbs * training.seq_len)
    return perf_moe.moe_times(
        model,
        training,
        config,
        gemm=lambda f: kernels.linear_time(f, tokens, model.hidden, model.hidden),
        grouped_peak=kernels.linear_peak,
        large=large,
        bandwidth=kernels.device.memory_bandwidth,
        ffn_passes=k.ffn_passes,
        k=k.moe,
    )
