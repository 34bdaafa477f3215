"""The fits boundary (``pipette.fits``): fit each stack's memory-error prior and score the
chance to fit on the runs that ran and the runs that ran out of memory.

    python tests/benchmarks/fits_boundary.py [--fit] [--check]

Sets:
* Pipette's runner on one H100 (``h100_single_gpu.csv``): what the device needed is the
  allocator's peak reserved bytes plus the memory outside it, from the same rows re-run with
  the allocator's figures (``results/h100-2026-11-23/trials.json``; outside the allocator:
  1.68 GiB, measured on 2026-11-27 with the same torch and CUDA). The fitted set.
* Llama-3-8B LoRA on one H100 (``results/h100-2026-11-27``, ``gpu_memory.py``): the same
  stack on runs the prior was not fitted on.
* nanotron (``ultrascale_h100_1b_3b_8b.csv``): its logged peak; failures are crashes or OOM
  (only the ones nothing else explains count, ``memory_accuracy.memory_plausible_failures``).

Per set: how many runs that ran fall below ``KEEP_THRESHOLD`` (dropped; target <= 2%, 0 on
the H100 runs) and how many that failed are ``SURE_TO_FIT`` (target <= 5%, 0 on the H100).
``--fit`` prints the maximum-likelihood (mu, sd) of each set, OOM runs right-censored.

Then a replay of each single-GPU job (the four H100 groups: the plan of the job on one H100,
searched over the configurations that were measured, each trial returning the measured step
time or the OOM): the tuner's pick at its stop against the measured best, and the OOM trials
it spent (target: the measured best, <= 1 OOM trial per job on average).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from scipy.stats import norm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipette.config import ParallelConfig
from pipette.fits import KEEP_THRESHOLD, NANOTRON_GPU, PIPETTE_GPU, SURE_TO_FIT, FitsPrior
from pipette.memory import NANOTRON_OPTIONS, estimate_memory
from pipette.model import ModelSpec
from pipette.stacks import get_stack
from pipette.training import LoraSpec, TrainingSpec
from tests.benchmarks.calibration import Row, calibration_dir, load_h100_single_gpu, load_ultrascale

RESULTS = Path(__file__).resolve().parent / "results"
H100_BYTES = 81559 * 2**20
GiB = 2**30
H200_BYTES = 143771 * 2**20  # nvidia-smi's total on the H200 of results/h200-2026-11-27
#: CUDA context and workspaces outside the caching allocator on the H100 (torch 2.11, CUDA 13):
#: 1.68 GiB in every run of results/h100-2026-11-27 that ran (1.61 at an OOM).
OUTSIDE_ALLOCATOR_BYTES = int(1.68 * GiB)


@dataclass(frozen=True)
class Point:
    """One run: the log of capacity over the predicted peak, and what it needed (None: OOM)."""

    label: str
    headroom: float  # log(capacity / predicted)
    error: float | None  # log(needed / predicted); None for a run that ran out of memory

    @property
    def ran(self) -> bool:
        return self.error is not None


def h100_points(directory: Path) -> list[Point]:
    reserved = {r["label"]: r for r in json.loads((RESULTS / "h100-2026-11-23" / "trials.json").read_text())["rows"]}
    out = []
    for r in load_h100_single_gpu(directory):
        if r.runner != "deepspeed-trial":
            continue
        est = estimate_memory(r.model, r.training, r.config, H100_BYTES)
        headroom = math.log(H100_BYTES / est.peak_bytes)
        if r.status == "oom":
            out.append(Point(r.label, headroom, None))
            continue
        need = reserved[r.label]["reserved_gib"] * GiB + OUTSIDE_ALLOCATOR_BYTES
        out.append(Point(r.label, headroom, math.log(need / est.peak_bytes)))
    return out


def llama8b_points(folder: str = "h100-2026-11-27", names: tuple[str, ...] = ("gpu_memory_8b.csv",
                   "gpu_memory_8b_more.csv"), capacity: int = H100_BYTES) -> list[Point]:
    model = ModelSpec.preset("llama3-8b")
    lora = LoraSpec(rank=16, alpha=32.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    training = TrainingSpec(global_batch=8, seq_len=4096, dtype="bf16", optimizer="adamw", method="lora", lora=lora)
    out = []
    for name in names:
        with open(RESULTS / folder / name, newline="") as f:
            for row in csv.DictReader(f):
                mbs = int(row["label"].split(" mbs")[1].split()[0])
                recompute = row["label"].split("rc:")[1]
                config = ParallelConfig(tp=1, pp=1, dp=1, mbs=mbs, global_batch=8, zero_stage=0,
                                        recompute=recompute)
                est = estimate_memory(model, training, config, capacity)
                headroom = math.log(capacity / est.peak_bytes)
                if row["status"] == "oom":
                    out.append(Point(row["label"], headroom, None))
                else:
                    need = (float(row["peak_reserved_gib"]) + float(row["outside_allocator_gib"])) * GiB
                    out.append(Point(row["label"], headroom, math.log(need / est.peak_bytes)))
    return out


def nanotron_points(directory: Path) -> tuple[list[Point], list[Point]]:
    """(runs that ran, failures nothing but memory explains), planned as the plan plans
    nanotron runs (the nanotron stack's ``NANOTRON_OPTIONS``: what the replay benchmark uses)."""
    from tests.benchmarks.memory_accuracy import memory_plausible_failures

    rows = load_ultrascale(directory)
    ran, failed = [], []
    for r in rows:
        capacity = r.cluster.device_spec.memory_bytes
        est = estimate_memory(r.model, r.training, r.config, capacity, options=NANOTRON_OPTIONS)
        if r.ok and r.peak_memory:
            # nanotron logs rank 0's peak; the heaviest stage is what must fit
            ran.append(Point(r.model.name, math.log(capacity / est.peak_bytes),
                             math.log(float(r.peak_memory) / est.peak_bytes)))
    for r in memory_plausible_failures(rows):
        capacity = r.cluster.device_spec.memory_bytes
        est = estimate_memory(r.model, r.training, r.config, capacity, options=NANOTRON_OPTIONS)
        failed.append(Point(r.model.name, math.log(capacity / est.peak_bytes), None))
    return ran, failed


def stack_points(directory: Path, name: str) -> list[Point]:
    """The runs of one stack set (``calibration.load_stack_set``) that measured reserved memory, or all of
    them as runs that ran (error None is an OOM: never here) with ``error`` 0 where it did not:
    every row of these sets ran. Predicted with the memory options of the row's stack and options
    (``calibration.row_memory_options``: ``fsdp+compile`` compiles the loss where the run did)."""
    from tests.benchmarks.calibration import load_stack_set, row_memory_options

    out = []
    for r in load_stack_set(directory, name).rows:
        capacity = r.cluster.device_spec.memory_bytes
        est = estimate_memory(r.model, r.training, r.config, capacity, options=row_memory_options(r))
        need = r.needed_memory  # peak reserved: SimuMax's second figure beside its allocated one
        error = math.log(float(need) / est.peak_bytes) if need else math.nan
        out.append(Point(f"{r.model.name} {r.config.label} {r.stack}", math.log(capacity / est.peak_bytes), error))
    return out


def megatron_reserved_share(directory: Path) -> float:
    """``memory_options.MEGATRON_RESERVED_SHARE`` refitted: SimuMax's peak reserved over the megatron
    estimate's live bytes, geometric mean over the runs with both figures, less 1."""
    from tests.benchmarks.calibration import load_stack_set, row_memory_options

    logs = []
    for r in load_stack_set(directory, "simumax_b200_megatron.csv").rows:
        if r.reserved_memory:
            est = estimate_memory(r.model, r.training, r.config, r.cluster.min_usable_memory,
                                  options=row_memory_options(r))
            logs.append(math.log(r.reserved_memory / est.live_bytes))
    return math.exp(sum(logs) / len(logs)) - 1.0


def rule_breaks(row: Row) -> list[str]:
    """The plan's rules ``row``'s layout breaks on its own stack (``pipette.space.check``): a run that ran
    and is refused by a rule is dropped as surely as one below the keep threshold."""
    from pipette.space import check

    stack = get_stack(row.stack)
    # a recipe that gives its own layers per stage (Megatron-Core's pipeline_model_parallel_layout) is not held
    # to the even split
    uneven = stack.uneven_virtual_stages or dict(row.recipe_memory).get("stage_layers") is not None
    return [c for c in check(row.model, row.training, row.config, row.config.world,
                             sharded_pipeline=stack.sharded_pipeline, uneven_virtual_stages=uneven,
                             stack=stack.name, embedding_loss_split=stack.embedding_loss_split)
            if c != "world_mismatch"]


def row_points(rows: list[Row]) -> list[tuple[str, Point]]:
    """(stack, point) of each row that ran, estimated with the row's stack and recipe
    (``calibration.row_memory_options``); ``error`` is log(peak reserved / estimate) where the set
    measured it (SimuMax's second figure, torchtitan's only one), else NaN."""
    from tests.benchmarks.calibration import row_memory_options

    out = []
    for r in rows:
        capacity = r.cluster.min_usable_memory
        est = estimate_memory(r.model, r.training, r.config, capacity, options=row_memory_options(r))
        need = r.needed_memory
        error = math.log(float(need) / est.peak_bytes) if need else math.nan
        label = f"{r.model.name} {r.config.label} {r.row_id}" + (" rule: " + ",".join(rule_breaks(r)) if rule_breaks(r)
                                                                   else "")
        out.append((r.stack, Point(label, math.log(capacity / est.peak_bytes), error)))
    return out


#: The sets the per-stack table covers: each a loader of its rows that ran (every one of these sets' rows ran)
def _stack_sets(directory: Path) -> dict[str, list[Row]]:
    from tests.benchmarks.calibration import BRIDGE_FUSED_LOSS, load_megatron_bridge, load_stack_set
    from tests.benchmarks.moe_rows import load_bridge_moe, load_simumax_moe

    dense = load_megatron_bridge(directory, cp=True).rows
    # the perf scripts' fused cross entropy is set for every model (calibration.BRIDGE_FUSED_LOSS), MoE too
    moe = [replace(r, fused_loss=BRIDGE_FUSED_LOSS) for r in load_bridge_moe(directory).rows]
    return {
        "torchtitan (FSDP2, H100)": load_stack_set(directory, "torchtitan_h100_fsdp2.csv").rows,
        "llm-foundry (FSDP, H100)": load_stack_set(directory, "llmfoundry_h100_fsdp.csv").rows,
        "SimuMax (Megatron-LM, B200) dense": load_stack_set(directory, "simumax_b200_megatron.csv").rows,
        "SimuMax (Megatron-LM, B200) MoE": load_simumax_moe(directory).rows,
        "Megatron-Bridge dense": [r for r in dense if r.config.cp == 1],
        "Megatron-Bridge dense, cp > 1": [r for r in dense if r.config.cp > 1],
        "Megatron-Bridge MoE": moe,
    }


TABLE_HEADER = ("| set | stack (its prior) | ran | ran, dropped: < 2% to fit / a rule | out of memory | "
                "OOM called >= 50% sure |\n|---|---|---|---|---|---|")


def table_line(set_name: str, stack: str, prior: FitsPrior, ran: list[Point], failed: list[Point]) -> tuple[str, bool]:
    """One line of the per-stack table, and whether it misses a target (> 2% of the runs that ran
    dropped, or an out-of-memory run called >= 50% sure to fit)."""
    def p(pt: Point) -> float:
        return float(norm.cdf((pt.headroom - prior.mu) / prior.sd))

    by_memory = [pt for pt in ran if p(pt) < KEEP_THRESHOLD]
    by_rule = [pt for pt in ran if " rule: " in pt.label]
    dropped = len({pt.label for pt in by_memory + by_rule})
    called = sum(p(pt) >= 0.5 for pt in failed)
    pct = 100 * dropped / max(1, len(ran))
    oom = f"{len(failed)}" if failed else "-"
    sure = f"{called} ({100 * called / len(failed):.1f}%)" if failed else "-"
    return (f"| {set_name} | {stack} ({prior.name}) | {len(ran)} | {dropped} ({pct:.1f}%): {len(by_memory)} / "
            f"{len(by_rule)} | {oom} | {sure} |", pct > 2.0 or called > 0)


def stack_table(directory: Path, fixed: dict[str, tuple[str, FitsPrior, list[Point], list[Point]]],
                verbose: bool = False) -> bool:
    """Print the per-set, per-stack table (``fixed``: the sets of one stack with out-of-memory runs,
    by name); True when a stack set misses a target (the sets in ``fixed`` are checked by ``main``)."""
    print(TABLE_HEADER)
    for name, (stack, prior, ran, failed) in fixed.items():
        print(table_line(name, stack, prior, ran, failed)[0])
    missed = False
    for name, rows in _stack_sets(directory).items():
        by_stack: dict[str, list[Point]] = {}
        for stack, pt in row_points(rows):
            by_stack.setdefault(stack, []).append(pt)
        for stack in sorted(by_stack):
            prior = get_stack(stack).gpu_fits_prior
            line, miss = table_line(name, stack, prior, by_stack[stack], [])
            print(line)
            missed |= miss
            if verbose:
                for pt in by_stack[stack]:
                    chance = float(norm.cdf((pt.headroom - prior.mu) / prior.sd))
                    if chance < KEEP_THRESHOLD or " rule: " in pt.label:
                        print(f"|   dropped: {pt.label}, predicted/capacity {math.exp(-pt.headroom):.2f}, "
                              f"chance to fit {chance:.1%} | | | | | |")
    return missed


@dataclass(frozen=True)
class Job:
    """One single-GPU job: its recipe and what each measured configuration did."""

    name: str
    model: ModelSpec
    training: TrainingSpec
    #: label -> (status, step time)
    measured: dict[str, tuple[str, float | None]]


def single_gpu_jobs(directory: Path) -> list[Job]:
    groups: dict[str, list[tuple[ParallelConfig, str, float | None]]] = {}
    specs: dict[str, tuple[ModelSpec, TrainingSpec]] = {}
    for r in load_h100_single_gpu(directory):
        if r.runner != "deepspeed-trial":
            continue
        name = f"{r.model.name} {r.training.method} seq{r.training.seq_len}"
        specs[name] = (r.model, r.training)
        groups.setdefault(name, []).append((r.config, r.status, r.step_time))
    model = ModelSpec.preset("llama3-8b")
    lora = LoraSpec(rank=16, alpha=32.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    training = TrainingSpec(global_batch=8, seq_len=4096, dtype="bf16", optimizer="adamw", method="lora", lora=lora)
    specs["llama3-8b lora seq4096 (not fitted)"] = (model, training)
    for name in ("gpu_memory_8b.csv", "gpu_memory_8b_more.csv"):
        with open(RESULTS / "h100-2026-11-27" / name, newline="") as f:
            for row in csv.DictReader(f):
                mbs = int(row["label"].split(" mbs")[1].split()[0])
                config = ParallelConfig(tp=1, pp=1, dp=1, mbs=mbs, global_batch=8, zero_stage=0,
                                        recompute=row["label"].split("rc:")[1])
                step = float(row["step_s"]) if row["step_s"] else None
                groups.setdefault("llama3-8b lora seq4096 (not fitted)", []).append((config, row["status"], step))
    jobs = []
    for name, rows in groups.items():
        base_model, base_training = specs[name]
        recipe = replace(base_training, micro_batches=tuple(sorted({c.mbs for c, _, _ in rows})),
                         recompute=tuple(sorted({c.recompute for c, _, _ in rows})),
                         zero_stages=(0,), schedules=("1f1b",))
        jobs.append(Job(name, base_model, recipe, {c.label: (status, t) for c, status, t in rows}))
    return jobs


def replay_job(job: Job) -> dict[str, object]:
    """The tuner on one job, every trial answered from the measurements (module docstring)."""
    from pipette.clusterfile import homogeneous_cluster
    from pipette.measurement import Measurement
    from pipette.plan import make_plan
    from pipette.tuner import StepProgress, TuneOptions, Tuner

    cluster = homogeneous_cluster("H100-80GB", nodes=1, devices_per_node=1, intra_bandwidth=450e9,
                                  inter_bandwidth=50e9)
    plan = make_plan(job.model, job.training, cluster)
    tokens = job.training.tokens_per_step
    trials: list[str] = []

    def runner(config: ParallelConfig, on_step: object) -> Measurement:
        status, step = job.measured[config.label]
        trials.append(status)
        if status != "ok" or step is None:
            return Measurement("oom", tokens_per_step=tokens, error="rank 0 ran out of device memory")
        for i in range(4):
            if on_step(StepProgress(i, step, False)):  # type: ignore[operator]
                return Measurement("pruned", (step,) * (i + 1), tokens)
        return Measurement("ok", (step,) * 4, tokens)

    def runnable(config: ParallelConfig) -> list[str]:
        return [] if config.label in job.measured else ["no measured run"]

    ran = {k: t for k, (s, t) in job.measured.items() if s == "ok" and t is not None}
    best = min(ran, key=ran.__getitem__)
    dropped = [k for k in ran if k not in {p.config.label for p in plan.ranked}]
    result = Tuner(plan, TuneOptions(max_trials=len(job.measured)), runnable=runnable).run(runner)
    pick = result.best.label if result.best else None
    return {"job": job.name, "pick": pick, "best": best, "pick_is_best": pick == best,
            "regret": (ran[pick] / ran[best] - 1) if pick in ran else None, "trials": len(trials),
            "oom_trials": trials.count("oom"), "ran_but_dropped": dropped}


def _measured(points: list[Point]) -> list[Point]:
    return [p for p in points if p.error is None or not math.isnan(p.error)]


def fit(points: list[Point]) -> tuple[float, float]:
    """Maximum-likelihood (mu, sd) of the log error, OOM runs right-censored at their headroom."""
    ran = np.array([p.error for p in points if p.error is not None])
    cens = np.array([p.headroom for p in points if p.error is None])

    def nll(theta: np.ndarray) -> float:
        mu, log_sd = float(theta[0]), float(theta[1])
        sd = math.exp(log_sd)
        out = -norm.logpdf(ran, mu, sd).sum()
        if cens.size:
            out -= norm.logsf(cens, mu, sd).sum()
        return float(out)

    start = np.array([float(ran.mean()), math.log(max(float(ran.std()), 0.01))])
    res = minimize(nll, start, method="Nelder-Mead")
    return float(res.x[0]), float(math.exp(res.x[1]))


def score(name: str, prior: FitsPrior, ran: list[Point], failed: list[Point], verbose: bool) -> dict[str, float]:
    def p(pt: Point) -> float:
        return float(norm.cdf((pt.headroom - prior.mu) / prior.sd))

    dropped = [pt for pt in ran if p(pt) < KEEP_THRESHOLD]
    sure = [pt for pt in failed if p(pt) >= SURE_TO_FIT]
    if verbose:
        for pt in ran + failed:
            print(f"  {pt.label:50s} {'ran' if pt.ran else 'OOM':3s} predicted/capacity "
                  f"{math.exp(-pt.headroom):5.2f}  chance to fit {p(pt):6.1%}")
    out = {"ran": len(ran), "dropped": len(dropped), "dropped_pct": 100 * len(dropped) / max(1, len(ran)),
           "failed": len(failed), "sure": len(sure), "sure_pct": 100 * len(sure) / max(1, len(failed))}
    print(f"{name} with {prior.name} (mu {prior.mu:+.3f}, sd {prior.sd:.3f}): {out['dropped']} of {out['ran']} that "
          f"ran dropped ({out['dropped_pct']:.1f}%; keep threshold {KEEP_THRESHOLD:.0%}), {out['sure']} of "
          f"{out['failed']} that failed sure to fit ({out['sure_pct']:.1f}%; sure >= {SURE_TO_FIT:.0%})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="print each set's maximum-likelihood prior")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--quiet", action="store_true", help="no per-run lines")
    ap.add_argument("--tables-only", action="store_true", help="stop after the per-stack table (no replays)")
    args = ap.parse_args(argv)
    directory = calibration_dir()
    h100 = h100_points(directory)
    b8 = llama8b_points()
    h200 = llama8b_points("h200-2026-11-27", ("gpu_memory_8b_h200.csv",), H200_BYTES)
    nano_ran, nano_failed = nanotron_points(directory)
    titan = stack_points(directory, "torchtitan_h100_fsdp2.csv")
    foundry = stack_points(directory, "llmfoundry_h100_fsdp.csv")
    simumax = stack_points(directory, "simumax_b200_megatron.csv")
    if args.fit:
        for name, pts in (("h100_single_gpu (fit set)", h100), ("llama3-8b table (check set)", b8),
                          ("ultrascale", nano_ran), ("torchtitan (fsdp, reserved)", _measured(titan)),
                          ("simumax (megatron on B200, reserved)", _measured(simumax))):
            mu, sd = fit(pts)
            print(f"fit {name}: mu {mu:+.3f} sd {sd:.3f} ({sum(p.ran for p in pts)} ran, "
                  f"{sum(not p.ran for p in pts)} OOM)")
        share = megatron_reserved_share(directory)
        print(f"megatron reserved share (SimuMax, geometric mean of peak reserved / live estimate - 1): {share:.4f}")
    missed = False
    for name, prior, pts, verbose in (("h100_single_gpu", PIPETTE_GPU, h100, not args.quiet),
                                      ("llama3-8b LoRA H100 (not fitted)", PIPETTE_GPU, b8, not args.quiet),
                                      ("llama3-8b LoRA H200, whole device (not fitted)", PIPETTE_GPU, h200,
                                       not args.quiet)):
        out = score(name, prior, [p for p in pts if p.ran], [p for p in pts if not p.ran], verbose)
        missed |= out["dropped"] > 0 or out["sure"] > 0
    out = score("ultrascale (nanotron)", NANOTRON_GPU, nano_ran, nano_failed, False)
    missed |= out["dropped_pct"] > 2.0 or out["sure_pct"] > 5.0
    for name, stack, pts in (("torchtitan (fsdp, fitted)", "fsdp", titan), ("llm-foundry (fsdp, not fitted)", "fsdp",
                             foundry), ("simumax B200 (megatron, fitted)", "megatron", simumax)):
        out = score(name, get_stack(stack).gpu_fits_prior, pts, [], False)
        missed |= out["dropped_pct"] > 2.0
    print("\nper set and stack (every set's rows with its own stack's memory options and prior):")
    stack_missed = stack_table(directory, {
        "h100_single_gpu (Pipette's runner, fitted)": ("pipette", PIPETTE_GPU, [p for p in h100 if p.ran],
                                                       [p for p in h100 if not p.ran]),
        "Llama-3-8B LoRA, H100": ("pipette", PIPETTE_GPU, [p for p in b8 if p.ran], [p for p in b8 if not p.ran]),
        "Llama-3-8B LoRA, H200": ("pipette", PIPETTE_GPU, [p for p in h200 if p.ran], [p for p in h200 if not p.ran]),
        "Ultra-Scale (nanotron; failures nothing but memory explains)": ("nanotron", NANOTRON_GPU, nano_ran,
                                                                         nano_failed)}, verbose=not args.quiet)
    if args.tables_only:
        return 1 if args.check and stack_missed else 0
    replays = [replay_job(job) for job in single_gpu_jobs(directory)]
    for r in replays:
        print(f"replay {r['job']}: pick {r['pick']} ({'the measured best' if r['pick_is_best'] else 'NOT the best: '}"
              f"{'' if r['pick_is_best'] else r['best']}), {r['trials']} trials, {r['oom_trials']} out of memory; "
              f"ran but dropped by the plan: {r['ran_but_dropped'] or 'none'}")
    ooms = sum(int(r["oom_trials"]) for r in replays) / max(1, len(replays))  # type: ignore[call-overload]
    print(f"single-GPU replays: {sum(bool(r['pick_is_best']) for r in replays)} of {len(replays)} picks are the "
          f"measured best; {ooms:.2f} OOM trials per job (target <= 1)")
    missed |= not all(r["pick_is_best"] for r in replays) or ooms > 1.0
    if args.check and missed:
        print("target missed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
