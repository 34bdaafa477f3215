"""The fsdp stack's CPU pricing (``pipette.stacks.FSDP_CPU_CONSTANTS``, ``Stack.constants_for``)
and ``tests/benchmarks/real_tuning.py --stack pipette,fsdp``'s restricted space (issue 31)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from pipette.clusterfile import homogeneous_cluster, load_cluster
from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.perf import HF_DEEPSPEED_CONSTANTS, PerfConstants, PerfModel
from pipette.plan import make_plan
from pipette.stacks import (
    FSDP,
    FSDP_CONSTANTS,
    FSDP_CPU_CONSTANTS,
    HF_DEEPSPEED,
    PIPETTE,
    PIPETTE_CPU_CONSTANTS,
    get_stack,
)
from pipette.training import TrainingSpec
from tests.benchmarks import fsdp_cpu_calibration as calib
from tests.benchmarks import real_tuning

ROOT = Path(__file__).resolve().parents[2]
CPU4 = load_cluster(str(ROOT / "examples" / "clusters" / "cpu-4.yaml"))
RECORDED = ROOT / "tests" / "benchmarks" / "results" / "cpu-2026-11-27" / "fsdp_cpu_calibration_pp.json"
TINY = ModelSpec.preset("tiny-llama")


def test_each_stack_has_its_own_cpu_terms_and_keeps_its_gpu_constants() -> None:
    assert FSDP.constants_for("cpu") is FSDP_CPU_CONSTANTS and FSDP.constants_for("gpu") is FSDP_CONSTANTS
    assert FSDP_CPU_CONSTANTS != PIPETTE_CPU_CONSTANTS  # never one stack's borrowed by the other
    assert PIPETTE.constants_for("cpu") is PIPETTE_CPU_CONSTANTS
    assert PIPETTE.constants_for("gpu") is HF_DEEPSPEED_CONSTANTS
    # HF Trainer / Accelerate scripts run the same model code and engine as the runner
    assert HF_DEEPSPEED.constants_for("cpu") is PIPETTE_CPU_CONSTANTS
    assert HF_DEEPSPEED.constants_for("gpu") is HF_DEEPSPEED_CONSTANTS
    # the pipette CPU fit moves only the terms it fitted
    assert PIPETTE_CPU_CONSTANTS.curves == HF_DEEPSPEED_CONSTANTS.curves
    assert PIPETTE_CPU_CONSTANTS.ffn_passes == HF_DEEPSPEED_CONSTANTS.ffn_passes
    # the GPU-fitted terms other than the CPU ones stay as they are
    assert FSDP_CPU_CONSTANTS.shard_overlap == FSDP_CONSTANTS.shard_overlap
    assert FSDP_CPU_CONSTANTS.attention_efficiency == FSDP_CONSTANTS.attention_efficiency
    # an option keeps the CPU terms (get_stack rebuilds the stack)
    assert get_stack("fsdp+compile").constants_for("cpu") is FSDP_CPU_CONSTANTS


def test_a_plan_over_both_families_prices_each_with_its_own_cpu_constants() -> None:
    plan = make_plan(TINY, calib.recipe(), CPU4, stack="pipette,fsdp")
    seen = set()
    for p in plan.ranked:
        k = FSDP_CPU_CONSTANTS if p.config.stack == "fsdp" else PIPETTE_CPU_CONSTANTS
        direct = PerfModel(TINY, calib.recipe(), p.config, CPU4, constants=k).estimate(p.config.placement)
        assert p.perf.step_time == pytest.approx(direct.step_time)
        seen.add(p.config.stack)
    assert seen == {"pipette", "fsdp"}
    assert FSDP.estimate_perf(TINY, calib.recipe(), plan.ranked[0].config, CPU4).step_time > 0


def test_gpu_clusters_keep_the_gpu_fit() -> None:
    gpus = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9)
    model = ModelSpec.preset("llama2-7b")
    plan = make_plan(model, calib.recipe().__class__(global_batch=64, seq_len=4096), gpus, stack="fsdp")
    top = plan.ranked[0]
    direct = PerfModel(model, plan.training, top.config, gpus, constants=FSDP_CONSTANTS).estimate(top.config.placement)
    assert top.perf.step_time == pytest.approx(direct.step_time)


def test_the_cpu_terms_predict_the_recorded_fsdp_trials() -> None:
    """The recorded calibration set (real fsdp trials on 4 CPU ranks): the fitted terms put every
    fitted trial within 0.85-1.4x and the median near 1; the GPU terms were 8x under. The trials
    not fitted (recomputation under a pipeline) run above the prediction (open, docs/fsdp.md)."""
    data = json.loads(RECORDED.read_text())
    by_label = calib.planned_by_label(TINY, calib.recipe(), CPU4)
    rows = [r for r in data["rows"] if r["status"] == "ok"]
    assert len(rows) == len(calib.CALIBRATION)

    def ratio(r: dict[str, Any], k: PerfConstants) -> float:
        cfg = by_label[r["label"]].config
        return float(r["step_time"]) / PerfModel(TINY, calib.recipe(), cfg, CPU4, constants=k).step_time()

    fit = [ratio(r, FSDP_CPU_CONSTANTS) for r in rows if calib.fitted(r["label"])]
    rest = [ratio(r, FSDP_CPU_CONSTANTS) for r in rows if not calib.fitted(r["label"])]
    gpu = [ratio(r, FSDP_CONSTANTS) for r in rows if calib.fitted(r["label"])]
    assert len(fit) == 8 and len(rest) == 3
    assert all(0.85 < x < 1.4 for x in fit) and 0.9 < statistics.median(fit) < 1.1
    assert all(x > 1.5 for x in rest)
    assert statistics.median(gpu) > 4.0


def _args(**over: object) -> argparse.Namespace:
    base: dict[str, object] = {"stack": "pipette,fsdp", "wide": False, "zero": None, "micro_batches": None,
                               "recompute": None, "schedules": None, "fsdp_full": False}
    base.update(over)
    return argparse.Namespace(**base)


def test_the_benchmarks_restricted_space_over_both_families() -> None:
    args = _args()
    plan = make_plan(TINY, real_tuning.recipe(args), CPU4, stack=args.stack)
    kept = [p.config for p in plan.ranked if real_tuning.restricted(args, p.config)]
    pipette = [c for c in kept if c.stack == "pipette"]
    fsdp = [c for c in kept if c.stack == "fsdp"]
    assert len(pipette) == 72 and {c.zero_stage for c in pipette} == {0, 1}  # the one-stack restriction's
    assert len(fsdp) == 27 and {c.zero_stage for c in fsdp} == {0, 2, 3}
    assert all(c.tp == 1 and c.recompute == "none" and c.dp_shard is None and not c.offload for c in fsdp)
    full = [p.config for p in plan.ranked if real_tuning.restricted(_args(fsdp_full=True), p.config)]
    assert {c.recompute for c in full if c.stack == "fsdp"} == {"none", "full"}
    assert real_tuning.family(fsdp[0].label, ["pipette", "fsdp"]) == "fsdp"
    assert real_tuning.family(pipette[0].label, ["pipette", "fsdp"]) == "pipette"


BOTH = ROOT / "tests" / "benchmarks" / "results" / "cpu-2026-11-27" / "real_tuning_both.json"


def test_the_pipette_cpu_terms_price_the_recorded_exhaustive_run_on_one_scale_with_fsdp() -> None:
    """The exhaustive run over both families (every candidate measured; pipette_cpu_fit.py fits
    half of its pipette rows): on the held-out half the GPU constants were 2.7x fast (median), these
    are within 0.85-1.15x; over all 99 rows the order follows the measurements far better."""
    from scipy.stats import spearmanr

    from tests.benchmarks import pipette_cpu_fit as pfit

    assert pfit.FITTED == ("layer_overhead_s", "elementwise_passes", "collective_overhead_s", "p2p_overhead_s")
    data = json.loads(BOTH.read_text())
    training = TrainingSpec.from_dict(data["training"])
    rows = data["exhaustive"]["ranking"]
    measured, cpu, gpu, held = [], [], [], []
    for r in rows:
        c = ParallelConfig.from_dict(r["config"])
        own = get_stack(c.stack).constants_for("cpu")
        measured.append(r["step_time"])
        cpu.append(PerfModel(TINY, training, c, CPU4, constants=own).step_time())
        gpu.append(PerfModel(TINY, training, c, CPU4, constants=HF_DEEPSPEED_CONSTANTS if c.stack != "fsdp"
                             else own).step_time())
        held.append(c.stack != "fsdp" and pfit.held_out(r["label"]))
    ratio = [m / p for m, p, h in zip(measured, cpu, held, strict=True) if h]
    ratio_gpu = [m / p for m, p, h in zip(measured, gpu, held, strict=True) if h]
    assert len(ratio) == 36
    assert 0.85 < statistics.median(ratio) < 1.15 and statistics.median(ratio_gpu) > 2.0
    assert spearmanr(measured, cpu)[0] > 0.8 > 0.5 > spearmanr(measured, gpu)[0]
