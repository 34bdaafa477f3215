"""Where each step-time constant came from: the set and how many of its rows fitted it, or that it was
counted (from a paper or a framework's source) or calibrated on one published figure.

A constant *calibrated on* a row was chosen until that one figure matched: the row then says nothing
about the model's accuracy, so it is never scored (tests/benchmarks/crossval.py scores only the sets
of ``data/calibration/``, and ``tests/benchmarks/mlperf_lora.py`` labels its figure so). The
cross-validated verdicts of the fitted ones are in docs/results.md. Data only; a test checks that
every name resolves.
"""

from __future__ import annotations

from dataclasses import dataclass

#: how a constant was set
FITTED, COUNTED, CALIBRATED = "fitted", "counted", "calibrated"


@dataclass(frozen=True)
class Source:
    """One constant (``module.NAME``, or ``module.NAME.field`` of a ``PerfConstants``) and its origin."""

    constant: str
    stack: str
    how: str
    #: the calibration file(s) of data/calibration (or the recorded run) it was fitted on
    data: str = ""
    #: how many rows of ``data`` fitted it (0 where counted)
    rows: int = 0
    #: for ``calibrated``: the published figure it was chosen to match; otherwise a short note
    note: str = ""


_VT_US = "vtrain_a100_single_node.csv (1440) + ultrascale_h100_1b_3b_8b.csv healthy rows (816)"
_SHARED = ("STEEPNESS", "LINK_FRACTION", "LAYER_OVERHEAD_S", "DP_OVERLAP", "COLLECTIVE_OVERHEAD_S",
           "ELEMENTWISE_PASSES", "SCORE_PASSES")
_TT = "torchtitan_h100_fsdp2.csv"

SOURCES: tuple[Source, ...] = (
    Source("pipette.efficiency.A100_MAX_FRACTION", "megatron", FITTED, _VT_US, 2256),
    Source("pipette.efficiency.A100_HALF_FLOPS", "megatron", FITTED, _VT_US, 2256),
    Source("pipette.efficiency.H100_MAX_FRACTION", "megatron", FITTED, _VT_US, 2256),
    Source("pipette.efficiency.H100_HALF_FLOPS", "megatron", FITTED, _VT_US, 2256),
    *(Source(f"pipette.{'efficiency' if n == 'STEEPNESS' else 'perf_constants'}.{n}", "megatron", FITTED, _VT_US,
             2256) for n in _SHARED),
    Source("pipette.perf_constants.CUT_FRACTION", "megatron", FITTED,
           "ultrascale_h100_1b_3b_8b.csv healthy rows with tp 16 or 32", 75, "scanned 0.3-0.7"),
    Source("pipette.efficiency.B200_MAX_FRACTION", "megatron", FITTED, "simumax_b200_megatron.csv llama3-70b-l12", 12),
    Source("pipette.efficiency.B200_HALF_FLOPS", "megatron", FITTED, "simumax_b200_megatron.csv llama3-70b-l12", 12),
    Source("pipette.stacks.MEGATRON_PRESSURE_STALL_S", "megatron+alloc-pressure", FITTED,
           "ultrascale_h100_1b_3b_8b.csv (17 of 21 jobs)", 1345),
    Source("pipette.stacks.MEGATRON_PRESSURE_ONSET", "megatron+alloc-pressure", FITTED,
           "ultrascale_h100_1b_3b_8b.csv (17 of 21 jobs)", 1345),
    Source("pipette.stacks.MEGATRON_FP8_EFFICIENCY", "megatron+fp8", FITTED, "megatron_bridge_moe_dense.csv", 27),
    Source("pipette.stacks.MEGATRON_MXFP8_EFFICIENCY", "megatron+mxfp8", FITTED, "megatron_bridge_moe_dense.csv", 22),
    Source("pipette.stacks.MEGATRON_NVFP4_EFFICIENCY", "megatron+nvfp4", FITTED, "megatron_bridge_moe_dense.csv", 18,
           note="relative to the FP8 tensor rate (Stack.nvfp4_peak)"),
    *(Source(f"pipette.stacks.MEGATRON_{gpu}_TENSOR_RATE", "megatron+fp8", FITTED, "megatron_bridge_moe_dense.csv",
             rows, note=f"the {gpu} rows; fitted with the recipes' efficiencies on all 67 dense rows (B200 the "
                        "reference)") for gpu, rows in (("GB300", 23), ("GB200", 31), ("H100", 9))),
    Source("pipette.stacks.MEGATRON_FP8_CONSTANTS.measured_attention", "megatron+fp8", COUNTED,
           note="cuDNN's fused attention timings per chip (data/kernels/attention.csv, cudnn-frontend)"),
    Source("pipette.stacks.MEGATRON_FP8_CONSTANTS.tp_overlap", "megatron+fp8", CALIBRATED,
           note="MLPerf Training v4.0 Llama-2-70B LoRA on 8x H100 (2.155 samples/s, a 3.71 s step; "
                "tests/benchmarks/mlperf_lora.py): counted from Transformer Engine's userbuffer overlap, kept "
                "because that figure matched"),
    Source("pipette.stacks.MEGATRON_FP8_CONSTANTS.fp8_casts_fused", "megatron+fp8", COUNTED,
           note="Transformer Engine's LayerNormLinear / LayerNormMLP and NeMo's fp8_params"),
    Source("pipette.perf_constants.HF_ELEMENTWISE_PASSES", "pipette", FITTED, "h100_single_gpu.csv", 9),
    Source("pipette.perf_constants.HF_FFN_PASSES", "pipette", FITTED, "h100_single_gpu.csv", 9),
    Source("pipette.perf_constants.HF_LAYER_OVERHEAD_S", "pipette", FITTED, "h100_single_gpu.csv", 9),
    Source("pipette.stacks.PIPETTE_CPU_CONSTANTS.layer_overhead_s", "pipette (CPU)", FITTED,
           "results/cpu-2026-11-27/real_tuning_both.json pipette rows", 36),
    Source("pipette.stacks.PIPETTE_CPU_CONSTANTS.collective_overhead_s", "pipette (CPU)", FITTED,
           "results/cpu-2026-11-27/real_tuning_both.json pipette rows", 36),
    *(Source(f"pipette.stacks.FSDP_CONSTANTS.{n}", "fsdp", FITTED,
             "llmfoundry_h100_fsdp.csv bf16 MPT 760M/3B/13B/70B", 38)
      for n in ("elementwise_passes", "layer_overhead_s", "attention_efficiency", "shard_overlap", "dp_cut_fraction")),
    Source("pipette.stacks.FSDP_CONSTANTS.fp8_efficiency", "fsdp+fp8", FITTED, "llmfoundry_h100_fsdp.csv fp8", 7),
    Source("pipette.stacks.FSDP_A100_ATTENTION_EFFICIENCY", "fsdp", COUNTED,
           note="0.181 x 0.615 / 0.35: FlashAttention-2's utilization on A100 (Dao 2023) over H100 (Shah et al. 2024)"),
    *(Source(f"pipette.stacks.FSDP_CPU_CONSTANTS.{n}", "fsdp (CPU)", FITTED,
             "results/cpu-2026-11-27/real_tuning_both.json fsdp rows", 27)
      for n in ("layer_overhead_s", "unit_collective_s", "bubble_share")),
    Source("pipette.stacks.FSDP_CPU_CONSTANTS.collective_overhead_s", "fsdp (CPU)", FITTED,
           "tests/benchmarks/fsdp_cpu_calibration.py dedicated trials", 8),
    Source("pipette.perf_moe.MEGATRON_MOE.grouped_share", "megatron", FITTED,
           "megatron_bridge_moe_dense.csv MoE rows of releases 26.x (one per layout) + simumax_b200_megatron.csv "
           "DeepSeek rows", 27, "tests/benchmarks/moe_fit.py; the 25.x rows kept aside"),
    Source("pipette.perf_moe.MEGATRON_MOE.layer_host_s", "megatron", FITTED,
           "megatron_bridge_moe_dense.csv (26.x) + simumax_b200_megatron.csv: the rows of the 27 whose host waits", 12,
           "tests/benchmarks/moe_fit.py; no host sync under the all-to-all dispatcher with a capacity factor, "
           "or under a whole-step CUDA graph"),
    Source("pipette.perf_moe.MEGATRON_MOE.a2a_overlap", "megatron", COUNTED,
           note="0: the emitted megatron_args.txt does not overlap the all-to-all; the share hidden where a "
                "Megatron-Bridge recipe does (0.95, the fit's upper bound) is fitted on its 5 rows (docs/moe.md)"),
    Source("pipette.perf_moe.MEGATRON_MOE.imbalance", "megatron", COUNTED,
           note="1: the rows cannot tell it from grouped_share"),
    Source("pipette.perf_moe.DEFAULT_MOE.grouped_half_tokens", "all", FITTED,
           "data/kernels/grouped_gemm.csv (SimuMax's B200 Transformer Engine grouped GEMMs; "
           "tests/benchmarks/grouped_gemm_fit.py)", 108,
           "0.485 M / (M + 268) of the B200 bf16 peak"),
    Source("tests.benchmarks.calibration.TORCHTITAN_POWER_CAP_SHARE", "fsdp", FITTED, f"{_TT} tt00, tt07", 2),
    Source("pipette.stacks.FSDP_COMPILE_ELEMENTWISE_SHARE", "fsdp+compile", FITTED, f"{_TT} tt01, tt08", 2),
    Source("pipette.stacks.FSDP_COMPILE_FP8_EFFICIENCY", "fsdp+compile+fp8", FITTED, f"{_TT} tt02, tt09", 2),
    Source("pipette.stacks.FSDP_ASYNC_TP_OVERLAP", "fsdp+async-tp", FITTED, f"{_TT} tt19", 1),
    Source("pipette.stacks.FSDP_FP8_ROWWISE_EFFICIENCY", "fsdp+fp8-rowwise", FITTED, f"{_TT} tt22", 1),
)


def calibrated_rows() -> tuple[str, ...]:
    """The published figures constants were chosen to match: never scored."""
    return tuple(s.note for s in SOURCES if s.how == CALIBRATED)


__all__ = ["CALIBRATED", "COUNTED", "FITTED", "SOURCES", "Source", "calibrated_rows"]
