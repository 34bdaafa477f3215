"""The fits the project ships, as problems for the cross-validation harness (tests/benchmarks/crossval.py).

Each problem names the rows it fits, the parameters (neutral starts: textbook or mid-range values,
never the constants fitted on all rows), how a row is predicted from them, and its jobs:

* ``megatron``: the shared Megatron / nanotron constants (GEMM curves of the A100 and H100 families,
  link share, per-layer and per-collective fixed times, DP overlap, elementwise and score passes) on
  vTrain's A100 rows (Megatron-DeepSpeed) and Ultra-Scale's H100 rows (nanotron; fitted on its
  healthy rows, every row scored). Jobs: (set, model, GPUs); 4 folds of jobs, 500 rows fitted a fold.
* ``megatron-b200``: the B200 GEMM curve on SimuMax's Megatron-LM rows, the other constants as
  shipped (fitted on vTrain and Ultra-Scale only). Leave one job out.
* ``pipette``: the HF/DeepSpeed runner's three terms on h100_single_gpu.csv. Leave one job out.
* ``fsdp``: the fsdp stack's five terms and the FP8 efficiency on llm-foundry's rows. Jobs: one
  model each (leave one model out).
* ``fsdp-torchtitan``: torchtitan's power-capped peak share and its compile, Float8, async-TP and
  rowwise terms on torchtitan's rows, the fsdp terms as shipped (fitted on llm-foundry only).
  Leave one job out: a term whose only runs are held out stays at its neutral start.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

import numpy as np

from pipette.clusterfile import homogeneous_cluster
from pipette.efficiency import EfficiencyCurve, family
from pipette.perf import PerfModel
from pipette.perf_constants import HF_DEEPSPEED_CONSTANTS, MEGATRON_CONSTANTS, PerfConstants
from pipette.stacks import FSDP, get_stack
from tests.benchmarks.calibration import (
    GpuRun,
    Row,
    calibration_dir,
    h100_96gb,
    load_h100_single_gpu,
    load_stack_set,
    load_ultrascale,
    load_vtrain,
    stack_cluster,
)
from tests.benchmarks.crossval import Param, Problem, Sample


def _samples(set_name: str, rows: Sequence[Row]) -> tuple[Sample, ...]:
    return tuple(Sample(f"{set_name}:{i}", set_name, r) for i, r in enumerate(rows))


def _step(row: Row, k: PerfConstants) -> float:
    return PerfModel(row.model, row.training, row.config, row.cluster, constants=k).step_time()


# ---- megatron: vTrain + Ultra-Scale --------------------------------------------------------------
MEGATRON_PARAMS = (
    Param("a100_max_fraction", 0.6, 0.2, 1.0), Param("a100_half_flops", 1e10, 1e7, 1e13),
    Param("h100_max_fraction", 0.6, 0.2, 1.0), Param("h100_half_flops", 1e10, 1e7, 1e13),
    Param("steepness", 1.0, 0.3, 3.0), Param("link_fraction", 0.8, 0.1, 1.0),
    Param("layer_overhead_s", 1e-4, 0.0, 5e-3), Param("dp_overlap", 0.1, 0.0, 1.0),
    Param("collective_overhead_s", 1e-5, 0.0, 5e-3), Param("elementwise_passes", 10.0, 0.0, 100.0),
    Param("score_passes", 3.0, 0.0, 100.0),
)


def megatron_constants(x: np.ndarray, fam: str) -> PerfConstants:
    """The shared constants from the parameter vector, with the GEMM curve of ``fam``."""
    curve = EfficiencyCurve(float(x[2]), float(x[3]), float(x[4])) if fam == "h100" \
        else EfficiencyCurve(float(x[0]), float(x[1]), float(x[4]))
    return replace(MEGATRON_CONSTANTS, link_fraction=float(x[5]), layer_overhead_s=float(x[6]),
                   dp_overlap=float(x[7]), collective_overhead_s=float(x[8]), elementwise_passes=float(x[9]),
                   score_passes=float(x[10]), curve=curve)


def _megatron_predict(x: np.ndarray, row: Row) -> float:
    return _step(row, megatron_constants(x, family(row.cluster.device_spec)))


def _ultrascale_healthy(rows: Sequence[Row]) -> set[int]:
    """Indices of the healthy Ultra-Scale rows (tests/benchmarks/accuracy.py's rule: consistent
    batch columns, at least a quarter of the best throughput of their (model, nodes) group)."""
    from tests.benchmarks.accuracy import HEALTHY_FRACTION

    with open(calibration_dir() / "ultrascale_h100_1b_3b_8b.csv") as f:
        raw = [w for w in csv.DictReader(f)]
    ok = [w for r, w in zip(load_ultrascale(calibration_dir()), raw, strict=True) if r.ok]
    best: dict[tuple[str, ...], float] = {}
    for r in rows:
        best[r.group[:2]] = max(best.get(r.group[:2], 0.0), r.tokens_per_s_per_gpu or 0.0)
    return {i for i, (r, w) in enumerate(zip(rows, ok, strict=True))
            if int(w["dp"]) * int(w["mbs"]) * int(w["grad_acc"]) == int(w["gbs"])
            and (r.tokens_per_s_per_gpu or 0.0) >= HEALTHY_FRACTION * best[r.group[:2]]}


def megatron_problem() -> Problem:
    directory = calibration_dir()
    vt = _samples("vtrain_a100", load_vtrain(directory))
    us_rows = [r for r in load_ultrascale(directory) if r.ok]
    us = _samples("ultrascale_h100", us_rows)
    healthy = {f"ultrascale_h100:{i}" for i in _ultrascale_healthy(us_rows)}
    return Problem(
        name="megatron", samples=vt + us, params=MEGATRON_PARAMS, predict=_megatron_predict,
        job=lambda s: f"{s.set}/{s.row.group[0]}/{s.row.group[1]}",
        fit_filter=lambda s: s.set != "ultrascale_h100" or s.id in healthy,
        folds=4, fit_cap=500,
        stack_of=lambda s: "megatron" if s.set == "vtrain_a100" else "nanotron",
        shipped=lambda r: _step(r, MEGATRON_CONSTANTS),
        note="Shipped: MEGATRON_CONSTANTS + the A100/H100 curves (accuracy.py --fit on all vTrain and healthy "
             "Ultra-Scale rows: in-sample).",
    )


# ---- megatron on B200: SimuMax ------------------------------------------------------------------
def _b200_predict(x: np.ndarray, row: Row) -> float:
    from pipette import efficiency

    curve = EfficiencyCurve(float(x[0]), float(x[1]), efficiency.STEEPNESS)
    return _step(row, replace(MEGATRON_CONSTANTS, curves=(("b200", curve),)))


def megatron_b200_problem() -> Problem:
    rows = load_stack_set(calibration_dir(), "simumax_b200_megatron.csv").rows
    return Problem(
        name="megatron-b200", samples=_samples("simumax_b200_megatron", rows),
        params=(Param("b200_max_fraction", 0.6, 0.2, 1.0), Param("b200_half_flops", 1e10, 1e8, 1e13)),
        predict=_b200_predict, job=lambda s: "/".join(s.row.group),
        shipped=lambda r: _step(r, MEGATRON_CONSTANTS),
        note="Shipped: B200_* of pipette/efficiency.py (stack_fit.py on SimuMax llama3-70b-l12).",
    )


# ---- pipette: h100_single_gpu ------------------------------------------------------------------
@lru_cache(maxsize=1)
def _one_h100() -> object:
    return homogeneous_cluster("H100-80GB", 1, 1, 450e9, 50e9, name="one-h100")


def _pipette_rows() -> list[Row]:
    from pipette.device import GiB

    runs: list[GpuRun] = [r for r in load_h100_single_gpu(calibration_dir())
                          if r.runner == "deepspeed-trial" and r.status == "ok"]
    return [Row("h100_single_gpu", (r.model.name, r.training.method, str(r.training.seq_len)), r.model, r.training,
                r.config, _one_h100(), True, r.step_time,  # type: ignore[arg-type]
                peak_memory=r.peak_allocated_gib * GiB if r.peak_allocated_gib else None,
                stack="pipette", memory_kind="allocated") for r in runs]


def _pipette_predict(x: np.ndarray, row: Row) -> float:
    k = replace(HF_DEEPSPEED_CONSTANTS, elementwise_passes=float(x[0]), ffn_passes=float(x[1]),
                layer_overhead_s=float(x[2]))
    return _step(row, k)


def pipette_problem() -> Problem:
    return Problem(
        name="pipette", samples=_samples("h100_single_gpu", _pipette_rows()),
        params=(Param("hf_elementwise_passes", 20.0, 0.0, 400.0), Param("hf_ffn_passes", 5.0, 0.0, 100.0),
                Param("hf_layer_overhead_s", 2e-4, 0.0, 1e-2)),
        predict=_pipette_predict, job=lambda s: "/".join(s.row.group),
        shipped=lambda r: _step(r, HF_DEEPSPEED_CONSTANTS),
        note="Shipped: HF_DEEPSPEED_CONSTANTS (accuracy.py --fit-hf on all 9 rows).",
    )


# ---- fsdp: llm-foundry --------------------------------------------------------------------------
FSDP_PARAMS = (
    Param("elementwise_passes", 10.0, 0.0, 200.0), Param("layer_overhead_s", 1e-4, 0.0, 5e-3),
    Param("attention_efficiency", 0.4, 0.05, 1.0), Param("shard_overlap", 0.5, 0.0, 1.0),
    Param("dp_cut_fraction", 0.5, 0.05, 1.0), Param("fp8_efficiency", 1.0, 0.1, 2.0),
)


def _fsdp_predict(x: np.ndarray, row: Row) -> float:
    k = replace(FSDP.constants, elementwise_passes=float(x[0]), layer_overhead_s=float(x[1]),
                attention_efficiency=float(x[2]), shard_overlap=float(x[3]), dp_cut_fraction=float(x[4]))
    if "fp8" in row.stack:
        k = replace(k, fp8_gemms=True, fp8_efficiency=float(x[5]))
    return _step(row, k)


def fsdp_problem() -> Problem:
    rows = load_stack_set(calibration_dir(), "llmfoundry_h100_fsdp.csv").rows
    return Problem(
        name="fsdp", samples=_samples("llmfoundry_h100_fsdp", rows), params=FSDP_PARAMS,
        predict=_fsdp_predict, job=lambda s: s.row.model.name,
        shipped=lambda r: _step(r, get_stack(r.stack).constants),
        note="Shipped: FSDP_CONSTANTS (stack_fit.py on 38 bf16 rows of MPT 760M/3B/13B/70B, fp8_efficiency on the "
             "7 fp8 rows).",
    )


# ---- fsdp on torchtitan -------------------------------------------------------------------------
TORCHTITAN_PARAMS = (
    Param("power_cap_share", 1.0, 0.5, 1.2), Param("compile_elementwise_share", 0.5, 0.0, 1.0),
    Param("compile_fp8_efficiency", 1.0, 0.3, 2.0), Param("async_tp_overlap", 0.0, 0.0, 1.0),
    Param("fp8_rowwise_efficiency", 1.0, 0.2, 2.0),
)


def _torchtitan_predict(x: np.ndarray, row: Row) -> float:
    compiled = FSDP.compiled
    assert compiled is not None
    terms = replace(compiled, elementwise_share=float(x[1]), fp8_efficiency=float(x[2]))
    base = get_stack(row.stack.replace("+async-tp", "").replace("+compile", "").replace("+fp8-rowwise", "+fp8"))
    k = base.constants
    if "compile" in row.stack:
        k, _ = terms.apply(k, base.memory_options)
    if "async-tp" in row.stack:
        k = replace(k, tp_overlap=float(x[3]))
    if "fp8-rowwise" in row.stack:
        k = replace(k, fp8_efficiency=float(x[4]))
    cluster = row.cluster
    if cluster.device_spec.name == "H100-96GB-HBM2e":
        nodes = len(cluster.nodes)
        cluster = stack_cluster("H100-96GB-HBM2e", nodes, cluster.world // nodes, h100_96gb(float(x[0])))
    return PerfModel(row.model, row.training, row.config, cluster, constants=k).step_time()


def torchtitan_problem() -> Problem:
    rows = load_stack_set(calibration_dir(), "torchtitan_h100_fsdp2.csv").rows
    return Problem(
        name="fsdp-torchtitan", samples=_samples("torchtitan_h100_fsdp2", rows), params=TORCHTITAN_PARAMS,
        predict=_torchtitan_predict, job=lambda s: "/".join(s.row.group),
        shipped=lambda r: _step(r, get_stack(r.stack).constants),
        note="Shipped: the torchtitan terms of torchtitan_fit.py, each fitted on 1-2 of these rows (in-sample).",
    )


PROBLEMS = {
    "pipette": pipette_problem,
    "fsdp": fsdp_problem,
    "fsdp-torchtitan": torchtitan_problem,
    "megatron-b200": megatron_b200_problem,
    "megatron": megatron_problem,
}


def problems(names: Sequence[str] | None = None) -> list[Problem]:
    """The problems named (all, in a fast-first order, by default)."""
    chosen = list(PROBLEMS) if not names else list(names)
    unknown = [n for n in chosen if n not in PROBLEMS]
    if unknown:
        raise SystemExit(f"unknown problem {', '.join(unknown)}: use one of {', '.join(PROBLEMS)}")
    return [PROBLEMS[n]() for n in chosen]


# ---- megatron on Megatron-Bridge: the recipes' GEMM efficiencies ---------------------------------
BRIDGE_PARAMS = (Param("fp8_efficiency", 1.0, 0.3, 2.0), Param("mxfp8_efficiency", 1.0, 0.3, 2.0),
                 Param("nvfp4_efficiency", 1.0, 0.3, 3.0),
                 *(Param(f"{gpu.lower()}_tensor_rate_share", 1.0, 0.6, 1.6) for gpu in ("GB300", "GB200", "H100")))
#: the parameter each recipe option reads
_RECIPE_PARAM = {"fp8": 0, "mxfp8": 1, "nvfp4": 2}


def bridge_constants(x: np.ndarray, stack: str) -> PerfConstants:
    """The stack's constants with the recipe's efficiency and the GPUs' tensor-rate shares of ``x``."""
    recipe = stack.split("+")[1] if "+" in stack else ""
    k = get_stack(stack).constants
    if recipe in _RECIPE_PARAM:
        k = replace(k, fp8_efficiency=float(x[_RECIPE_PARAM[recipe]]))
    return replace(k, tensor_rate_shares=tuple(zip(("GB300", "GB200", "H100"), (float(v) for v in x[3:6]),
                                                   strict=True)))


def _bridge_predict(x: np.ndarray, row: Row) -> float:
    return _step(row, bridge_constants(x, row.stack))


def megatron_bridge_problem() -> Problem:
    from tests.benchmarks.calibration import load_megatron_bridge

    rows = load_megatron_bridge(calibration_dir()).rows
    return Problem(
        name="megatron-bridge", samples=_samples("megatron_bridge", rows), params=BRIDGE_PARAMS,
        predict=_bridge_predict, job=lambda s: "/".join(s.row.group[:4]),
        shipped=lambda r: _step(r, get_stack(r.stack).constants),
        note="Jobs: model, task, GPU, GPU count (a layout's releases and recipes are held out together). Shipped: "
             "MEGATRON_*_EFFICIENCY and MEGATRON_TENSOR_RATE_SHARES of pipette/stacks.py (this fit on all rows: "
             "in-sample; crossval.py --fit-all prints it).",
        subsets=(("LoRA runs", lambda s: s.row.training.method == "lora"),
                 ("FP8 runs (per-tensor and MXFP8)", lambda s: s.row.stack in ("megatron+fp8", "megatron+mxfp8")),
                 ("NVFP4 runs", lambda s: s.row.stack == "megatron+nvfp4")),
    )


PROBLEMS["megatron-bridge"] = megatron_bridge_problem


# ---- megatron with the kernels as the base: the GEMM curves measured, not fitted ----------------
MEGATRON_KERNEL_PARAMS = MEGATRON_PARAMS[5:]


def megatron_kernel_constants(x: np.ndarray) -> PerfConstants:
    """The shared constants on the measured GEMM curves (``kernel_tables_first``): the other terms fitted."""
    return replace(MEGATRON_CONSTANTS, kernel_tables_first=True, link_fraction=float(x[0]),
                   layer_overhead_s=float(x[1]), dp_overlap=float(x[2]), collective_overhead_s=float(x[3]),
                   elementwise_passes=float(x[4]), score_passes=float(x[5]))


def megatron_kernels_problem() -> Problem:
    base = megatron_problem()
    return replace(base, name="megatron-kernels", params=MEGATRON_KERNEL_PARAMS, alternative=True,
                   predict=lambda x, row: _step(row, megatron_kernel_constants(x)),
                   note="The GEMM curves from pipette/kernel_tables.py (measured kernels), the other six terms "
                        "fitted per fold.")


PROBLEMS["megatron-kernels"] = megatron_kernels_problem


# ---- megatron's Mixture-of-Experts terms (issue 47) -------------------------------------------------
def megatron_moe_problem() -> Problem:
    from tests.benchmarks.moe_fit import problem

    return problem()


PROBLEMS["megatron-moe"] = megatron_moe_problem
