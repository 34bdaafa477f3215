"""cp and ep as degrees of the search (issues 47, 48): every candidate of a space that splits
sequences or experts is its own point of the study, the sampler proposes them, a cp = 2 trial
teaches its cp = 2 neighbours (``pipette.learned``, ``pipette.feasibility``: log2 cp and log2 ep
as features, cp and ep as regimes where the space has them), and a job without cp or ep keeps
its kernels to the bit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pipette import gp
from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.feasibility import RunsModel, degree_array, near, needs_at_least
from pipette.learned import LearnedModel, Observation, split_degrees
from pipette.measurement import Measurement
from pipette.model import ModelSpec
from pipette.plan import Plan, Planned, make_plan
from pipette.search import PerfModelSampler, candidate_params, new_study, params_key, search_space
from pipette.training import TrainingSpec
from pipette.tuner import StepProgress, TuneOptions, Tuner

ROOT = Path(__file__).resolve().parents[2]
CPU4 = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
#: 4096 tokens on a 2-layer Llama of hidden 64 (tests/integration/test_fsdp_trials.py's): s >= 4h,
#: so the fsdp stack offers cp 2 and 4 on the 4 CPU devices (``pipette.space.cp_degrees``)
LONG = ModelSpec(name="tiny-long", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                 max_seq=4096, tied_embeddings=False, arch="llama")


@pytest.fixture(scope="module")
def cp_plan() -> Plan:
    return make_plan(LONG, TrainingSpec(global_batch=8, seq_len=4096, dtype="fp32"), CPU4, stack="fsdp")


@pytest.fixture(scope="module")
def moe_plan() -> Plan:
    return make_plan(ModelSpec.preset("tiny-moe"), TrainingSpec(global_batch=16, seq_len=128, dtype="fp32"), CPU4,
                     stack="fsdp")


def _find(plan: Plan, label: str) -> Planned:
    return next(p for p in plan.ranked if p.config.label == label)


def _observe(plan: Plan, p: Planned, factor: float) -> Observation:
    """An ok trial that ran ``factor`` x its analytic step time."""
    t = factor * p.perf.step_time
    m = Measurement("ok", (t, 1.01 * t, 0.99 * t, t), plan.training.tokens_per_step)
    return Observation(p.config, p.perf, p.memory, m)


def test_every_cp_and_ep_candidate_is_its_own_point_of_the_search(cp_plan: Plan, moe_plan: Plan) -> None:
    for plan, degree in ((cp_plan, "cp"), (moe_plan, "ep")):
        keys = {params_key(candidate_params(p.config)) for p in plan.ranked}
        assert len(keys) == len(plan.ranked)
        assert list(search_space(plan.ranked)[degree].choices) == [1, 2, 4]  # type: ignore[attr-defined]
    # ep is carved out of dp: twins that differ in ep alone were one key before ep was a parameter
    first = next(p for p in moe_plan.ranked if p.config.ep == 2).config.label
    twins = [p for p in moe_plan.ranked if p.config.label.replace("-ep2", "") == first.replace("-ep2", "")]
    assert {p.config.ep for p in twins} == {1, 2}


def test_the_sampler_proposes_cp_candidates(cp_plan: Plan) -> None:
    """With nothing measured the plan's order proposes (fastest first, ties by label): cp 1, 2 and
    4 tie at dp x cp = 4 here, and the first by label is cp 4; the trial's parameters say so."""
    sampler = PerfModelSampler(cp_plan.ranked)
    study = new_study(sampler)
    trial = study.ask(fixed_distributions=sampler.space)
    proposed = sampler.by_key[params_key(trial.params)]
    assert trial.params["cp"] == proposed.config.cp == 4 and proposed.config.label.startswith("tp1-pp1-dp1-cp4")


def test_each_ep_twin_is_tried(moe_plan: Plan) -> None:
    """Two candidates that differ in ep alone, both runnable: the tuner tries both (one key for
    the two, it could try one only)."""
    first = next(p for p in moe_plan.ranked if p.config.ep == 2).config.label
    twins = {first, first.replace("-ep2", "")}
    assert twins <= {p.config.label for p in moe_plan.ranked}
    calls: list[ParallelConfig] = []

    def runner(config: ParallelConfig, on_step: object) -> Measurement:
        calls.append(config)
        # the ep-2 twin measures faster whatever the model predicts for either
        t = min(_find(moe_plan, label).perf.step_time for label in twins) * (1.0 if config.ep == 2 else 1.5)
        for i in range(3):
            on_step(StepProgress(i, t, False))  # type: ignore[operator]
        return Measurement("ok", (t,) * 3, moe_plan.training.tokens_per_step)

    options = TuneOptions(max_trials=2, retime=0)
    result = Tuner(moe_plan, options, runnable=lambda c: [] if c.label in twins else ["not this test's"]).run(runner)
    assert {c.label for c in calls} == twins
    assert result.best is not None and result.best.config.ep == 2


def test_a_model_that_saw_cp2_predicts_a_cp2_neighbour_better(cp_plan: Plan) -> None:
    """cp = 2 runs 2x its analytic time, cp = 1 as predicted. One slow cp = 2 trial among three
    cp = 1 ones moves an untried cp = 2 layout (another pp and dp) most of the way, and not its
    cp = 1 twin at that pp; a model that saw a fourth cp = 1 trial instead stays at the analytic
    prediction. Before cp was a feature and a regime, the cp = 2 trial was an odd run slower than
    its row and column, discounted: its neighbour moved 0.002 of the 0.69."""
    rest = [_find(cp_plan, f"{layout}-mbs1-z0-rc:none-1f1b") for layout in ("tp1-pp1-dp4", "tp2-pp1-dp2",
                                                                             "tp1-pp2-dp2")]
    space = [p.config for p in cp_plan.ranked]
    saw = LearnedModel([*(_observe(cp_plan, p, 1.0) for p in rest),
                        _observe(cp_plan, _find(cp_plan, "tp1-pp1-dp2-cp2-mbs1-z0-rc:none-1f1b"), 2.0)], space=space)
    did_not = LearnedModel([*(_observe(cp_plan, p, 1.0) for p in rest),
                            _observe(cp_plan, _find(cp_plan, "tp1-pp1-dp4-mbs2-z0-rc:none-1f1b"), 1.0)], space=space)
    neighbour = _find(cp_plan, "tp1-pp2-dp1-cp2-mbs1-z0-rc:none-1f1b")
    twin = _find(cp_plan, "tp1-pp2-dp2-mbs2-z0-rc:none-1f1b")
    truth = math.log(2.0)
    error_saw = abs(saw.predict(neighbour.config, neighbour.perf).mean - truth)
    error_not = abs(did_not.predict(neighbour.config, neighbour.perf).mean - truth)
    assert error_saw < 0.5 * error_not
    assert abs(saw.predict(twin.config, twin.perf).mean) < 0.1
    assert saw.split == ("cp",) and LearnedModel(space=[p.config for p in cp_plan.ranked[:0]]).split == ()


def test_a_job_without_cp_or_ep_keeps_its_kernels_to_the_bit() -> None:
    """The degrees enter as a factor of the RBF, exactly 1 where cp = ep = 1 (appending two zero
    columns to 15 features changes numpy's pairwise sum in the last bits)."""
    rng = np.random.default_rng(0)
    xa, xb = rng.normal(size=(9, 15)), rng.normal(size=(7, 15))
    dense = [ParallelConfig(1, 1, 4, 1, 8)] * 9
    assert np.array_equal(near(xa, degree_array(dense), xb, degree_array(dense[:7]), 1.5), gp.rbf(xa, xb, 1.5))
    regimes = rng.integers(0, 3, size=(9, 4))
    plain = gp.KernelInputs(xa, regimes, [True] * 9, [""] * 9)
    with_degrees = gp.KernelInputs(xa, regimes, [True] * 9, [""] * 9, degree_array(dense))
    assert np.array_equal(gp.step_time_kernel(with_degrees, with_degrees, 0.3, 1.5, 1.0),
                          gp.step_time_kernel(plain, plain, 0.3, 1.5, 1.0))
    assert split_degrees(dense) == ()
    # a trial's parameters from before cp and ep were parameters name the same candidate
    params = candidate_params(dense[0])
    assert params["cp"] == params["ep"] == 1 and params["variant"] == ""
    old = {k: v for k, v in params.items() if k not in ("cp", "ep")}
    assert params_key(old) == params_key(params)


def test_feasibility_keeps_cp_and_ep_apart() -> None:
    """An out-of-memory trial rules out what needs at least as much at its cp and ep only, and a
    crash at cp 2 counts less for the cp 1 twin of its neighbourhood."""
    oom = ParallelConfig(1, 1, 2, 1, 8, cp=2)
    assert needs_at_least(ParallelConfig(1, 1, 2, 2, 8, cp=2), oom)
    assert not needs_at_least(ParallelConfig(1, 1, 2, 2, 8), oom)
    assert not needs_at_least(ParallelConfig(1, 1, 4, 2, 8, cp=2, ep=2), ParallelConfig(1, 1, 4, 1, 8, cp=2))
    crashed = Measurement("failed", error="rank 1 exited with status 1")
    runs = RunsModel([(oom, crashed, 1), (ParallelConfig(1, 2, 2, 1, 8), Measurement("ok", (1.0,), 1), 1)])
    same_cp, other_cp = runs.p_runs([ParallelConfig(1, 1, 2, 2, 8, cp=2), ParallelConfig(1, 1, 2, 2, 8)])
    assert same_cp < other_cp
