"""Fit the torchtitan-only figures of the fsdp stack (issue 28) and score them on the runs not fitted.

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/torchtitan_fit.py

Each figure is fitted on the fewest runs that isolate it, in this order, the others held out:

1. the power-capped H100 96GB's share of its tensor-core peak (``calibration.TORCHTITAN_POWER_CAP_SHARE``:
   a device figure of this set), on the two eager bf16 runs (8B, 1D FSDP on 8 and 128 GPUs);
2. ``fsdp+compile``'s share of the elementwise passes and per-layer overhead left
   (``stacks.FSDP_COMPILE_ELEMENTWISE_SHARE``), on the two compiled bf16 runs of the same shape;
3. ``fsdp+compile+fp8``'s FP8 GEMM efficiency, the casts fused by compile
   (``stacks.FSDP_COMPILE_FP8_EFFICIENCY``), on the two compiled Float8 runs of that shape;
4. ``fsdp+async-tp``'s overlap of the TP collectives (``stacks.FSDP_ASYNC_TP_OVERLAP``), on the
   70B bf16 async-TP run;
5. ``fsdp+fp8-rowwise``'s FP8 GEMM efficiency (``stacks.FSDP_FP8_ROWWISE_EFFICIENCY``), on the 70B
   rowwise run without async TP;
6. the fsdp stack's fragmentation on reserved bytes (``memory.FSDP_FRAGMENTATION``), on the two
   eager runs with memory, and under compile (``memory.FSDP_COMPILE_FRAGMENTATION``) on the two
   compiled 8B runs on 8 GPUs.

Step time: the least mean |log(predicted / measured)|; memory: the least MAPE. Prints each fit and
the MAPE of every part, fitted and held out. Nothing here is fitted on another stack's set.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from scipy.optimize import minimize_scalar  # noqa: E402

from pipette.memory import estimate_memory  # noqa: E402
from pipette.perf import PerfModel  # noqa: E402
from pipette.stacks import FSDP, CompileTerms, get_stack  # noqa: E402
from tests.benchmarks.calibration import (  # noqa: E402
    Row,
    calibration_dir,
    h100_96gb,
    load_stack_set,
    row_memory_options,
    stack_cluster,
)

NAME = "torchtitan_h100_fsdp2.csv"
#: the runs each figure is fitted on (the set's row ids)
POWER_ROWS = ("tt00", "tt07")
COMPILE_ROWS = ("tt01", "tt08")
FP8_ROWS = ("tt02", "tt09")
ASYNC_TP_ROWS = ("tt19",)
ROWWISE_ROWS = ("tt22",)
FRAGMENTATION_ROWS = ("tt00", "tt07")
COMPILE_FRAGMENTATION_ROWS = ("tt01", "tt02")


def _with_share(rows: Sequence[Row], layout: dict[str, tuple[str, int, int]], share: float) -> list[Row]:
    out = []
    for r in rows:
        gpu, nodes, per_node = layout[r.row_id]
        if gpu == "H100-96GB-HBM2e":
            r = replace(r, cluster=stack_cluster(gpu, nodes, per_node, h100_96gb(share)))
        out.append(r)
    return out


def _step(r: Row, terms: CompileTerms | None = None, tp_overlap: float | None = None,
          rowwise: float | None = None) -> float:
    """Predicted step time of ``r`` with its stack, its compile terms ``terms``, async TP's
    ``tp_overlap`` and the rowwise FP8 efficiency where given."""
    shipped = get_stack(r.stack).constants
    k = shipped
    if terms is not None and "compile" in r.stack:
        base = get_stack(r.stack.replace("+compile", ""))
        k, _ = terms.apply(base.constants, base.memory_options)
        k = replace(k, tp_overlap=shipped.tp_overlap)
        if "fp8-rowwise" in r.stack:
            k = replace(k, fp8_efficiency=shipped.fp8_efficiency)
    if tp_overlap is not None and "async-tp" in r.stack:
        k = replace(k, tp_overlap=tp_overlap)
    if rowwise is not None and "fp8-rowwise" in r.stack:
        k = replace(k, fp8_efficiency=rowwise)
    return PerfModel(r.model, r.training, r.config, r.cluster, constants=k).step_time()


def _measured(r: Row) -> float:
    if r.step_time is None:
        raise ValueError(f"{r.row_id} has no step time")
    return r.step_time


def step_mape(rows: Sequence[Row], terms: CompileTerms | None = None, tp_overlap: float | None = None,
              rowwise: float | None = None) -> float:
    return float(np.mean([abs(_step(r, terms, tp_overlap, rowwise) / _measured(r) - 1.0) for r in rows]))


def _fit(loss: Callable[[float], float], lo: float, hi: float) -> float:
    """The minimizer of ``loss`` on [lo, hi]: a grid (the loss may be flat in places), then refined."""
    grid = np.linspace(lo, hi, 101)
    i = int(np.argmin([loss(float(x)) for x in grid]))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    return float(minimize_scalar(loss, bounds=(a, b), method="bounded", options={"xatol": 1e-4}).x)


def memory_mape(rows: Sequence[Row], fragmentation: float | None = None) -> float:
    errs = []
    for r in rows:
        if not r.peak_memory:
            continue
        options = row_memory_options(r)
        if fragmentation is not None:
            options = replace(options, fragmentation=fragmentation)
        est = estimate_memory(r.model, r.training, r.config, r.cluster.min_usable_memory, options=options)
        errs.append(abs(est.peak_bytes / r.peak_memory - 1.0))
    return float(np.mean(errs)) if errs else float("nan")


def _parts(rows: Sequence[Row], fitted: Sequence[str]) -> dict[str, list[Row]]:
    held = [r for r in rows if r.row_id not in fitted]
    parts = {"fitted": [r for r in rows if r.row_id in fitted]}
    for key in sorted({r.stack for r in held}):
        parts[f"held out {key}"] = [r for r in held if r.stack == key]
    return parts


def main() -> int:
    directory = calibration_dir()
    with open(directory / NAME, newline="") as f:
        layout = {r["row_id"]: (r["gpu"], int(r["nodes"]), int(r["gpus_per_node"])) for r in csv.DictReader(f)}
    rows = load_stack_set(directory, NAME).rows
    by_id = {r.row_id: r for r in rows}

    power = [by_id[i] for i in POWER_ROWS]
    share = _fit(lambda x: float(np.mean([abs(np.log(_step(r) / _measured(r)))
                                          for r in _with_share(power, layout, x)])), 0.5, 1.2)
    print(f"1. power-capped H100 96GB: {share:.3f} of the 989 TF/s peak (fitted on {', '.join(POWER_ROWS)}; "
          f"shipped {h100_96gb().peak('bf16') / 989e12:.3f})")
    capped = _with_share(rows, layout, share)
    shipped = FSDP.compiled
    assert shipped is not None
    compiled = [r for r in capped if r.row_id in COMPILE_ROWS]
    unpriced = replace(shipped, elementwise_share=1.0)
    elementwise = _fit(lambda x: float(np.mean([abs(np.log(_step(r, replace(unpriced, elementwise_share=x))
                                                             / _measured(r))) for r in compiled])), 0.0, 1.0)
    print(f"2. fsdp+compile: {elementwise:.3f} of the elementwise passes and per-layer overhead left (fitted on "
          f"{', '.join(COMPILE_ROWS)}; shipped {shipped.elementwise_share})")
    fp8 = [r for r in capped if r.row_id in FP8_ROWS]
    terms = replace(shipped, elementwise_share=elementwise)
    efficiency = _fit(lambda x: float(np.mean([abs(np.log(_step(r, replace(terms, fp8_efficiency=x)) / _measured(r)))
                                               for r in fp8])), 0.3, 2.0)
    terms = replace(terms, fp8_efficiency=efficiency)
    print(f"3. fsdp+compile+fp8: FP8 GEMM efficiency {efficiency:.3f} of the bf16 curve, casts fused (fitted on "
          f"{', '.join(FP8_ROWS)}; shipped {shipped.fp8_efficiency})")
    asynchronous = [r for r in capped if r.row_id in ASYNC_TP_ROWS]
    overlap = _fit(lambda x: float(np.mean([abs(np.log(_step(r, terms, x) / _measured(r))) for r in asynchronous])),
                   0.0, 1.0)
    print(f"4. fsdp+async-tp: the TP collectives under {overlap:.3f} of the linear GEMM time (fitted on "
          f"{', '.join(ASYNC_TP_ROWS)}; shipped {FSDP.async_tp_overlap})")
    rows_rw = [r for r in capped if r.row_id in ROWWISE_ROWS]
    rw = _fit(lambda x: float(np.mean([abs(np.log(_step(r, terms, overlap, x) / _measured(r))) for r in rows_rw])),
              0.2, 2.0)
    print(f"5. fsdp+fp8-rowwise: FP8 GEMM efficiency {rw:.3f} of the bf16 curve (fitted on {', '.join(ROWWISE_ROWS)}; "
          f"shipped {FSDP.fp8_rowwise_efficiency})")
    fitted = POWER_ROWS + COMPILE_ROWS + FP8_ROWS + ASYNC_TP_ROWS + ROWWISE_ROWS
    for label, part in _parts(capped, fitted).items():
        before = step_mape(_with_share(part, layout, 1.0), replace(terms, elementwise_share=1.0, fp8_efficiency=None),
                           0.0, terms.fp8_efficiency)
        print(f"   step MAPE {label} ({len(part)} rows): {step_mape(part, terms, overlap, rw):.1%} "
              f"(device at 989 TF/s, compile, async TP and rowwise unpriced: {before:.1%})")

    frag = _fit(lambda x: memory_mape([by_id[i] for i in FRAGMENTATION_ROWS], x), 0.8, 1.4)
    frag_c = _fit(lambda x: memory_mape([by_id[i] for i in COMPILE_FRAGMENTATION_ROWS], x), 0.8, 1.4)
    print(f"6. fragmentation on reserved bytes: fsdp {frag:.3f} (fitted on {', '.join(FRAGMENTATION_ROWS)}), "
          f"fsdp+compile {frag_c:.3f} (fitted on {', '.join(COMPILE_FRAGMENTATION_ROWS)}); shipped "
          f"{FSDP.memory_options.fragmentation} / {shipped.fragmentation}")
    for label, part in _parts(rows, FRAGMENTATION_ROWS + COMPILE_FRAGMENTATION_ROWS).items():
        if any(r.peak_memory for r in part):
            print(f"   memory MAPE {label} ({sum(bool(r.peak_memory) for r in part)} rows): {memory_mape(part):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
