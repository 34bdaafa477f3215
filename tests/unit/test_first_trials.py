"""The first trials of a job (issue 46, "First trials that run"): a crash is retried later, not at
once; an out-of-memory layout is never retried unchanged; until a trial has run, the search
proposes the fastest candidate among those sure to fit (``pipette.search.FIRST_SURE_TO_FIT``).

Trials come from the ``World`` of tests/unit/test_tuner.py (the analytic estimate times a hidden
factor), on its plan: Llama-2 7B LoRA on 8 A100 40GB, whose analytic top six are 71-74% sure to fit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pipette import search
from pipette.config import ParallelConfig
from pipette.fits import PIPETTE_GPU
from pipette.measurement import Measurement
from pipette.plan import Plan, Planned
from pipette.retry import RETRY, RETRY_LATER, crash_kind, retry_chance
from pipette.tuner import OnStep, TrialRecord, TuneOptions, Tuner
from tests.unit.test_tuner import World, first_proposed, plan  # noqa: F401  # its plan fixture, shared


def _first(plan: Plan) -> str:  # noqa: F811
    return first_proposed(plan).config.label


def test_a_crash_is_retried_after_another_candidate_ran_not_at_once(plan: Plan) -> None:  # noqa: F811
    first = _first(plan)
    world = World(plan, fail_first={first})  # its first try crashes (the machine's fault), then it runs
    result = Tuner(plan, TuneOptions(max_trials=4, stop_probability=0.0, retime=0)).run(world)
    # before issue 46 the crash was retried at once: calls [first, first, ...]
    assert world.calls[0] == first and world.calls[1] != first, world.calls
    statuses = [(t.label, t.measurement.status, t.purpose) for t in result.trials]
    assert statuses[1][1] == "ok"
    retry = next(i for i, t in enumerate(result.trials) if t.label == first and t.purpose == RETRY)
    assert retry >= 2 and result.trials[retry].measurement.status == "ok", statuses
    assert result.trials[retry].number == retry and result.trials[retry].attempt == 1  # a trial of its own
    assert RETRY_LATER in result.trials[0].measurement.extra
    assert [t.label for t in result.trials].count(first) == 2  # retried once (retries=1)


def test_a_pending_retry_survives_a_resume(plan: Plan) -> None:  # noqa: F811
    first = _first(plan)
    world = World(plan, fail_first={first})
    tuner = Tuner(plan, TuneOptions(max_trials=6, stop_probability=0.0, retime=0))
    tuner.step(world)
    tuner.step(world)
    assert [t.measurement.status for t in tuner.records] == ["failed", "ok"]
    # the records are the state: a tuner rebuilt from them retries the crash next
    resumed = Tuner(plan, TuneOptions(max_trials=6, stop_probability=0.0, retime=0), history=tuner.records)
    resumed.step(world)
    last = resumed.records[-1]
    assert (last.label, last.purpose, last.measurement.status) == (first, RETRY, "ok")


def test_a_retry_that_crashed_again_counts_against_its_kind() -> None:
    config = ParallelConfig(1, 1, 8, 1, 8, 0)
    other = ParallelConfig(2, 1, 4, 1, 8, 0)
    from pipette.estimates import MemoryEstimate, PerfEstimate

    perf = PerfEstimate(step_time=1.0, breakdown={}, tokens_per_s=1.0, mfu=0.1, hfu=0.1)
    memory = MemoryEstimate(peak_bytes=1, capacity_bytes=2, breakdown={})
    crash = Measurement("failed", error="RuntimeError: CUDA error: rank 3", extra={RETRY_LATER: "later"})
    ran = Measurement("ok", (1.0,), 1)

    def rec(n: int, c: ParallelConfig, m: Measurement, purpose: str = "search") -> TrialRecord:
        return TrialRecord(n, c, m, perf, memory, 1.0, purpose=purpose)

    kind = crash_kind(crash)
    # a deferred retry is the next trial of its candidate, with another candidate's trial between
    assert retry_chance([rec(0, config, crash), rec(1, other, ran), rec(2, config, crash, RETRY)], kind) == (
        pytest.approx(1 / 3))
    assert retry_chance([rec(0, config, crash), rec(1, other, ran), rec(2, config, ran, RETRY)], kind) == (
        pytest.approx(2 / 3))
    # the other candidate's ok trial is not a retry of the crash
    assert retry_chance([rec(0, config, crash), rec(1, other, ran)], kind) == 0.5


def test_an_out_of_memory_trial_is_never_retried(plan: Plan) -> None:  # noqa: F811
    first = _first(plan)
    world = World(plan)

    def runner(config: ParallelConfig, on_step: OnStep) -> Measurement:
        if config.label == first:
            world.calls.append(config.label)
            return Measurement("oom", tokens_per_step=1, error="rank 0 ran out of memory")
        return world(config, on_step)

    result = Tuner(plan, TuneOptions(max_trials=6, stop_probability=0.0, retime=0, retries=3)).run(runner)
    assert world.calls.count(first) == 1, world.calls
    assert RETRY_LATER not in result.trials[0].measurement.extra


def _risky_top(plan: Plan, chance: float) -> Plan:  # noqa: F811
    """The plan with its sure-to-fit top-1 made the fastest by far and ``chance`` sure to fit (its
    estimated peak moved next to the capacity), ranked first by the expected step time."""
    sure = next(p for p in plan.ranked if p.chance_to_fit >= 0.99)
    capacity = sure.memory.capacity_bytes
    peak = int(capacity * math.exp(-(PIPETTE_GPU.mu + PIPETTE_GPU.sd * _z(chance))))
    risky = replace(sure, memory=replace(sure.memory, peak_bytes=peak), chance_to_fit=chance,
                    perf=replace(sure.perf, step_time=sure.perf.step_time * 0.7),
                    expected_step_time=plan.ranked[0].expected_step_time * 0.8)
    rest = [p for p in plan.ranked if p.config.label != sure.config.label]
    return replace(plan, ranked=[risky, *rest])


def _z(p: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(p))


def test_the_first_trial_is_the_fastest_sure_to_fit(plan: Plan, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    risky_plan = _risky_top(plan, 0.6)
    risky: Planned = risky_plan.ranked[0]
    ranked = Tuner(risky_plan, TuneOptions(max_trials=4)).ranking()
    mine = next(s for s in ranked if s.planned.config.label == risky.config.label)
    assert mine.p_fit == pytest.approx(0.6, abs=0.02)  # the plan's chance, before any trial
    first = ranked[0].planned
    # the fastest by expected step time among those at least FIRST_SURE_TO_FIT sure
    sure = [p for p in risky_plan.ranked if p.chance_to_fit >= search.FIRST_SURE_TO_FIT]
    assert first.config.label != risky.config.label
    assert first.config.label == min(sure, key=lambda p: (p.expected_step_time, p.config.label)).config.label
    world = World(risky_plan)
    Tuner(risky_plan, TuneOptions(max_trials=1, stop_probability=0.0)).run(world)
    assert world.calls == [first.config.label]
    # before issue 46 (no threshold): the risky candidate went first
    monkeypatch.setattr(search, "FIRST_SURE_TO_FIT", 0.0)
    assert Tuner(risky_plan, TuneOptions(max_trials=4)).ranking()[0].planned.config.label == risky.config.label


def test_once_a_trial_ran_the_expected_improvement_decides_again(plan: Plan) -> None:  # noqa: F811
    risky_plan = _risky_top(plan, 0.6)
    tuner = Tuner(risky_plan, TuneOptions(max_trials=6, stop_probability=0.0, retime=0))
    tuner.step(World(risky_plan))
    assert tuner.best is not None
    ranked = tuner.ranking()
    # the order is the constrained EI's: a candidate below the threshold may lead now
    assert [s.expected_improvement for s in ranked] == sorted((s.expected_improvement for s in ranked),
                                                              reverse=True)


def test_a_pending_retry_of_a_candidate_the_plan_lost_is_dropped(plan: Plan) -> None:  # noqa: F811
    """A resumed job's crash may name a candidate this plan no longer holds (another recipe's
    micro-batch): its retry is not due, and the search goes on without it."""
    p = first_proposed(plan)
    labels = {c.config.label for c in plan.ranked}
    gone = next(c for c in (replace(p.config, mbs=m) for m in (16, 8, 4, 1) if 32 % (p.config.dp * m) == 0)
                if c.label not in labels)
    crash = Measurement("failed", error="rank 1 exited with status 1", extra={RETRY_LATER: "later"})
    ran = Measurement("ok", (1.0, 1.0), plan.training.tokens_per_step)
    other = plan.ranked[-1]
    history = [TrialRecord(0, gone, crash, p.perf, p.memory, 1.0),
               TrialRecord(1, other.config, ran, other.perf, other.memory, 1.0)]
    tuner = Tuner(plan, TuneOptions(max_trials=4, stop_probability=0.0, retime=0), history=history)
    world = World(plan)
    tuner.step(world)
    assert world.calls and world.calls[0] != gone.label and tuner.records[-1].purpose == "search"
