"""Accuracy per calibration set and stack (issues 28 and 45): the step time cross-validated
(tests/benchmarks/crossval.py: every verdict from fits that never saw the row's job), then the memory
estimate and the plan's drops with the shipped estimator, labelled as such.

Run from the repository root (``./dev bench accuracy`` prints it too)::

    .venv/bin/python tests/benchmarks/stack_accuracy.py

The step-time table is crossval.py's (per (set, stack): rows, MAPE, median predicted/measured,
Spearman per job, top-1 regret per job, and the shipped constants' in-sample MAPE in a column of its
own). The memory table gives, per (set, stack), the memory MAPE of the estimate against the set's
figures (where it measured them): the live estimate (``MemoryEstimate.live_bytes``) against a peak
allocated, the reserved one (``reserved_bytes``) against a peak reserved or a figure of unknown kind
(Ultra-Scale's "GPU memory"; the reserved estimate is what its constants were fitted on), and how
many configurations that ran the plan would drop (the stack does not run it, a validity rule, or
under a 2% chance to fit: counted apart, a row may be in more than one). The memory figures are
in-sample where the estimator's terms were fitted on the set (its fragmentation factors and fits
priors: pipette/fits.py and pipette/memory_options.py name the rows).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from pipette.clusterfile import homogeneous_cluster  # noqa: E402
from pipette.device import GiB  # noqa: E402
from pipette.fits import KEEP_THRESHOLD  # noqa: E402
from pipette.memory import estimate_memory  # noqa: E402
from pipette.perf import PerfModel  # noqa: E402
from pipette.space import check  # noqa: E402
from pipette.stacks import Stack, get_stack  # noqa: E402
from tests.benchmarks.calibration import (  # noqa: E402
    STACK_SETS,
    Row,
    as_run,
    calibration_dir,
    load_h100_single_gpu,
    load_megatron_bridge,
    load_stack_set,
    load_ultrascale,
    load_vtrain,
)


@dataclass
class CalibrationSet:
    name: str
    stack: str
    rows: list[Row]
    skipped: str = ""


def sets(directory: Path) -> list[CalibrationSet]:
    """Every set that is present, with the stack that ran it (data/calibration/README.md)."""
    out = [
        CalibrationSet("vtrain_a100", "megatron", load_vtrain(directory)),
        CalibrationSet("ultrascale_h100", "nanotron", [r for r in load_ultrascale(directory) if r.ok]),
    ]
    if (directory / "h100_single_gpu.csv").exists():
        one = homogeneous_cluster("H100-80GB", 1, 1, 450e9, 50e9, name="one-h100")
        runs = [r for r in load_h100_single_gpu(directory) if r.runner == "deepspeed-trial" and r.status == "ok"]
        out.append(CalibrationSet("h100_single_gpu", "pipette", [
            Row("h100_single_gpu", (r.model.name, r.training.method, str(r.training.seq_len)), r.model, r.training,
                r.config, one, True, r.step_time,
                peak_memory=r.peak_allocated_gib * GiB if r.peak_allocated_gib else None,
                memory_kind="allocated") for r in runs]))
    for name in STACK_SETS:
        if (directory / name).exists():
            s = load_stack_set(directory, name)
            skipped = ", ".join(f"{n} {why}" for why, n in s.skipped.items())
            out.append(CalibrationSet(s.name, s.stack, s.rows, skipped))
    if (directory / "megatron_bridge_moe_dense.csv").exists():
        b = load_megatron_bridge(directory)
        out.append(CalibrationSet(b.name, b.stack, b.rows, ", ".join(f"{n} {why}" for why, n in b.skipped.items())))
    return out


def configuration_key(r: Row) -> tuple[object, ...]:
    """What makes two rows of one set the same configuration measured twice (as
    tests/benchmarks/repeat_floor.py counts repeats)."""
    return (r.group, r.model, r.training, r.config.label, r.config.global_batch, r.stack)


def group_scores(rows: Sequence[Row], pred: np.ndarray, meas: np.ndarray) -> tuple[list[float], list[float]]:
    """Per group, i.e. per job (one model, cluster and global batch: vTrain's model, GPU count and
    global batch; Ultra-Scale's model and node count, its global batch fixed; the other sets' model,
    GPU count, sequence length and precision), the Spearman rho of predicted against measured (groups
    of 3 or more configurations that vary) and the measured time of the predicted best over the
    measured best (groups of 2 or more). A configuration measured more than once counts once, at the
    geometric mean of its runs: one prediction cannot pick between two runs of itself (torchtitan's
    70B async Float8 layout ran 18.70 s and 17.39 s)."""
    groups: dict[tuple[str, ...], dict[tuple[object, ...], list[int]]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r.group, {}).setdefault(configuration_key(r), []).append(i)
    rhos, ratios = [], []
    for configs in groups.values():
        g = [runs[0] for runs in configs.values()]
        p = pred[g]
        m = np.array([float(np.exp(np.mean(np.log(meas[runs])))) for runs in configs.values()])
        if len(g) >= 3 and np.ptp(m) > 0 and np.ptp(p) > 0:
            rhos.append(float(spearmanr(p, m).statistic))
        if len(g) >= 2:
            ratios.append(float(m[np.argmin(p)] / m.min()))
    return rhos, ratios


def metrics(rows: Sequence[Row], stack: Stack) -> dict[str, float]:
    meas = np.array([r.step_time for r in rows], dtype=float)
    pred = np.array([PerfModel(r.model, r.training, r.config, r.cluster, constants=stack.constants).step_time()
                     for r in rows])
    out = {"n": float(len(rows)), "mape": float(np.mean(np.abs(pred / meas - 1.0)))}
    rhos, ratios = group_scores(rows, pred, meas)
    regrets = [x - 1.0 for x in ratios]
    out["spearman_min"] = float(np.nanmin(rhos)) if rhos else float("nan")
    out["spearman_median"] = float(np.nanmedian(rhos)) if rhos else float("nan")
    out["rho_groups"] = float(len(rhos))
    out["regret_median"] = float(np.median(regrets)) if regrets else float("nan")
    out["regret_max"] = float(np.max(regrets)) if regrets else float("nan")
    live_err: list[float] = []
    reserved_err: list[float] = []
    by_memory, by_stack, by_rule = 0, 0, 0
    for r in rows:
        capacity = r.cluster.min_usable_memory
        own = stack.name == (r.stack or stack.name).split("+")[0]
        options = as_run(r, stack.memory_options) if own else stack.memory_options
        est = estimate_memory(r.model, r.training, r.config, capacity, options=options)
        if r.peak_memory and r.measured_kind == "live":
            live_err.append(abs(est.live_bytes / r.peak_memory - 1.0))
        if r.needed_memory:
            reserved_err.append(abs(est.reserved_bytes / r.needed_memory - 1.0))
        invalid = [c for c in check(r.model, r.training, r.config, r.config.world,
                                    sharded_pipeline=stack.sharded_pipeline,
                                    uneven_virtual_stages=stack.uneven_virtual_stages,
                                    embedding_loss_split=stack.embedding_loss_split) if c != "world_mismatch"]
        chance = stack.fits_prior("gpu").chance_to_fit(est, capacity)
        by_stack += bool(stack.refusals(r.config))
        by_rule += bool(invalid)
        by_memory += chance < KEEP_THRESHOLD
    out["live_mape"] = float(np.mean(live_err)) if live_err else float("nan")
    out["live_n"] = float(len(live_err))
    out["reserved_mape"] = float(np.mean(reserved_err)) if reserved_err else float("nan")
    out["reserved_n"] = float(len(reserved_err))
    out |= {"dropped_memory": float(by_memory), "dropped_stack": float(by_stack), "dropped_rule": float(by_rule)}
    return out


def _pct(x: float) -> str:
    return "-" if np.isnan(x) else f"{x:.1%}"


def _rho(x: float) -> str:
    return "-" if np.isnan(x) else f"{x:.2f}"


MEMORY_HEADER = ("| set | rows' stack | predicted with | rows | memory MAPE live / reserved (rows) | "
                 "ran, dropped by memory / stack / rule |\n|---|---|---|---|---|---|")


def memory_line(set_name: str, stack_key: str, m: dict[str, float]) -> str:
    mem = " / ".join(f"{_pct(m[k + '_mape'])} ({int(m[k + '_n'])})" if m[k + "_n"] else "-"
                     for k in ("live", "reserved"))
    return (f"| {set_name} | {stack_key} | {stack_key} | {int(m['n'])} | {mem} | "
            f"{int(m['dropped_memory'])} / {int(m['dropped_stack'])} / {int(m['dropped_rule'])} |")


def memory_report(directory: Path) -> None:
    """Memory and the plan's drops per (set, stack), the shipped estimator (in-sample where fitted)."""
    print("memory and the plan's drops, shipped estimator (in-sample where its terms were fitted on the set):")
    print(MEMORY_HEADER)
    for s in sets(directory):
        for key in sorted({r.stack or s.stack for r in s.rows}):
            rows = [r for r in s.rows if (r.stack or s.stack) == key]
            print(memory_line(s.name, key, metrics(rows, get_stack(key))))
        if s.skipped:
            print(f"|   {s.name}: skipped {s.skipped} | | | | | |")


def report(directory: Path, problems: Sequence[str] | None = None) -> list[object]:
    """The cross-validated step-time table, then the memory table. Returns crossval's results."""
    from tests.benchmarks import crossval

    results: list[object] = list(crossval.report(problems))
    memory_report(directory)
    return results


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", action="append", help="cross-validate only this problem (crossval.py's names)")
    args = ap.parse_args()
    report(calibration_dir(), args.problem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
