"""Fit each stack's own constants on the calibration sets of that stack only (issue 28).

Run from the repository root::

    .venv/bin/python tests/benchmarks/stack_fit.py

It prints the fitted constants and, per stack, the step-time MAPE on the rows it was fitted on
and on the rows it was not (held out), so a reader can see the terms generalise:

* ``fsdp``: fitted on llm-foundry's bf16 FULL_SHARD rows of MPT 760M, 3B, 13B and 70B
  (``llmfoundry_h100_fsdp.csv``); held out: its MPT 1B, 7B and 30B rows, and every torchtitan
  FSDP2 row (``torchtitan_h100_fsdp2.csv``: another framework, other models, another H100 part).
  Fitted: the elementwise passes and fixed per-layer time of the eager-ish model code, the fused
  attention's efficiency, the FSDP prefetch overlap and the NIC share of its cross-node rings.
* ``megatron`` on B200: its constants stay the vTrain + Ultra-Scale ones (tests/benchmarks/accuracy.py
  --fit); only the B200 GEMM curve (the device family's, no B200 GEMM was timed) is fitted, on
  SimuMax's llama3-70b-l12 rows; held out: its llama3-405b-l4 and llama3-70b-l8 rows.

The fitted values go into ``pipette/stacks.py`` (``FSDP_CONSTANTS``) and ``pipette/efficiency.py``
(``B200_*``) by hand, with this script named next to them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from scipy.optimize import least_squares  # noqa: E402

from pipette import efficiency  # noqa: E402
from pipette.efficiency import EfficiencyCurve  # noqa: E402
from pipette.perf import PerfConstants, PerfModel  # noqa: E402
from pipette.stacks import FSDP, MEGATRON  # noqa: E402
from tests.benchmarks.calibration import Row, calibration_dir, load_stack_set  # noqa: E402

#: llm-foundry's models the fsdp constants are fitted on; the others are held out.
FSDP_FIT_MODELS = ("mpt-760m", "mpt-3b", "mpt-13b", "mpt-70b")
#: SimuMax's model the B200 curve is fitted on; the others are held out.
B200_FIT_MODELS = ("llama3-70b-l12",)

FSDP_NAMES = ("elementwise_passes", "layer_overhead_s", "attention_efficiency", "shard_overlap",
              "dp_cut_fraction")
FSDP_SCALE = np.array([10.0, 1e-4, 0.5, 1.0, 0.5])
FSDP_LOWER = np.array([0.0, 0.0, 0.05, 0.0, 0.05])
FSDP_UPPER = np.array([200.0, 5e-3, 1.0, 1.0, 1.0])
B200_NAMES = ("b200_max_fraction", "b200_half_flops")


def predict(rows: Sequence[Row], k: PerfConstants) -> np.ndarray:
    return np.array([PerfModel(r.model, r.training, r.config, r.cluster, constants=k).step_time() for r in rows])


def measured(rows: Sequence[Row]) -> np.ndarray:
    return np.array([r.step_time for r in rows], dtype=float)


def mape(rows: Sequence[Row], k: PerfConstants) -> float:
    return float(np.mean(np.abs(predict(rows, k) / measured(rows) - 1.0))) if rows else float("nan")


def fit(rows: Sequence[Row], make: Callable[[np.ndarray], PerfConstants], x0: np.ndarray,
        lower: np.ndarray, upper: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Least squares on log(predicted / measured), soft-L1 so a few outliers cannot lead."""
    meas = measured(rows)

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.asarray(np.log(predict(rows, make(z * scale)) / meas), dtype=np.float64)

    res = least_squares(residuals, x0 / scale, bounds=(lower / scale, upper / scale), diff_step=1e-3,
                        loss="soft_l1", f_scale=0.1, max_nfev=300)
    return np.asarray(res.x * scale)


def fsdp_constants(x: np.ndarray) -> PerfConstants:
    return replace(FSDP.constants, elementwise_passes=float(x[0]), layer_overhead_s=float(x[1]),
                   attention_efficiency=float(x[2]), shard_overlap=float(x[3]), dp_cut_fraction=float(x[4]))


def fsdp_start(k: PerfConstants) -> np.ndarray:
    return np.array([k.elementwise_passes, k.layer_overhead_s, k.attention_efficiency or 0.4,
                     0.5 if k.shard_overlap is None else k.shard_overlap,
                     0.5 if k.dp_cut_fraction is None else k.dp_cut_fraction])


def b200_constants(x: np.ndarray) -> PerfConstants:
    curve = EfficiencyCurve(float(x[0]), float(x[1]), efficiency.STEEPNESS)
    return replace(MEGATRON.constants, curves=(("b200", curve),))


def report(label: str, parts: dict[str, list[Row]], k: PerfConstants) -> None:
    for name, rows in parts.items():
        print(f"  {label:<8} {name:<44} rows {len(rows):>3}  step MAPE {mape(rows, k):6.1%}")


def main() -> int:
    directory = calibration_dir()
    foundry = [r for r in load_stack_set(directory, "llmfoundry_h100_fsdp.csv").rows if r.stack == "fsdp"]
    titan = load_stack_set(directory, "torchtitan_h100_fsdp2.csv").rows
    fsdp_fit = [r for r in foundry if r.model.name in FSDP_FIT_MODELS]
    fsdp_parts = {
        "fit: llm-foundry 760M/3B/13B/70B": fsdp_fit,
        "held out: llm-foundry 1B/7B/30B": [r for r in foundry if r.model.name not in FSDP_FIT_MODELS],
        "held out: torchtitan bf16 (fsdp)": [r for r in titan if r.stack == "fsdp"],
        "held out: torchtitan fsdp+compile (as fsdp)": [r for r in titan if r.stack == "fsdp+compile"],
        "held out: torchtitan fsdp+compile+fp8 (as fsdp)": [r for r in titan if r.stack == "fsdp+compile+fp8"],
    }
    print("fsdp (PyTorch FSDP/FSDP2), shipped constants:")
    report("shipped", fsdp_parts, FSDP.constants)
    x = fit(fsdp_fit, fsdp_constants, fsdp_start(FSDP.constants), FSDP_LOWER, FSDP_UPPER, FSDP_SCALE)
    print("fitted fsdp constants (llm-foundry 760M/3B/13B/70B, bf16):")
    for name, value in zip(FSDP_NAMES, x, strict=True):
        print(f"  {name:<24} {value:.4g}")
    report("fitted", fsdp_parts, fsdp_constants(x))

    # FP8 (the fsdp+fp8 option): the FP8 GEMMs' efficiency relative to the bf16 curve, fitted on
    # llm-foundry's fp8 rows (Transformer Engine) with the bf16 constants above, checked on
    # torchtitan's Float8 rows (torchao; compiled, which is not modelled).
    fp8_base = replace(fsdp_constants(x), fp8_gemms=True)
    foundry8 = [r for r in load_stack_set(directory, "llmfoundry_h100_fsdp.csv").rows if r.stack == "fsdp+fp8"]
    fp8_parts = {
        "fit: llm-foundry fp8": foundry8,
        "held out: torchtitan fsdp+compile+fp8 (as fsdp+fp8)": [r for r in titan if r.stack == "fsdp+compile+fp8"],
    }
    print("fsdp+fp8 before (FP8 GEMMs at the bf16 curve, fp8_efficiency 1):")
    report("fp8=1", fp8_parts, fp8_base)
    xf = fit(foundry8, lambda z: replace(fp8_base, fp8_efficiency=float(z[0])), np.array([1.0]),
             np.array([0.1]), np.array([1.5]), np.array([1.0]))
    print(f"fitted fp8_efficiency (llm-foundry fp8, {len(foundry8)} rows): {xf[0]:.4g}")
    report("fitted", fp8_parts, replace(fp8_base, fp8_efficiency=float(xf[0])))

    simumax = load_stack_set(directory, "simumax_b200_megatron.csv").rows
    b200_fit = [r for r in simumax if r.model.name in B200_FIT_MODELS]
    b200_parts = {
        "fit: SimuMax llama3-70b-l12": b200_fit,
        "held out: SimuMax llama3-405b-l4, llama3-70b-l8": [r for r in simumax if r.model.name not in B200_FIT_MODELS],
    }
    print("megatron on B200, shipped constants:")
    report("shipped", b200_parts, MEGATRON.constants)
    x0 = np.array([efficiency.A100_MAX_FRACTION, efficiency.A100_HALF_FLOPS])
    scale = x0.copy()
    xb = fit(b200_fit, b200_constants, x0, np.array([0.2, 1e8]), np.array([1.0, 1e13]), scale)
    print("fitted B200 GEMM curve (megatron, SimuMax llama3-70b-l12):")
    for name, value in zip(B200_NAMES, xb, strict=True):
        print(f"  {name:<24} {value:.4g}")
    report("fitted", b200_parts, b200_constants(xb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
