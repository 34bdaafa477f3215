"""Tuner replay on real measurements: the tuner and four baselines on clusters whose trials
were already run (issue 4, "Benchmarks" 1).

Run from the repository root::

    .venv/bin/python tests/benchmarks/replay.py [--seeds 3] [--budget 20] [--out replay.json]
    .venv/bin/python tests/benchmarks/replay.py --source ultrascale --group 8B/1 --seeds 1

Groups. Each (model, #nodes) group of the Ultra-Scale H100 set and each (model shape,
#GPUs, global batch) group of the vTrain A100 set is one cluster. Its *measured space* is
the group's distinct configurations (tp, pp, dp, mbs, ZeRO, recompute, schedule: the
``pipette.search.PARAMS`` key); a configuration measured more than once (40 Ultra-Scale
duplicates, the data's README says keep both) counts with the median of its successful
runs, and as failed only when every run of it failed.

Plan. The tuner gets ``pipette.plan.make_plan`` over the group's model, cluster and recipe
(the recipe the set was measured with: its ZeRO stages, its micro-batch sizes, 1F1B), not a
candidate set built from the rows: the plan's candidates line up with the rows (every
vTrain row is in its plan; every Ultra-Scale group's best row is in its plan). Candidates
of the plan with no measured row are excluded with the tuner's ``runnable=`` argument
(reason "no measured row"), so the tuner searches plan ∩ measured. Measured rows the
memory estimator says do not fit are outside the plan: the tuner and the analytic order
cannot reach them, the model-free baselines can.

A trial of a measured configuration replays it: ``ok`` rows give one warm-up step and
``STEPS`` timed steps of the measured step time times ``exp(TRIAL_NOISE_SD * N(0, 1))`` (one
draw per trial: the run-to-run spread of one configuration that its own steps cannot show;
``--trial-noise`` sets it, e.g. 0.08 for this 2-core machine's 4-rank CPU trials)
times ``1 + NOISE_SD * N(0, 1)`` per step (deterministic per seed, configuration and the
how-many-th trial of it), with the measured peak memory (Ultra-Scale's
``gpu_mem_gb``; ``--no-peak-memory`` leaves it out). The data do not say whether a failed
row (``nan``) crashed or ran out of memory: it replays as ``oom`` when the plan's memory
estimator puts it over the capacity, or at ``OOM_FRACTION`` of it or more where nothing else in
the data explains the failure, else as ``failed`` (see the constant). vTrain has no failed rows.

Methods, each with a budget of ``--budget`` trials (attempts; the tuner's retry of a
failed trial counts as a trial) on every group and seed:

* ``tuner``: ``pipette.tuner.Tuner`` with default ``TuneOptions`` but ``max_trials=budget``;
  it is driven with ``Tuner.step`` until the budget or until no candidate is left (the
  curve), and at the first point where it would stop on its own (its stop rule says
  "converged", or its search budget, ``budget`` less the trials it keeps for re-timing, is
  spent, or nothing is left) a copy rebuilt from its records re-times its contenders
  (``Tuner.retime``) and names its pick: the stop point, the regret of the pick and the
  confidence the tuner states are reported next to the curve;
* ``random``: the measured space in a random order (seeded);
* ``tpe``: Optuna's ``TPESampler`` (multivariate, seeded) over one categorical per
  ``PARAMS`` entry (the values the plan and the rows take), maximising tokens/s; a failed
  run is value 0 with a positive constraint (``trial.set_constraint``, as the tuner does).
  A proposal with no measured row (an invalid or unmeasured combination) is told as value
  0 with a positive constraint and does *not* count as a trial (a real searcher rejects an
  invalid combination for free; an unmeasured valid one would cost a trial, so this
  favours TPE); a proposal of an already-tried configuration is told its earlier value and
  is free too. After ``TPE_MAX_REJECTS`` such proposals in a row the next trial is a
  random untried measured configuration (counted as a trial);
* ``grid``: DeepSpeed-Autotuning-style order: ZeRO stage upward; within a stage, the
  layouts (tp, pp) from pure data parallelism upward; within a layout, micro-batch upward,
  skipping the larger micro-batches of a layout after it failed (as the autotuner stops at
  the largest micro-batch that fits). Deterministic: its seeds agree;
* ``analytic``: the model's rank order without learning (the plan's order over plan ∩
  measured): its first trial is "the model's top-1 alone".

Distorted prior (``--distort SEED``): a stress test of a wrong analytic model. Every
candidate's predicted step time is multiplied by a factor per regime: one per tp degree,
pp degree, ZeRO stage and node count, each log-uniform in ``[1/sqrt(5), sqrt(5)]`` (seeded),
their product clipped to ``[0.2, 5]``; the plan is re-ranked by the distorted prediction.
The measured truth is untouched. The tuner, the analytic order and the baselines all see
the distorted plan (the model-free baselines do not use it).

Figures per method, per source and overall, over every (group, seed) run: trials until a
successful trial within 2% of the group's measured best (median and 90th percentile,
nearest rank; a run that never gets there counts as ``> budget``), regret after 3, 5 and
10 trials (best measured step time found / group best - 1; mean and 90th percentile; a run
with no successful trial yet counts with the group's worst successful row), failed and
out-of-memory trials spent over the whole run and before reaching 2%. What a user who stops
early gets (issue 46, "First trials that run"): per run, whether one of its first three trials
ran (``ok``), and the median regret after three trials; for the tuner, the median regret of its
pick at its own stop too.

``--first-sure X`` sets ``pipette.search.FIRST_SURE_TO_FIT`` for the run (the chance to fit and
run a first trial needs; 0: the expected step time alone orders the first trials, as before
issue 46); ``first_trials_cv.py`` chooses it across the Ultra-Scale model sizes from such runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import optuna  # noqa: E402
from optuna.distributions import BaseDistribution, CategoricalDistribution  # noqa: E402

from pipette import search  # noqa: E402
from pipette.clusterfile import load_cluster  # noqa: E402
from pipette.config import ParallelConfig  # noqa: E402
from pipette.errors import PipetteError, SpecError  # noqa: E402
from pipette.fits import NANOTRON_GPU  # noqa: E402
from pipette.measurement import Measurement  # noqa: E402
from pipette.memory import MEGATRON_OPTIONS, NANOTRON_OPTIONS, estimate_memory  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.perf import MEGATRON_CONSTANTS  # noqa: E402
from pipette.plan import Plan, make_plan  # noqa: E402
from pipette.retiming import RetimeBudget  # noqa: E402
from pipette.search import PARAMS, candidate_params, params_key  # noqa: E402
from pipette.training import TrainingSpec  # noqa: E402
from pipette.tuner import OnStep, StepProgress, TuneOptions, Tuner  # noqa: E402
from tests.benchmarks.calibration import Row, calibration_dir, load_ultrascale, load_vtrain  # noqa: E402
from tests.benchmarks.memory_accuracy import memory_plausible_failures  # noqa: E402

Key = tuple[Any, ...]

METHODS: tuple[str, ...] = ("tuner", "random", "tpe", "grid", "analytic")
SOURCES: tuple[str, ...] = ("ultrascale", "vtrain", "cpu-both")
#: What runs without ``--source``: the two published sets.
DEFAULT_SOURCES: tuple[str, ...] = ("ultrascale", "vtrain")
#: ``cpu-both``: the recorded exhaustive run over both families on the cpu-4 dev cluster (issue
#: 31; ``real_tuning.py --stack pipette,fsdp``, every candidate measured), replayed with each
#: candidate's median; its trials spread far more than a GPU's (``--trial-noise 0.08``).
RECORDED_BOTH = REPO / "tests" / "benchmarks" / "results" / "cpu-2026-11-27" / "real_tuning_both.json"
CPU4 = REPO / "examples" / "clusters" / "cpu-4.yaml"
#: Within this fraction of the group's measured best counts as found (the issue's 2%).
WITHIN = 0.02
REGRET_AT: tuple[int, ...] = (3, 5, 10)
#: What a user who stops early gets: the first this many trials (issue 46).
FIRST = 3
#: Timed steps per replayed trial and their spread within a trial (1%).
STEPS = 5
NOISE_SD = 0.01
#: Spread of one configuration from trial to trial (log sd): 2%, a quiet GPU cluster (on
#: this 2-core machine's CPU trials it is 10-44% max/min; README).
TRIAL_NOISE_SD = 0.02
#: the tuner's options beyond the budget and seed (``--reserve``, ``--retime``): a benchmark of a job
#: that sets them, as CI's shaped-cluster test does
TUNE_OVERRIDES: dict[str, Any] = {}
#: Distorted prior: each regime's factor is log-uniform in [1/DISTORT_EACH, DISTORT_EACH],
#: their product clipped to [1/DISTORT_MAX, DISTORT_MAX].
DISTORT_EACH = math.sqrt(5.0)
DISTORT_MAX = 5.0
#: A failed Ultra-Scale row replays as "oom" when the plan's estimator puts it over the capacity,
#: or at this fraction of it or more where the data leave the failure to memory
#: (``memory_accuracy.memory_plausible_failures``: no run of the same degrees and ZeRO stage with
#: as much in flight ran, and some micro-batch of them did); else as "failed". The estimator
#: under-counts the nanotron runs that succeeded by up to 2x (measured / predicted peak), so a
#: failed row predicted at >= 0.5 of capacity may well have run out of memory; one predicted at
#: 2-20% of it did not. A failure whose peers ran with more in flight is a crash: replayed as an
#: OOM it taught the tuner's memory model a boundary that is not there (8B on 16 nodes: the
#: measured best's chance to fit fell 0.97 -> 0.65 after tp2-pp4-dp16 ZeRO-0's crash).
OOM_FRACTION = 0.5
#: TPE: proposals without a new measured configuration in a row before a random one.
TPE_MAX_REJECTS = 25


# ---- groups -------------------------------------------------------------------------
@dataclass(frozen=True)
class Truth:
    """What a measured configuration replays as."""

    status: str  # ok | oom | failed
    step_time: float | None
    peak_bytes: int | None
    runs: int


@dataclass
class Group:
    source: str
    name: str
    plan: Plan
    configs: dict[Key, ParallelConfig]
    truths: dict[Key, Truth]

    @property
    def best(self) -> float:
        return min(t.step_time for t in self.truths.values() if t.step_time is not None)

    @property
    def worst(self) -> float:
        return max(t.step_time for t in self.truths.values() if t.step_time is not None)

    def regret(self, step_time: float | None) -> float:
        """Regret of handing over ``step_time``; with nothing found, the worst row's."""
        return (self.worst if step_time is None else step_time) / self.best - 1.0


def key_of(config: ParallelConfig) -> Key:
    return params_key(candidate_params(config))


def distort_plan(plan: Plan, seed: int) -> Plan:
    """The plan with every prediction multiplied by its regimes' factors (module docstring)."""
    nodes = len(plan.cluster.nodes)

    def factor(kind: str, value: object) -> float:
        rng = np.random.default_rng([seed, zlib.crc32(f"{kind}={value}".encode())])
        return math.exp(float(rng.uniform(-math.log(DISTORT_EACH), math.log(DISTORT_EACH))))

    ranked = []
    for p in plan.ranked:
        c = p.config
        f = factor("tp", c.tp) * factor("pp", c.pp) * factor("zero", c.zero_stage) * factor("nodes", nodes)
        f = min(DISTORT_MAX, max(1.0 / DISTORT_MAX, f))
        perf = replace(p.perf, step_time=p.perf.step_time * f,
                       breakdown={k: v * f for k, v in p.perf.breakdown.items()},
                       tokens_per_s=p.perf.tokens_per_s / f, mfu=p.perf.mfu / f, hfu=p.perf.hfu / f)
        ranked.append(replace(p, perf=perf, default_step_time=p.default_step_time * f))
    ranked.sort(key=lambda p: (p.perf.step_time, p.config.label))
    return replace(plan, ranked=ranked)


def build_group(source: str, rows: Sequence[Row], distort: int | None = None) -> Group:
    """The group's plan (the set's recipe) and what each measured configuration replays as."""
    r0 = rows[0]
    training = replace(
        r0.training,
        zero_stages=tuple(sorted({r.config.zero_stage for r in rows})),
        micro_batches=tuple(sorted({r.config.mbs for r in rows})),
        schedules=("1f1b",),
    )
    # the set's own framework (Megatron-DeepSpeed, nanotron): its constants, not Pipette's stack's,
    # and nanotron's memory with its error (pipette.fits: fitted on Ultra-Scale with these options)
    options = NANOTRON_OPTIONS if source == "ultrascale" else MEGATRON_OPTIONS
    plan = make_plan(r0.model, training, r0.cluster, constants=MEGATRON_CONSTANTS, memory_options=options,
                     fits_prior=NANOTRON_GPU if source == "ultrascale" else None)
    if distort is not None:
        plan = distort_plan(plan, distort)
    by_key: dict[Key, list[Row]] = {}
    for r in rows:
        by_key.setdefault(key_of(r.config), []).append(r)
    capacity, kind = r0.cluster.min_usable_memory, r0.cluster.device_spec.kind
    # failures the data leave to memory (no run of the same degrees and ZeRO stage with as much in
    # flight ran, and some micro-batch of them did): only these may replay as out of memory
    plausible = {id(r) for r in memory_plausible_failures(list(rows))} if source == "ultrascale" else set()
    configs, truths = {}, {}
    for key, rs in by_key.items():
        configs[key] = rs[0].config
        ok = [r for r in rs if r.ok and r.step_time is not None]
        if ok:
            peaks = [int(r.peak_memory) for r in ok if r.peak_memory]
            truths[key] = Truth("ok", float(np.median([r.step_time for r in ok])), max(peaks) if peaks else None,
                                len(rs))
        else:
            mem = estimate_memory(r0.model, training, rs[0].config, capacity, device_kind=kind,
                                  options=options)
            memory_left = any(id(r) in plausible for r in rs)
            oom = mem.peak_bytes >= capacity or (memory_left and mem.peak_bytes >= OOM_FRACTION * capacity)
            status = "oom" if oom else "failed"
            truths[key] = Truth(status, None, None, len(rs))
    return Group(source, "/".join(r0.group), plan, configs, truths)


def build_recorded_group(path: Path = RECORDED_BOTH, distort: int | None = None) -> Group:
    """The recorded run over both families: the plan Pipette makes for it (each stack priced by its
    own constants for the cluster's devices) and every measured candidate's median step time."""
    data = json.loads(path.read_text())
    model, training = ModelSpec.preset(data["model"]), TrainingSpec.from_dict(data["training"])
    plan = make_plan(model, training, load_cluster(str(CPU4)), stack=",".join(data["stacks"]))
    if distort is not None:
        plan = distort_plan(plan, distort)
    configs, truths = {}, {}
    for row in data["exhaustive"]["ranking"]:
        config = ParallelConfig.from_dict(row["config"])
        key = key_of(config)
        peaks = [max(t["peak_memory"]) for t in row["trials"] if t.get("peak_memory")]
        configs[key] = config
        truths[key] = Truth("ok", float(row["step_time"]), max(peaks) if peaks else None, len(row["trials"]))
    return Group("cpu-both", f"{data['model']}/{data['cluster']['name']}/{'+'.join(data['stacks'])}", plan,
                 configs, truths)


def load_groups(directory: Path, sources: Sequence[str], only: str | None = None,
                distort: int | None = None) -> list[Group]:
    loaders: dict[str, Callable[[Path], list[Row]]] = {"ultrascale": load_ultrascale, "vtrain": load_vtrain}
    out = []
    for source in sources:
        if source == "cpu-both":
            recorded = build_recorded_group(distort=distort)
            if only is None or recorded.name == only:
                out.append(recorded)
            continue
        grouped: dict[tuple[str, ...], list[Row]] = {}
        for r in loaders[source](directory):
            grouped.setdefault(r.group, []).append(r)
        for name in sorted(grouped, key=lambda g: tuple(int(x) if x.isdigit() else 0 for x in g) + g):
            if only is not None and "/".join(name) != only:
                continue
            rows = grouped[name]
            if not any(r.ok for r in rows):
                continue
            out.append(build_group(source, rows, distort))
    if only is not None and not out:
        raise SpecError(f"no group {only!r} in {', '.join(sources)}", field="--group",
                        fix="name a group as model/nodes (ultrascale, e.g. 8B/1) or "
                            "model/gpus/global_batch (vtrain, e.g. vtrain-gpt-h1024-l12/8/16)")
    return out


# ---- replayed trials ----------------------------------------------------------------
@dataclass
class Trace:
    """One method's run on one group: the attempts in order."""

    method: str
    keys: list[Key] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    #: the tuner only: attempts made when it would first stop on its own (re-timing included),
    #: the regret of its pick then, the confidence it stated, and its learned model's summary
    would_stop: int | None = None
    stop_regret: float | None = None
    #: the pick's true step time within WITHIN of the best candidate it had tried (what its
    #: confidence is about), or None
    within_tried: bool | None = None
    confidence: float | None = None
    #: the confidence it stated against every candidate, the untried ones under its model
    confidence_overall: float | None = None
    learned: dict[str, Any] = field(default_factory=dict)
    end: str = ""
    invalid_proposals: int = 0


class ReplayRunner:
    """A ``TrialRunner`` whose trials are the group's measured runs (module docstring)."""

    #: the trial-to-trial spread (log sd) of every runner; ``--trial-noise`` sets it
    trial_noise_sd: float = TRIAL_NOISE_SD
    #: how much slower (a factor) the job's first trial runs: a cold start (``--slow-first``)
    slow_first: float = 1.0

    def __init__(self, group: Group, seed: int, trace: Trace, peak_memory: bool = True,
                 calls: dict[Key, int] | None = None) -> None:
        self.group, self.seed, self.trace, self.peak_memory = group, seed, trace, peak_memory
        self.tokens = group.plan.training.tokens_per_step
        #: trials so far per configuration (each trial of it draws its own noise)
        self.calls: dict[Key, int] = dict(calls or {})

    def __call__(self, config: ParallelConfig, on_step: OnStep) -> Measurement:
        key = key_of(config)
        truth = self.group.truths[key]
        self.trace.keys.append(key)
        self.calls[key] = self.calls.get(key, 0) + 1
        m = self._measure(config, truth, on_step)
        self.trace.statuses.append(m.status)
        return m

    def _measure(self, config: ParallelConfig, truth: Truth, on_step: OnStep) -> Measurement:
        if truth.step_time is None:
            error = "rank 0 ran out of memory" if truth.status == "oom" else "rank 0 exited with status 1"
            return Measurement(truth.status, tokens_per_step=self.tokens, error=error)  # type: ignore[arg-type]
        rng = np.random.default_rng([self.seed, zlib.crc32(config.label.encode()), self.calls[key_of(config)]])
        trial = truth.step_time * math.exp(self.trial_noise_sd * float(rng.standard_normal()))
        if sum(self.calls.values()) == 1:
            trial *= self.slow_first
        on_step(StepProgress(0, trial * 1.3, True))
        times: list[float] = []
        for i in range(STEPS):
            times.append(trial * (1.0 + NOISE_SD * float(rng.standard_normal())))
            if on_step(StepProgress(i + 1, times[-1], False)):
                return Measurement("pruned", tuple(times), self.tokens)
        peak = (truth.peak_bytes,) if self.peak_memory and truth.peak_bytes else ()
        return Measurement("ok", tuple(times), self.tokens, peak)

    def replay(self, key: Key) -> Measurement:
        return self(self.group.configs[key], lambda p: False)


# ---- methods ------------------------------------------------------------------------
def run_tuner(group: Group, seed: int, budget: int, peak_memory: bool = True) -> Trace:
    trace = Trace("tuner")
    runner = ReplayRunner(group, seed, trace, peak_memory)

    def runnable(c: ParallelConfig) -> list[str]:
        return [] if key_of(c) in group.truths else ["no measured row"]

    # the curve: the search alone, to the whole budget
    options = TuneOptions(max_trials=budget, seed=seed, **TUNE_OVERRIDES)
    tuner = Tuner(group.plan, replace(options, retime=0), runnable=runnable)
    reserve = RetimeBudget(options, group.plan.cluster.device_spec.kind).reserve
    while len(trace.keys) < budget:
        reason = tuner.stop_reason()
        if trace.would_stop is None:
            if reason is None and tuner.best is not None and len(tuner.study.trials) >= budget - reserve:
                reason = "search budget spent"
            if reason is not None:
                _stop_here(group, seed, budget, tuner, runner, trace, reason, peak_memory, runnable)
        if reason is not None and not reason.startswith("converged") and reason != "search budget spent":
            trace.end = reason
            break
        tuner.step(runner)
    else:
        trace.end = "budget"
    if trace.would_stop is None:
        _stop_here(group, seed, budget, tuner, runner, trace, trace.end, peak_memory, runnable)
    return trace


def _stop_here(group: Group, seed: int, budget: int, tuner: Tuner, runner: ReplayRunner, trace: Trace,
               reason: str, peak_memory: bool, runnable: Callable[[ParallelConfig], list[str]]) -> None:
    """Where the tuner would stop on its own: a copy rebuilt from its records re-times its
    contenders (their trials draw fresh noise) and names its pick."""
    fork = Tuner(group.plan, TuneOptions(max_trials=budget, seed=seed, **TUNE_OVERRIDES), history=tuner.records,
                 runnable=runnable)
    extra = Trace("tuner")
    fork.retime(ReplayRunner(group, seed, extra, peak_memory, calls=runner.calls), reason)
    trace.would_stop = len(trace.keys) + len(extra.keys)
    pick = fork.best
    trace.stop_regret = None if pick is None else group.regret(group.truths[key_of(pick.config)].step_time)
    tried = [group.truths[k].step_time for k, st in zip(trace.keys + extra.keys, trace.statuses + extra.statuses,
                                                          strict=True) if st == "ok"]
    if pick is not None and tried:
        best_tried = min(t for t in tried if t is not None)
        trace.within_tried = (group.truths[key_of(pick.config)].step_time or math.inf) <= best_tried * (1 + WITHIN)
    trace.confidence = fork.confidence()
    trace.confidence_overall = fork.confidence_overall()
    trace.learned = fork.sampler.learned(fork.study).summary()


def run_random(group: Group, seed: int, budget: int) -> Trace:
    trace = Trace("random")
    runner = ReplayRunner(group, seed, trace)
    keys = sorted(group.truths, key=str)
    for i in np.random.default_rng(seed).permutation(len(keys))[:budget]:
        runner.replay(keys[int(i)])
    return trace


def tpe_space(group: Group) -> dict[str, BaseDistribution]:
    """One categorical per ``PARAMS`` entry over the values the plan and the rows take."""
    values: dict[str, set[Any]] = {p: set() for p in PARAMS}
    for config in [*(p.config for p in group.plan.ranked), *group.configs.values()]:
        for name, value in candidate_params(config).items():
            values[name].add(value)
    return {name: CategoricalDistribution(sorted(v, key=str)) for name, v in values.items()}


def run_tpe(group: Group, seed: int, budget: int) -> Trace:
    trace = Trace("tpe")
    runner = ReplayRunner(group, seed, trace)
    space = tpe_space(group)
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=seed, multivariate=True))
    outcome: dict[Key, tuple[float, dict[str, float]]] = {}
    rng = np.random.default_rng(seed)
    rejects = 0
    while len(trace.keys) < budget and len(outcome) < len(group.truths):
        if rejects >= TPE_MAX_REJECTS:
            untried = sorted((k for k in group.truths if k not in outcome), key=str)
            key = untried[int(rng.integers(len(untried)))]
            outcome[key] = _tpe_outcome(runner.replay(key))
            study.add_trial(optuna.trial.create_trial(
                params=dict(zip(PARAMS, key, strict=True)), distributions=space, value=outcome[key][0],
                constraints=outcome[key][1]))
            rejects = 0
            continue
        trial = study.ask(space)
        key = params_key(trial.params)
        if key not in group.truths or key in outcome:
            if key not in group.truths:
                trace.invalid_proposals += 1
            value, constraints = outcome.get(key, (0.0, {"measured": 1.0}))
            for name, v in constraints.items():
                trial.set_constraint(name, v)
            study.tell(trial, value)
            rejects += 1
            continue
        rejects = 0
        outcome[key] = _tpe_outcome(runner.replay(key))
        for name, v in outcome[key][1].items():
            trial.set_constraint(name, v)
        study.tell(trial, outcome[key][0])
    return trace


def _tpe_outcome(m: Measurement) -> tuple[float, dict[str, float]]:
    if m.status == "ok":
        return float(m.tokens_per_s or 0.0), {"runs": 0.0}
    return 0.0, {"runs": 1.0}


def run_grid(group: Group, seed: int, budget: int) -> Trace:
    trace = Trace("grid")
    runner = ReplayRunner(group, seed, trace)
    blocks: dict[tuple[int, int, int], list[Key]] = {}
    for key, c in group.configs.items():
        blocks.setdefault((c.zero_stage, c.tp, c.pp), []).append(key)
    for block in sorted(blocks):
        for key in sorted(blocks[block], key=lambda k: (group.configs[k].mbs, str(k))):
            if len(trace.keys) >= budget:
                return trace
            if runner.replay(key).status != "ok":
                break  # larger micro-batches of this layout would fail too
    return trace


def run_analytic(group: Group, seed: int, budget: int) -> Trace:
    trace = Trace("analytic")
    runner = ReplayRunner(group, seed, trace)
    for p in group.plan.ranked:
        if len(trace.keys) >= budget:
            break
        if key_of(p.config) in group.truths:
            runner.replay(key_of(p.config))
    return trace


# ---- figures ------------------------------------------------------------------------
@dataclass(frozen=True)
class RunFigures:
    method: str
    source: str
    group: str
    seed: int
    found_at: float  # attempts until within WITHIN of the best; inf when never
    regret: dict[int, float]
    failed: int  # failed + oom attempts in the whole run
    oom: int  # oom attempts in the whole run
    failed_before_found: int
    attempts: int
    would_stop: int | None
    regret_at_stop: float | None
    invalid_proposals: int
    end: str
    #: (label, status) of every attempt, in order
    trials: tuple[tuple[str, str], ...] = ()
    confidence: float | None = None
    within_tried: bool | None = None
    learned: dict[str, Any] = field(default_factory=dict)
    confidence_overall: float | None = None
    #: one of the first ``FIRST`` attempts ran (``ok``)
    ran_early: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method, "source": self.source, "group": self.group, "seed": self.seed,
            "found_at": None if math.isinf(self.found_at) else int(self.found_at),
            "regret": {str(k): v for k, v in self.regret.items()}, "failed": self.failed, "oom": self.oom,
            "failed_before_found": self.failed_before_found, "attempts": self.attempts,
            "would_stop": self.would_stop, "regret_at_stop": self.regret_at_stop,
            "invalid_proposals": self.invalid_proposals, "end": self.end,
            "confidence": self.confidence, "confidence_overall": self.confidence_overall,
            "within_tried": self.within_tried, "learned": self.learned, "ran_early": self.ran_early,
            "trials": [list(t) for t in self.trials],
        }


def figures(group: Group, seed: int, trace: Trace) -> RunFigures:
    best_so_far: list[float | None] = []
    current: float | None = None
    for key, status in zip(trace.keys, trace.statuses, strict=True):
        t = group.truths[key].step_time
        if status == "ok" and t is not None and (current is None or t < current):
            current = t
        best_so_far.append(current)

    def at(k: int) -> float | None:
        return best_so_far[min(k, len(best_so_far)) - 1] if best_so_far else None

    found = next((i + 1 for i, b in enumerate(best_so_far) if b is not None and b <= group.best * (1 + WITHIN)),
                 math.inf)
    bad = [s in ("oom", "failed") for s in trace.statuses]
    upto = len(bad) if math.isinf(found) else int(found)
    return RunFigures(
        trace.method, group.source, group.name, seed, found,
        {k: group.regret(at(k)) for k in REGRET_AT}, sum(bad), trace.statuses.count("oom"), sum(bad[:upto]),
        len(trace.keys),
        trace.would_stop,
        trace.stop_regret if trace.stop_regret is not None
        else None if trace.would_stop is None else group.regret(at(trace.would_stop) if trace.would_stop else None),
        trace.invalid_proposals, trace.end,
        tuple((group.configs[k].label, s) for k, s in zip(trace.keys, trace.statuses, strict=True)),
        confidence=trace.confidence, within_tried=trace.within_tried, learned=trace.learned,
        confidence_overall=trace.confidence_overall, ran_early="ok" in trace.statuses[:FIRST],
    )


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank (an observed value; inf sorts last)."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def summarize(runs: Sequence[RunFigures], budget: int) -> dict[str, Any]:
    found = [r.found_at for r in runs]
    out: dict[str, Any] = {
        "runs": len(runs),
        "trials_to_2pct_median": _finite(nearest_rank(found, 0.5)),
        "trials_to_2pct_p90": _finite(nearest_rank(found, 0.9)),
        "not_reached_pct": 100.0 * sum(math.isinf(f) for f in found) / len(runs),
        "failed_mean": float(np.mean([r.failed for r in runs])),
        "oom_mean": float(np.mean([r.oom for r in runs])),
        "failed_before_found_mean": float(np.mean([r.failed_before_found for r in runs])),
        "ran_early_pct": 100.0 * sum(r.ran_early for r in runs) / len(runs),
        f"regret@{FIRST}_median": float(np.median([r.regret[FIRST] for r in runs])),
    }
    for k in REGRET_AT:
        values = [r.regret[k] for r in runs]
        out[f"regret@{k}_mean"] = float(np.mean(values))
        out[f"regret@{k}_p90"] = nearest_rank(values, 0.9)
    stops = [r for r in runs if r.would_stop is not None]
    if stops:
        out["would_stop_median"] = nearest_rank([float(r.would_stop or 0) for r in stops], 0.5)
        out["would_stop_p90"] = nearest_rank([float(r.would_stop or 0) for r in stops], 0.9)
        out["regret_at_stop_mean"] = float(np.mean([r.regret_at_stop or 0.0 for r in stops]))
        out["regret_at_stop_median"] = float(np.median([r.regret_at_stop or 0.0 for r in stops]))
        out["regret_at_stop_p90"] = nearest_rank([r.regret_at_stop or 0.0 for r in stops], 0.9)
        out["within_2pct_at_stop_pct"] = 100.0 * sum((r.regret_at_stop or 0.0) <= WITHIN for r in stops) / len(stops)
    sure = [r for r in runs if r.confidence is not None and r.confidence >= 0.9]
    if sure:
        # the confidence is about the candidates tried; the second figure also charges the
        # stop rule for a best it never tried
        out["sure_runs"] = len(sure)
        out["sure_within_2pct_of_tried_pct"] = 100.0 * sum(bool(r.within_tried) for r in sure) / len(sure)
        out["sure_within_2pct_pct"] = 100.0 * sum((r.regret_at_stop or 0.0) <= WITHIN for r in sure) / len(sure)
    sure_all = [r for r in runs if r.confidence_overall is not None and r.confidence_overall >= 0.9]
    if sure_all:
        # the confidence against every candidate: charged for a best it never tried
        out["sure_overall_runs"] = len(sure_all)
        out["sure_overall_within_2pct_pct"] = (
            100.0 * sum((r.regret_at_stop or 0.0) <= WITHIN for r in sure_all) / len(sure_all))
    learned = [r.learned for r in runs if r.learned]
    if learned:
        for name in ("residual_sd", "length_scale", "regime_sd", "trial_noise_sd"):
            out[f"{name}_median"] = float(np.median([x[name] for x in learned]))
    out["invalid_proposals_mean"] = float(np.mean([r.invalid_proposals for r in runs]))
    out["budget"] = budget
    return out


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


#: Figures (lower is better) on which the tuner must beat every baseline.
FIGURES: tuple[str, ...] = ("trials_to_2pct_median", "trials_to_2pct_p90", "regret@3_mean", "regret@5_mean",
                            "regret@10_mean", "failed_mean", "oom_mean")


def verdict(table: dict[str, dict[str, Any]], budget: int) -> list[str]:
    """The issue's targets, each with what was measured; prefixed MET or MISSED."""
    t = table["tuner"]
    med = t["trials_to_2pct_median"]
    p90 = t["trials_to_2pct_p90"]
    lines = [
        f"{'MET' if med is not None and med <= 3 else 'MISSED'}: median trials to 2% <= 3 (is {_show(med, budget)})",
        f"{'MET' if p90 is not None and p90 <= 8 else 'MISSED'}: p90 trials to 2% <= 8 (is {_show(p90, budget)})",
        f"{'MET' if t['not_reached_pct'] == 0 else 'MISSED'}: never within 2% in 0% of runs "
        f"(is {t['not_reached_pct']:.1f}%)",
    ]
    ran, early = t["ran_early_pct"], t[f"regret@{FIRST}_median"]
    lines += [f"{'MET' if ran >= 95 else 'MISSED'}: one of the first {FIRST} trials ran in >= 95% of runs "
              f"(is {ran:.1f}%)",
              f"{'MET' if early <= 0.10 else 'MISSED'}: median regret after {FIRST} trials <= 10% (is {early:.2%})"]
    if "regret_at_stop_mean" in t:
        r = t["regret_at_stop_mean"]
        lines.append(f"{'MET' if r <= WITHIN else 'MISSED'}: mean regret of the pick at its own stop <= 2% "
                     f"(is {r:.2%}, stopping at a median of {t['would_stop_median']:.0f} trials)")
    if "sure_runs" in t:
        c, g = t["sure_within_2pct_of_tried_pct"], t["sure_within_2pct_pct"]
        lines.append(f"{'MET' if c >= 90 else 'MISSED'}: of runs >= 90% sure, >= 90% within 2% of the best "
                     f"tried (is {c:.1f}% of {t['sure_runs']}; within 2% of the best measured: {g:.1f}%)")
    if "sure_overall_runs" in t:
        c = t["sure_overall_within_2pct_pct"]
        lines.append(f"{'MET' if c >= 90 else 'MISSED'}: of runs >= 90% sure against every candidate, >= 90% "
                     f"within 2% of the best measured (is {c:.1f}% of {t['sure_overall_runs']})")
    for name in FIGURES:
        worse = []
        for m, s in table.items():
            if m == "tuner":
                continue
            a = math.inf if t[name] is None else t[name]
            b = math.inf if s[name] is None else s[name]
            if not a < b:
                worse.append(f"{m} {_show(s[name], budget)}")
        state = "MET" if not worse else "MISSED"
        lines.append(f"{state}: tuner better than every baseline on {name} (tuner {_show(t[name], budget)}"
                     + (f"; not better than {', '.join(worse)})" if worse else ")"))
    return lines


def _show(x: float | None, budget: int) -> str:
    if x is None:
        return f">{budget}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.4g}"


def print_table(title: str, table: dict[str, dict[str, Any]], budget: int) -> None:
    print(f"\n{title}")
    head = (f"  {'method':<9}{'runs':>6}{'to2% med':>10}{'p90':>6}{'miss%':>7}"
            + "".join(f"{'reg@' + str(k) + ' mean':>14}{'p90':>8}" for k in REGRET_AT)
            + f"{'fail+OOM':>10}{'OOM':>6}{'before2%':>10}{'ran@' + str(FIRST):>7}{'reg@3 med':>10}"
            + f"{'stop@med':>10}{'reg@stop':>10}")
    print(head)
    for method, s in table.items():
        line = (f"  {method:<9}{s['runs']:>6}{_show(s['trials_to_2pct_median'], budget):>10}"
                f"{_show(s['trials_to_2pct_p90'], budget):>6}{s['not_reached_pct']:>6.1f}%")
        for k in REGRET_AT:
            line += f"{s[f'regret@{k}_mean']:>13.2%} {s[f'regret@{k}_p90']:>7.1%}"
        line += f"{s['failed_mean']:>10.2f}{s['oom_mean']:>6.2f}{s['failed_before_found_mean']:>10.2f}"
        line += f"{s['ran_early_pct']:>6.1f}%{s[f'regret@{FIRST}_median']:>10.2%}"
        if "would_stop_median" in s and method == "tuner":
            line += f"{s['would_stop_median']:>10.0f}{s['regret_at_stop_mean']:>9.2%}"
        print(line)
        if method == "tuner" and "sure_runs" in s:
            print(f"    tuner: {s['sure_runs']} runs >= 90% sure at stop, {s['sure_within_2pct_of_tried_pct']:.1f}% "
                  f"of them within 2% of the best tried ({s['sure_within_2pct_pct']:.1f}% of the best); learned "
                  f"residual sd {s['residual_sd_median']:.2f}, length scale {s['length_scale_median']:.2f}, "
                  f"regime sd {s['regime_sd_median']:.2f}, trial noise sd {s['trial_noise_sd_median']:.3f} (medians)")
        if method == "tuner" and "sure_overall_runs" in s:
            print(f"    tuner: {s['sure_overall_runs']} runs >= 90% sure against every candidate (untried ones "
                  f"under its model), {s['sure_overall_within_2pct_pct']:.1f}% of them within 2% of the best")


# ---- driver -------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[Group, int, int], Trace]] = {
    "tuner": run_tuner, "random": run_random, "tpe": run_tpe, "grid": run_grid, "analytic": run_analytic,
}


def run_all(groups: Sequence[Group], seeds: int, budget: int, methods: Sequence[str] = METHODS,
            peak_memory: bool = True, progress: bool = False) -> list[RunFigures]:
    out = []
    for n, group in enumerate(groups):
        start = time.perf_counter()
        for method in methods:
            for seed in range(seeds):
                if method == "tuner":
                    trace = run_tuner(group, seed, budget, peak_memory)
                else:
                    trace = RUNNERS[method](group, seed, budget)
                out.append(figures(group, seed, trace))
        if progress:
            print(f"  [{n + 1}/{len(groups)}] {group.source} {group.name}: {len(group.truths)} measured, "
                  f"{len(group.plan.ranked)} in plan ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return out


def tables(runs: Sequence[RunFigures], budget: int) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    present = {r.source for r in runs}
    for scope in ["overall", *SOURCES] if len(present) > 1 else sorted(present):
        chosen = [r for r in runs if scope == "overall" or r.source == scope]
        if not chosen:
            continue
        methods = [m for m in METHODS if any(r.method == m for r in chosen)]
        out[scope] = {m: summarize([r for r in chosen if r.method == m], budget) for m in methods}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds per group and method (default 3)")
    ap.add_argument("--budget", type=int, default=20, help="trials per run (default 20)")
    ap.add_argument("--source", choices=SOURCES, action="append",
                    help="a set (repeatable; default ultrascale and vtrain; cpu-both: the recorded CPU run)")
    ap.add_argument("--group", help="one group only: model/nodes (ultrascale) or model/gpus/global_batch (vtrain)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--no-peak-memory", action="store_true", help="replay ok trials without their measured peak")
    ap.add_argument("--distort", type=int, metavar="SEED",
                    help="stress test: distort the analytic predictions per regime (module docstring), seeded")
    ap.add_argument("--trial-noise", type=float, default=TRIAL_NOISE_SD, metavar="SD",
                    help=f"trial-to-trial spread of one configuration, log sd (default {TRIAL_NOISE_SD})")
    ap.add_argument("--first-sure", type=float, metavar="X",
                    help=f"chance to fit a first trial needs (default {search.FIRST_SURE_TO_FIT}; module docstring)")
    ap.add_argument("--slow-first", type=float, default=1.0, metavar="X",
                    help="the job's first trial runs X times slower (a cold start; default 1)")
    ap.add_argument("--reserve", type=int, metavar="N", help="trials kept for re-timing (default: the tuner's)")
    ap.add_argument("--retime", type=int, metavar="K", help="contenders a re-timing round takes (default: the tuner's)")
    ap.add_argument("--out", help="write every run's figures and the tables as JSON here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--quiet", action="store_true", help="no per-group progress on stderr")
    args = ap.parse_args(argv)
    try:
        if args.seeds < 1:
            raise SpecError(f"is {args.seeds}", field="--seeds", fix="give 1 or more")
        if args.budget < 1:
            raise SpecError(f"is {args.budget}", field="--budget", fix="give 1 or more")
        if args.first_sure is not None and not 0 <= args.first_sure <= 1:
            raise SpecError(f"is {args.first_sure}", field="--first-sure", fix="give a chance between 0 and 1")
        if not 0 < args.slow_first <= 10:
            raise SpecError(f"is {args.slow_first}", field="--slow-first", fix="give a factor above 0, e.g. 1.15")
        if not 0 <= args.trial_noise <= 1:
            raise SpecError(f"is {args.trial_noise}", field="--trial-noise",
                            fix="give a log sd between 0 and 1, e.g. 0.02 (a quiet GPU cluster) or 0.08")
        overrides = {name: getattr(args, name) for name in ("reserve", "retime") if getattr(args, name) is not None}
        for name, value in overrides.items():
            if value < 0:
                raise SpecError(f"is {value}", field=f"--{name}", fix="give 0 or more")
        if overrides.get("reserve", 0) >= args.budget:
            raise SpecError(f"is {overrides['reserve']} of a budget of {args.budget}", field="--reserve",
                            fix="keep fewer trials for re-timing than the budget")
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in METHODS]
        if unknown or not methods:
            raise SpecError(f"unknown method(s) {', '.join(unknown) or '(none)'}", field="--methods",
                            fix=f"use a subset of {','.join(METHODS)}")
        out_path = Path(args.out) if args.out else None
        if out_path is not None and not out_path.parent.is_dir():
            raise SpecError(f"folder {str(out_path.parent)!r} does not exist", field="--out",
                            fix="give a path in an existing folder")
        sources = args.source or DEFAULT_SOURCES
        directory = calibration_dir()
        start = time.perf_counter()
        groups = load_groups(directory or REPO, sources, args.group, args.distort)
        ReplayRunner.trial_noise_sd = args.trial_noise
        ReplayRunner.slow_first = args.slow_first
        TUNE_OVERRIDES.update(overrides)
        first_sure = search.FIRST_SURE_TO_FIT
        if args.first_sure is not None:
            search.FIRST_SURE_TO_FIT = args.first_sure
        try:
            runs = run_all(groups, args.seeds, args.budget, methods, not args.no_peak_memory, progress=not args.quiet)
            used_first_sure = search.FIRST_SURE_TO_FIT
        finally:
            ReplayRunner.trial_noise_sd = TRIAL_NOISE_SD
            ReplayRunner.slow_first = 1.0
            search.FIRST_SURE_TO_FIT = first_sure
            TUNE_OVERRIDES.clear()
    except PipetteError as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    result = tables(runs, args.budget)
    print(f"Replay on real measurements: {len(groups)} groups, {args.seeds} seeds, budget {args.budget} trials"
          + (f", analytic prior distorted (seed {args.distort})" if args.distort is not None else "")
          + (f", trial noise {args.trial_noise:g}" if args.trial_noise != TRIAL_NOISE_SD else "")
          + "".join(f", {k} {v}" for k, v in overrides.items())
          + (f", the first trial {args.slow_first:g}x slow" if args.slow_first != 1.0 else "")
          + (f", first trials need {used_first_sure:g} sure to fit" if args.first_sure is not None else "")
          + f" ({time.perf_counter() - start:.0f} s)")
    for scope, table in result.items():
        n = len({r.group for r in runs if scope == "overall" or r.source == scope})
        print_table(f"{scope} ({n} groups)", table, args.budget)
    main_scope = next(iter(result))
    lines = verdict(result[main_scope], args.budget) if "tuner" in result[main_scope] else []
    if lines:
        print(f"\ntargets ({main_scope}):")
        for line in lines:
            print("  " + line)
        for scope in SOURCES:
            if scope != main_scope and scope in result and "tuner" in result[scope]:
                missed = [x for x in verdict(result[scope], args.budget) if x.startswith("MISSED")]
                print(f"targets ({scope}): " + ("all met" if not missed else f"{len(missed)} missed"))
    if out_path is not None:
        payload = {"budget": args.budget, "seeds": args.seeds, "within": WITHIN, "noise_sd": NOISE_SD,
                   "trial_noise_sd": args.trial_noise, "distort": args.distort, "first_sure": used_first_sure,
                   "slow_first": args.slow_first, "tune_overrides": overrides,
                   "steps": STEPS, "oom_fraction": OOM_FRACTION, "peak_memory": not args.no_peak_memory,
                   "tables": result, "targets": lines, "runs": [r.to_dict() for r in runs]}
        out_path.write_text(json.dumps(payload, indent=1))
        print(f"wrote {out_path}")
    missed_any = any(line.startswith("MISSED") for line in lines)
    return 1 if args.check and missed_any else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Group", "ReplayRunner", "Trace", "load_groups", "main", "run_all", "tables"]
