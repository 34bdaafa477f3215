"""torchtitan's runs one by one with the fsdp stack, and the set's figures per option group.

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/torchtitan_rows.py

Each run is predicted with its own stack key (``fsdp+async-tp+compile+fp8`` ...; step time with
``Stack.constants``, memory with ``calibration.row_memory_options``). The summary groups the runs
by compile and fp8 only (async-tp merged), as docs/stacks.md's tables did before async-tp was an
option, so that before and after compare the same rows: step MAPE, memory MAPE, Spearman's rho and
the top-1 regret per group of (model, GPUs, sequence, precision) of 3 / 2 runs or more.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from pipette.device import GiB  # noqa: E402
from pipette.memory import estimate_memory  # noqa: E402
from pipette.perf import PerfModel  # noqa: E402
from pipette.stacks import get_stack  # noqa: E402
from tests.benchmarks.calibration import Row, calibration_dir, load_stack_set, row_memory_options  # noqa: E402

NAME = "torchtitan_h100_fsdp2.csv"


def predict(r: Row) -> tuple[float, float]:
    """(step seconds, peak bytes) of ``r`` with its own stack and options."""
    step = PerfModel(r.model, r.training, r.config, r.cluster, constants=get_stack(r.stack).constants).step_time()
    mem = estimate_memory(r.model, r.training, r.config, r.cluster.min_usable_memory, options=row_memory_options(r))
    return step, float(mem.peak_bytes)


def merged_key(stack: str) -> str:
    """The key without async-tp, and fp8-rowwise as fp8: the groups of the tables before either was an option."""
    return "+".join("fp8" if part == "fp8-rowwise" else part for part in stack.split("+") if part != "async-tp")


def rowwise_runs(directory: Path) -> set[str]:
    """The runs of torchtitan's Float8 *rowwise* recipe (the set's ``assumptions``): the stack's
    fp8 option does not tell the recipes apart."""
    with open(directory / NAME, newline="") as f:
        return {r["row_id"] for r in csv.DictReader(f) if "float8 rowwise" in r["assumptions"]}


def summary(rows: list[Row], pred: dict[str, tuple[float, float]]) -> None:
    print("| rows' stack (async-tp merged) | rows | step MAPE | Spearman (groups) | top-1 regret med / max | "
          "memory MAPE (rows) |\n|---|---|---|---|---|---|")
    for key in sorted({merged_key(r.stack) for r in rows}):
        part = [r for r in rows if merged_key(r.stack) == key]
        step = [abs(pred[r.row_id][0] / (r.step_time or np.nan) - 1.0) for r in part]
        mem = [abs(pred[r.row_id][1] / r.peak_memory - 1.0) for r in part if r.peak_memory]
        groups: dict[tuple[str, ...], list[Row]] = {}
        for r in part:
            groups.setdefault(r.group, []).append(r)
        rhos, regrets = [], []
        for g in groups.values():
            p = np.array([pred[r.row_id][0] for r in g])
            m = np.array([r.step_time or np.nan for r in g])
            if len(g) >= 3 and np.ptp(p) > 0:
                rhos.append(float(spearmanr(p, m).statistic))
            if len(g) >= 2:
                regrets.append(float(m[np.argmin(p)] / m.min() - 1.0))
        rho = ", ".join(f"{x:.2f}" for x in rhos) or "-"
        regret = f"{np.median(regrets):.1%} / {np.max(regrets):.1%}" if regrets else "- / -"
        memory = f"{np.mean(mem):.1%} ({len(mem)})" if mem else "-"
        print(f"| {key} | {len(part)} | {np.mean(step):.1%} | {rho} ({len(rhos)}) | {regret} | {memory} |")


def main() -> int:
    directory = calibration_dir()
    rows = load_stack_set(directory, NAME).rows
    pred = {r.row_id: predict(r) for r in rows}
    print("| run | model | layout | stack | step s measured / predicted | memory GiB measured / predicted |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        step, mem = pred[r.row_id]
        measured = r.step_time or np.nan
        m = f"{r.peak_memory / GiB:.1f} / {mem / GiB:.1f} ({mem / r.peak_memory - 1:+.0%})" if r.peak_memory else "-"
        print(f"| {r.row_id} | {r.model.name} | {r.config.label} on {r.cluster.name} | {r.stack} | "
              f"{measured:.2f} / {step:.2f} ({step / measured - 1:+.0%}) | {m} |")
    print()
    summary(rows, pred)
    rowwise = rowwise_runs(directory)
    tensorwise = [r for r in rows if merged_key(r.stack) == "fsdp+compile+fp8" and r.row_id not in rowwise]
    tensorwise_mape = float(np.mean([abs(pred[r.row_id][0] / (r.step_time or np.nan) - 1.0) for r in tensorwise]))
    print(f"fsdp+compile+fp8 without the {len(rowwise)} Float8 rowwise runs ({', '.join(sorted(rowwise))}): "
          f"{len(tensorwise)} rows, step MAPE {tensorwise_mape:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
