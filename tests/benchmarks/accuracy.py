"""Accuracy of the performance model on measured step times (vTrain A100, Ultra-Scale H100).

Run from the repository root::

    .venv/bin/python tests/benchmarks/accuracy.py           # figures with the shipped constants
    .venv/bin/python tests/benchmarks/accuracy.py --check   # exit 1 when a target is missed
    .venv/bin/python tests/benchmarks/accuracy.py --fit     # refit the constants, print them
    .venv/bin/python tests/benchmarks/accuracy.py --stacks-only  # per calibration set and stack only

Every verdict it prints is cross-validated (tests/benchmarks/crossval.py: each stack's constants
refitted from a neutral start per fold, the rows of the jobs left out scored); the figures of the
shipped constants on the rows they were fitted on are printed too, labelled *in-sample*. The
targets (``--check``) are checked on the cross-validated figures.

Ultra-Scale rows are used in two views. *all*: every row that ran (ok). *healthy*: rows
whose gbs column agrees with dp x mbs x grad_acc (12 rows disagree, so their step time
is ambiguous) and whose measured throughput is at least ``HEALTHY_FRACTION`` of the best
of their (model, nodes) group. The set holds runs that differ only in the ZeRO stage and
yet differ 15x in throughput (e.g. 8B, 4 nodes, dp4 pp8 mbs1: 78 s with ZeRO-0, 5.2 s
with ZeRO-1), which no model of the hardware explains; the healthy view is the region a
tuner cares about. Both views are printed; the constants are fitted on the healthy rows
with a robust (soft-L1) loss.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from scipy.optimize import least_squares  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from pipette import efficiency, perf_constants  # noqa: E402
from pipette.efficiency import EfficiencyCurve, family  # noqa: E402
from pipette.perf import PerfConstants, PerfModel  # noqa: E402
from tests.benchmarks.calibration import (  # noqa: E402
    Row,
    calibration_dir,
    load_ultrascale,
    load_vtrain,
)

HEALTHY_FRACTION = 0.25
TARGETS = {
    "vtrain_mape": 0.08,
    "vtrain_spearman_min": 0.9,
    "vtrain_regret_median": 0.03,
    "ultrascale_tput_mape": 0.10,
    "h100_mape": 0.05,
    "h100_max": 0.12,
}

# The fitted parameters, in order; the scale keeps the optimizer's steps well conditioned.
NAMES = (
    "a100_max_fraction", "a100_half_flops", "h100_max_fraction", "h100_half_flops",
    "steepness", "link_fraction", "layer_overhead_s", "dp_overlap",
    "collective_overhead_s", "elementwise_passes", "score_passes",
)
LOWER = np.array([0.2, 1e7, 0.2, 1e7, 0.3, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])
UPPER = np.array([1.0, 1e13, 1.0, 1e13, 3.0, 1.0, 5e-3, 1.0, 5e-3, 100.0, 100.0])


def shipped() -> np.ndarray:
    """The constants the package ships with, as a parameter vector."""
    return np.array([
        efficiency.A100_MAX_FRACTION, efficiency.A100_HALF_FLOPS,
        efficiency.H100_MAX_FRACTION, efficiency.H100_HALF_FLOPS, efficiency.STEEPNESS,
        perf_constants.LINK_FRACTION, perf_constants.LAYER_OVERHEAD_S, perf_constants.DP_OVERLAP,
        perf_constants.COLLECTIVE_OVERHEAD_S, perf_constants.ELEMENTWISE_PASSES, perf_constants.SCORE_PASSES,
    ])


def constants(x: np.ndarray, fam: str) -> PerfConstants:
    if fam == "h100":
        curve = EfficiencyCurve(float(x[2]), float(x[3]), float(x[4]))
    else:
        curve = EfficiencyCurve(float(x[0]), float(x[1]), float(x[4]))
    return PerfConstants(
        link_fraction=float(x[5]), layer_overhead_s=float(x[6]), dp_overlap=float(x[7]),
        collective_overhead_s=float(x[8]), elementwise_passes=float(x[9]),
        score_passes=float(x[10]), curve=curve,
    )


@dataclass(frozen=True)
class Data:
    rows: list[Row]
    measured: np.ndarray  # step time, s
    healthy: np.ndarray  # bool

    def predict(self, x: np.ndarray, idx: Sequence[int] | None = None) -> np.ndarray:
        idx = range(len(self.rows)) if idx is None else idx
        by_family = {f: constants(x, f) for f in ("a100", "h100", "other")}
        out = []
        for i in idx:
            r = self.rows[i]
            k = by_family[family(r.cluster.device_spec)]
            out.append(PerfModel(r.model, r.training, r.config, r.cluster, constants=k).step_time())
        return np.array(out)


def load(directory: Path) -> tuple[Data, Data]:
    vt = load_vtrain(directory)
    v = Data(vt, np.array([r.step_time for r in vt], dtype=float), np.ones(len(vt), dtype=bool))
    with open(directory / "ultrascale_h100_1b_3b_8b.csv") as f:
        raw = list(csv.DictReader(f))
    pairs = [(r, w) for r, w in zip(load_ultrascale(directory), raw, strict=True) if r.ok]
    rows = [r for r, _ in pairs]
    consistent = np.array([
        int(w["dp"]) * int(w["mbs"]) * int(w["grad_acc"]) == int(w["gbs"]) for _, w in pairs
    ])
    tput = np.array([r.tokens_per_s_per_gpu or 0.0 for r in rows])
    best: dict[tuple[str, ...], float] = {}
    for r, t in zip(rows, tput, strict=True):
        best[r.group[:2]] = max(best.get(r.group[:2], 0.0), t)
    strong = np.array([t >= HEALTHY_FRACTION * best[r.group[:2]] for r, t in zip(rows, tput, strict=True)])
    u = Data(rows, np.array([r.step_time for r in rows], dtype=float), consistent & strong)
    return v, u


# ---- metrics ----------------------------------------------------------------------------
def groups_of(data: Data, idx: Sequence[int], key: Callable[[Row], tuple[str, ...]]) -> list[list[int]]:
    out: dict[tuple[str, ...], list[int]] = {}
    for k, i in enumerate(idx):
        out.setdefault(key(data.rows[i]), []).append(k)
    return list(out.values())


def ranking(pred: np.ndarray, meas: np.ndarray, groups: list[list[int]]) -> dict[str, float]:
    rhos, regrets = [], []
    for g in groups:
        p, m = pred[g], meas[g]
        if len(g) >= 3 and np.ptp(m) > 0:
            rhos.append(float(spearmanr(p, m).statistic))
        regrets.append(float(m[np.argmin(p)] / m.min() - 1.0))
    return {
        "spearman_min": float(np.nanmin(rhos)) if rhos else float("nan"),
        "spearman_median": float(np.nanmedian(rhos)) if rhos else float("nan"),
        "regret_median": float(np.median(regrets)),
        "regret_max": float(np.max(regrets)),
        "groups": float(len(groups)),
    }


def vtrain_metrics(data: Data, x: np.ndarray, idx: Sequence[int]) -> dict[str, float]:
    pred, meas = data.predict(x, idx), data.measured[list(idx)]
    out = {"n": float(len(idx)), "mape": float(np.mean(np.abs(pred / meas - 1.0)))}
    out |= ranking(pred, meas, groups_of(data, idx, lambda r: r.group[:2]))
    by_gb = ranking(pred, meas, groups_of(data, idx, lambda r: r.group[:3]))
    out |= {f"gb_{k}": v for k, v in by_gb.items()}
    return out


def ultrascale_metrics(data: Data, x: np.ndarray, idx: Sequence[int]) -> dict[str, float]:
    pred, meas = data.predict(x, idx), data.measured[list(idx)]
    # Throughput APE: tokens/s per GPU predicted vs measured = measured / predicted time.
    out = {"n": float(len(idx)), "tput_mape": float(np.mean(np.abs(meas / pred - 1.0)))}
    out["tput_median_ape"] = float(np.median(np.abs(meas / pred - 1.0)))
    mfu_pred = []
    for k, i in enumerate(idx):
        r = data.rows[i]
        flops = 3.0 * r.model.forward_flops_per_token(r.training.seq_len)
        peak = r.cluster.device_spec.peak(r.training.dtype)
        mfu_pred.append(r.training.tokens_per_step * flops / (pred[k] * r.config.world * peak))
    mfu_meas = np.array([data.rows[i].mfu or 0.0 for i in idx])
    out["mfu_abs_err_pts"] = float(np.mean(np.abs(np.array(mfu_pred) - mfu_meas)) * 100)
    out |= ranking(pred, meas, groups_of(data, idx, lambda r: r.group[:2]))
    return out


# ---- fitting ----------------------------------------------------------------------------
def fit(v: Data, vi: Sequence[int], u: Data, ui: Sequence[int], x0: np.ndarray) -> np.ndarray:
    """Least squares on log(predicted / measured), soft-L1 so a few outliers cannot lead."""
    scale = np.where(x0 > 0, x0, 1.0)
    mv, mu = v.measured[list(vi)], u.measured[list(ui)]

    def residuals(z: np.ndarray) -> np.ndarray:
        x = z * scale
        return np.concatenate([np.log(v.predict(x, vi) / mv), np.log(u.predict(x, ui) / mu)])

    res = least_squares(
        residuals, x0 / scale, bounds=(LOWER / scale, UPPER / scale), diff_step=1e-3,
        loss="soft_l1", f_scale=0.1, max_nfev=200,
    )
    return np.asarray(res.x * scale)


# ---- h100_single_gpu.csv: Pipette's own stack on one H100 ---------------------------------
H100_NAMES = ("hf_elementwise_passes", "hf_ffn_passes", "hf_layer_overhead_s")


def h100_rows(directory: Path) -> list[Any]:
    """The runs of Pipette's own runner (``deepspeed-trial``) that were timed."""
    from tests.benchmarks.calibration import load_h100_single_gpu

    if not (directory / "h100_single_gpu.csv").exists():
        return []
    return [r for r in load_h100_single_gpu(directory) if r.runner == "deepspeed-trial" and r.status == "ok"]


def h100_constants(x: Sequence[float] | None = None) -> PerfConstants:
    if x is None:
        return perf_constants.HF_DEEPSPEED_CONSTANTS
    return replace(perf_constants.HF_DEEPSPEED_CONSTANTS, elementwise_passes=float(x[0]), ffn_passes=float(x[1]),
                   layer_overhead_s=float(x[2]))


def h100_predict(rows: Sequence[Any], k: PerfConstants) -> np.ndarray:
    from pipette.clusterfile import homogeneous_cluster

    cluster = homogeneous_cluster("H100-80GB", 1, 1, 450e9, 50e9, name="one-h100")
    return np.array([PerfModel(r.model, r.training, r.config, cluster, constants=k).step_time() for r in rows])


def fit_h100(rows: Sequence[Any]) -> np.ndarray:
    meas = np.array([r.step_time for r in rows])
    scale = np.array([50.0, 10.0, 1e-3])

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.log(h100_predict(rows, h100_constants(z * scale)) / meas)

    k = perf_constants
    x0 = np.array([k.HF_ELEMENTWISE_PASSES, k.HF_FFN_PASSES, k.HF_LAYER_OVERHEAD_S]) / scale
    res = least_squares(residuals, x0, bounds=(0.0, np.array([400.0, 100.0, 1e-2]) / scale), diff_step=1e-3)
    return np.asarray(res.x * scale)


def h100_report(directory: Path, refit: bool) -> dict[str, float]:
    rows = h100_rows(directory)
    if not rows:
        print("h100_single_gpu: not present, skipped")
        return {}
    meas = np.array([r.step_time for r in rows])
    if refit:
        x = fit_h100(rows)
        print("fitted HF/DeepSpeed constants (h100_single_gpu.csv, 9 runs):")
        for name, value in zip(H100_NAMES, x, strict=True):
            print(f"  {name:<24} {value:.4g}")
    shipped_k = h100_constants()
    pred = h100_predict(rows, shipped_k)
    err = pred / meas - 1.0
    print("H100 single GPU (Pipette's runner: HF Llama + DeepSpeed, bf16), HF/DeepSpeed constants, in-sample "
          "(fitted on these 9 rows; cross-validated: the table below):")
    for r, p, e in zip(rows, pred, err, strict=True):
        print(f"  {r.label:60s} predicted {p:6.3f} s  measured {r.step_time:6.3f} s  {e:+6.1%}")
    out = {"mape": float(np.mean(np.abs(err))), "max": float(np.max(np.abs(err)))}
    megatron = np.abs(h100_predict(rows, perf_constants.MEGATRON_CONSTANTS) / meas - 1.0)
    print(f"  in-sample MAPE {out['mape']:.1%}, worst {out['max']:.1%} (with the Megatron/nanotron constants "
          f"instead, fitted on other sets: MAPE {megatron.mean():.1%}, worst {megatron.max():.1%})")
    return out


# ---- output -----------------------------------------------------------------------------
def show_vtrain(label: str, m: dict[str, float]) -> None:
    print(
        f"  {label:<22} n={int(m['n']):5d}  MAPE {m['mape']:6.1%}   "
        f"Spearman min {m['spearman_min']:.3f} med {m['spearman_median']:.3f}   "
        f"regret med {m['regret_median']:5.1%} max {m['regret_max']:5.1%}   "
        f"[per (model,GPUs,gbs): Spearman min {m['gb_spearman_min']:.3f} "
        f"med {m['gb_spearman_median']:.3f}, regret med {m['gb_regret_median']:.1%} "
        f"max {m['gb_regret_max']:.1%}]"
    )


def show_ultrascale(label: str, m: dict[str, float]) -> None:
    print(
        f"  {label:<22} n={int(m['n']):5d}  tput MAPE {m['tput_mape']:6.1%} "
        f"(median APE {m['tput_median_ape']:5.1%})   MFU err {m['mfu_abs_err_pts']:4.1f} pts   "
        f"Spearman min {m['spearman_min']:.3f} med {m['spearman_median']:.3f}   "
        f"regret med {m['regret_median']:5.1%} max {m['regret_max']:6.1%}"
    )


def memory_report(directory: Path) -> None:
    try:
        mod = importlib.import_module("tests.benchmarks.memory_accuracy")
    except ImportError:
        print("memory: tests/benchmarks/memory_accuracy.py not present, skipped")
        return
    report = getattr(mod, "report", None)
    if report is None:
        print("memory: memory_accuracy.py has no report(rows), skipped")
        return
    print("memory (tests/benchmarks/memory_accuracy.py):")
    report(load_ultrascale(directory))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--fit", action="store_true", help="refit the constants on all rows")
    ap.add_argument("--fit-hf", action="store_true", help="refit the HF/DeepSpeed constants on h100_single_gpu.csv")
    ap.add_argument("--stacks-only", action="store_true", help="print only the table per calibration set and stack")
    args = ap.parse_args(argv)
    directory = calibration_dir()
    t0 = time.perf_counter()
    from tests.benchmarks import stack_accuracy

    if args.stacks_only:
        stack_accuracy.report(directory)
        return 0
    v, u = load(directory)
    vi = list(range(len(v.rows)))
    ua = list(range(len(u.rows)))
    uh = [i for i in ua if u.healthy[i]]
    x = shipped()
    if args.fit:
        x = fit(v, vi, u, uh, x)
        print("fitted constants (vTrain all + Ultra-Scale healthy):")
        for name, value in zip(NAMES, x, strict=True):
            print(f"  {name:<24} {value:.4g}")

    print("vTrain A100 (Megatron-DeepSpeed GPT, fp16, full recompute), shipped constants, in-sample:")
    show_vtrain("all rows (in-sample)", vtrain_metrics(v, x, vi))
    print("Ultra-Scale H100 (nanotron Llama, bf16), shipped constants, in-sample:")
    show_ultrascale("all ok rows (in-sample)", ultrascale_metrics(u, x, ua))
    show_ultrascale("healthy rows (in-sample)", ultrascale_metrics(u, x, uh))

    h100_report(directory, args.fit_hf)
    memory_report(directory)
    results = stack_accuracy.report(directory)
    from tests.benchmarks import repeat_floor

    print("what the sets' repeated configurations allow any model (tests/benchmarks/repeat_floor.py):")
    print("\n".join(repeat_floor.report(directory)))
    print(f"({time.perf_counter() - t0:.0f} s)")
    missed = missed_targets(results)
    print("targets (cross-validated): " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    return 1 if (args.check and missed) else 0


def missed_targets(results: Sequence[Any]) -> list[str]:
    """The targets the cross-validated figures miss (vTrain by megatron, h100_single_gpu by pipette)."""
    from tests.benchmarks.crossval import scores

    by_set: dict[str, Any] = {}
    for r in results:
        for name in {s.set for s in r.problem.samples}:
            idx = [i for i, s in enumerate(r.problem.samples) if s.set == name]
            by_set[name] = scores([r.problem.samples[i] for i in idx], r.predicted[idx])
    missed = []
    mv, mh = by_set.get("vtrain_a100"), by_set.get("h100_single_gpu")
    if mv is not None:
        if mv.mape > TARGETS["vtrain_mape"]:
            missed.append(f"vTrain MAPE {mv.mape:.1%} > {TARGETS['vtrain_mape']:.0%}")
        if mv.spearman_min < TARGETS["vtrain_spearman_min"]:
            missed.append(f"vTrain min Spearman per job {mv.spearman_min:.3f} < 0.9")
        if mv.regret_median - 1.0 > TARGETS["vtrain_regret_median"]:
            missed.append(f"vTrain median regret {mv.regret_median - 1.0:.1%} > 3%")
    if mh is not None and mh.mape > TARGETS["h100_mape"]:
        missed.append(f"H100 single-GPU MAPE {mh.mape:.1%} (target 5%)")
    return missed


if __name__ == "__main__":
    sys.exit(main())
