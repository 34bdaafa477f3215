"""How well the calibration sets agree with themselves: the floor under any model's error.

Run from the repository root (``./dev bench repeat_floor``)::

    .venv/bin/python tests/benchmarks/repeat_floor.py

Some sets measured the same configuration more than once (the Ultra-Scale README: "A few
configurations appear twice with different values: keep both"). No deterministic model can
predict two different figures for one configuration, so the repeats bound what a model can
reach on a set:

* per set, the configurations measured more than once (``repeats``) and
  the ratio of the larger figure to the smaller, for the step time and the memory;
* the **floor**: the MAPE of the best single prediction per repeated configuration (the value
  that minimises the mean absolute percentage error over its repeats: their smallest, for two)
  on those rows; a model's MAPE on them cannot be lower;
* the per-measurement log sd the repeats imply from the log differences ``d`` of their first two
  figures, robustly (``median|d| / (0.6745 sqrt 2)``, one wild pair does not set it) and as the
  root mean square (``sqrt(mean(d^2) / 2)``), and the MAPE a *perfect* model would score against
  single measurements with the robust one, ``E|exp(-e) - 1|`` for ``e ~ N(0, sd)`` (where the
  repeats are representative of the set);
* the shipped stack's own MAPE on the same repeated rows, for comparison.

Nothing is fitted; the stacks are the shipped ones.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from pipette.memory import estimate_memory
from pipette.perf import PerfModel
from pipette.stacks import Stack, get_stack
from tests.benchmarks.calibration import Row, as_run, calibration_dir
from tests.benchmarks.stack_accuracy import sets


def repeats(rows: Sequence[Row], stack: str) -> list[list[Row]]:
    """The configurations of ``rows`` measured more than once (the same model, recipe, degrees,
    micro-batch, global batch and stack: a label does not name the global batch), each as its rows."""
    by: dict[tuple[object, ...], list[Row]] = {}
    for r in rows:
        key = (r.group, r.model, r.training, r.config.label, r.config.global_batch, r.stack or stack)
        by.setdefault(key, []).append(r)
    return [rs for rs in by.values() if len(rs) > 1]


def best_constant_ape(values: Sequence[float]) -> float:
    """The least mean |p / y - 1| over ``values`` any one prediction ``p`` reaches: it is piecewise
    linear in ``p`` with its kinks at the values, so one of them is the minimum."""
    return min(statistics.fmean(abs(p / y - 1.0) for y in values) for p in values)


def noise_mape(sd: float, draws: int = 200_000) -> float:
    """``E|exp(-e) - 1|`` for ``e ~ N(0, sd)``: a perfect model's MAPE against noisy figures."""
    e = np.random.default_rng(0).normal(0.0, sd, draws)
    return float(np.mean(np.abs(np.exp(-e) - 1.0)))


def figure_floor(groups: list[list[Row]], value: Callable[[Row], float | None],
                 predict: Callable[[Row], float]) -> dict[str, float] | None:
    """The floor, the implied noise and the model's MAPE for one figure over the repeated rows."""
    kept = [[(r, v) for r in rs if (v := value(r))] for rs in groups]
    kept = [g for g in kept if len(g) > 1]
    if not kept:
        return None
    ratios = [max(v for _, v in g) / min(v for _, v in g) for g in kept]
    floor = statistics.fmean(best_constant_ape([v for _, v in g]) for g in kept)
    diffs = [math.log(g[0][1] / g[1][1]) for g in kept]
    sd = math.sqrt(statistics.fmean(d * d for d in diffs) / 2.0)
    robust = statistics.median(abs(d) for d in diffs) / (0.6745 * math.sqrt(2.0))
    model = statistics.fmean(abs(predict(r) / v - 1.0) for g in kept for r, v in g)
    return {"configs": float(len(kept)), "rows": float(sum(len(g) for g in kept)),
            "ratio_median": statistics.median(ratios), "ratio_max": max(ratios), "floor": floor,
            "sd": sd, "robust_sd": robust, "noise_mape": noise_mape(robust), "model": model}


def _step_time(r: Row) -> float | None:
    return r.step_time


def _memory(r: Row) -> float | None:
    return r.peak_memory


def _own(r: Row, stack: Stack) -> Stack:
    """The stack that ran the row: its own where it names one (the stack sets), else the set's."""
    return get_stack(r.stack) if r.stack else stack


def predicted_step(r: Row, stack: Stack) -> float:
    """The row's step time as the stack that ran it predicts it."""
    return PerfModel(r.model, r.training, r.config, r.cluster, constants=_own(r, stack).constants).step_time()


def predicted_memory(r: Row, stack: Stack) -> float:
    """The estimate's figure of the kind the row measured (live against allocated, else reserved)."""
    est = estimate_memory(r.model, r.training, r.config, r.cluster.min_usable_memory,
                          options=as_run(r, _own(r, stack).memory_options))
    return float(est.live_bytes if r.measured_kind == "live" else est.reserved_bytes)


def report(directory: Path) -> list[str]:
    lines = ["| set | stack | figure | configs measured twice or more (rows) | repeat ratio median / max | "
             "floor on those rows | implied noise sd, robust / rms -> a perfect model's MAPE | "
             "the shipped stack's MAPE on those rows (in-sample where fitted there) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in sets(directory):
        groups = repeats(s.rows, s.stack)
        if not groups:
            lines.append(f"| {s.name} | {s.stack} | - | none | | | | |")
            continue
        stack = get_stack(s.stack)
        figures = (("step time", _step_time, predicted_step), ("memory", _memory, predicted_memory))
        for figure, value, predict in figures:
            f = figure_floor(groups, value, lambda r, p=predict, own=stack: p(r, own))
            if f is None:
                continue
            lines.append(
                f"| {s.name} | {s.stack} | {figure} | {int(f['configs'])} ({int(f['rows'])}) | "
                f"{f['ratio_median']:.2f} / {f['ratio_max']:.2f} | {100 * f['floor']:.1f}% | "
                f"{f['robust_sd']:.3f} / {f['sd']:.3f} -> {100 * f['noise_mape']:.1f}% | {100 * f['model']:.1f}% |")
    return lines


def main() -> int:
    directory = calibration_dir()
    print("\n".join(report(directory)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
