"""The replay benchmark (tests/benchmarks/replay.py) on one small group with one seed, so
the harness cannot rot: every method runs, the figures agree with the trials, the tuner
only tries measured candidates, and bad flags are refused with the flag named.

Runs on the calibration data the repo carries (``data/calibration``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipette import search  # noqa: E402
from tests.benchmarks import replay  # noqa: E402
from tests.benchmarks.calibration import calibration_dir  # noqa: E402

pytestmark = pytest.mark.timeout(120)

#: Llama 3.1-8B shape on one node of 8 H100: 60 measured rows, 47 of them failed.
GROUP = "8B/1"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("replay") / "replay.json"
    rc = replay.main(["--source", "ultrascale", "--group", GROUP, "--seeds", "1", "--budget", "12",
                      "--out", str(out), "--quiet"])
    assert rc == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


@pytest.fixture(scope="module")
def group() -> replay.Group:
    directory = calibration_dir()
    return replay.load_groups(directory, ["ultrascale"], GROUP)[0]


def test_every_method_ran_within_its_budget(result: dict[str, Any]) -> None:
    runs = result["runs"]
    assert sorted(r["method"] for r in runs) == sorted(replay.METHODS)
    for r in runs:
        assert 1 <= r["attempts"] <= 12
        assert len(r["trials"]) == r["attempts"]
    table = result["tables"]["ultrascale"]
    assert set(table) == set(replay.METHODS)
    assert {"ran_early_pct", "regret@3_median"} <= set(table["tuner"]) and "regret_at_stop_median" in table["tuner"]
    assert any(line.startswith(("MET", "MISSED")) for line in result["targets"])


def test_figures_agree_with_the_trials(result: dict[str, Any], group: replay.Group) -> None:
    by_label = {c.label: group.truths[k] for k, c in group.configs.items()}
    for r in result["runs"]:
        statuses = [s for _, s in r["trials"]]
        assert r["failed"] == sum(s in ("oom", "failed") for s in statuses)
        assert r["oom"] == statuses.count("oom")
        for label, status in r["trials"]:
            truth = by_label[label]  # only measured configurations are ever tried
            assert status in (truth.status, "pruned")
        assert r["ran_early"] == ("ok" in statuses[:replay.FIRST])
        regrets = [r["regret"][str(k)] for k in replay.REGRET_AT]
        assert regrets == sorted(regrets, reverse=True)  # more trials never lose what was found
        ok_times = [by_label[lab].step_time for lab, s in r["trials"] if s == "ok"]
        if r["found_at"] is not None:
            label, status = r["trials"][r["found_at"] - 1]
            found = by_label[label].step_time
            assert status == "ok" and found is not None and found <= group.best * 1.02
        else:
            assert not any(t is not None and t <= group.best * 1.02 for t in ok_times)


def test_baselines_follow_their_orders(result: dict[str, Any], group: replay.Group) -> None:
    runs = {r["method"]: r for r in result["runs"]}
    # the analytic order is the plan's rank order over the measured candidates
    measured_in_plan = [p.config.label for p in group.plan.ranked if replay.key_of(p.config) in group.truths]
    assert [lab for lab, _ in runs["analytic"]["trials"]] == measured_in_plan[:12]
    # the grid goes ZeRO stage upward
    zeros = [group.configs[_key(group, lab)].zero_stage for lab, _ in runs["grid"]["trials"]]
    assert zeros == sorted(zeros)
    for method in ("random", "tpe", "grid", "analytic"):
        labels = [lab for lab, _ in runs[method]["trials"]]
        assert len(labels) == len(set(labels)), method  # no configuration twice


def test_the_tuner_starts_from_the_fastest_sure_to_fit(result: dict[str, Any], group: replay.Group) -> None:
    runs = {r["method"]: r for r in result["runs"]}
    # the analytic order's first candidate at least FIRST_SURE_TO_FIT sure to fit (issue 46)
    chance = {p.config.label: p.chance_to_fit for p in group.plan.ranked}
    sure = [lab for lab, _ in runs["analytic"]["trials"] if chance[lab] >= search.FIRST_SURE_TO_FIT]
    assert runs["tuner"]["trials"][0][0] == sure[0]
    # a failed (not out-of-memory) trial is retried once, later (not at once); nothing else twice
    labels = [lab for lab, _ in runs["tuner"]["trials"]]
    for lab in set(labels):
        statuses = [s for la, s in runs["tuner"]["trials"] if la == lab]
        assert len(statuses) == 1 or statuses == ["failed", "failed"], (lab, statuses)
        at = [i for i, la in enumerate(labels) if la == lab]
        assert len(at) == 1 or at[1] > at[0] + 1, (lab, at)  # another trial ran between


def test_the_replayed_trial_is_the_measured_one(group: replay.Group) -> None:
    ok = next(k for k, t in group.truths.items() if t.status == "ok")
    trace = replay.Trace("check")
    m = replay.ReplayRunner(group, 0, trace).replay(ok)
    truth = group.truths[ok]
    assert m.status == "ok" and len(m.step_times) == replay.STEPS
    assert m.step_time is not None and truth.step_time is not None
    assert math.isclose(m.step_time, truth.step_time, rel_tol=4 * (replay.NOISE_SD + replay.TRIAL_NOISE_SD))
    again = replay.ReplayRunner(group, 0, replay.Trace("again")).replay(ok)
    assert again.step_times == m.step_times  # deterministic per seed
    runner = replay.ReplayRunner(group, 0, replay.Trace("twice"))
    first, second = runner.replay(ok), runner.replay(ok)
    assert first.step_times == m.step_times and second.step_times != first.step_times  # a fresh trial, fresh noise
    bad = next(k for k, t in group.truths.items() if t.status != "ok")
    assert replay.ReplayRunner(group, 0, trace).replay(bad).status == group.truths[bad].status


def test_a_cold_start_slows_the_job_s_first_trial_only(group: replay.Group) -> None:
    """``--slow-first``: the job's first trial (of any candidate) runs that much slower, no later one."""
    ok = next(k for k, t in group.truths.items() if t.status == "ok")
    warm = replay.ReplayRunner(group, 0, replay.Trace("warm"))
    plain = [warm.replay(ok).step_time for _ in range(2)]
    try:
        replay.ReplayRunner.slow_first = 1.15
        cold = replay.ReplayRunner(group, 0, replay.Trace("cold"))
        slowed = [cold.replay(ok).step_time for _ in range(2)]
    finally:
        replay.ReplayRunner.slow_first = 1.0
    assert None not in plain and None not in slowed
    assert math.isclose(slowed[0] / plain[0], 1.15, rel_tol=1e-9) and slowed[1] == plain[1]


def test_the_trial_noise_flag_sets_the_spread_between_trials(group: replay.Group) -> None:
    ok = next(k for k, t in group.truths.items() if t.status == "ok")
    quiet = replay.ReplayRunner(group, 0, replay.Trace("quiet")).replay(ok)
    try:
        replay.ReplayRunner.trial_noise_sd = 0.2
        loud = replay.ReplayRunner(group, 0, replay.Trace("loud")).replay(ok)
    finally:
        replay.ReplayRunner.trial_noise_sd = replay.TRIAL_NOISE_SD
    truth = group.truths[ok].step_time
    assert quiet.step_time is not None and loud.step_time is not None and truth is not None
    # the same draw, ten times the spread: the trial's level moves ten times as far (in logs)
    assert math.isclose(math.log(loud.step_time / truth), 10 * math.log(quiet.step_time / truth), rel_tol=0.1,
                        abs_tol=0.02)
    assert abs(math.log(loud.step_time / truth)) > 0.05


def test_the_tuner_stops_with_a_pick_and_a_confidence(result: dict[str, Any]) -> None:
    tuner = next(r for r in result["runs"] if r["method"] == "tuner")
    assert tuner["would_stop"] is not None and tuner["regret_at_stop"] is not None
    assert tuner["confidence"] is not None and 0.0 <= tuner["confidence"] <= 1.0
    assert {"residual_sd", "length_scale", "regime_sd", "hyper_settings", "trial_noise_sd"} <= set(tuner["learned"])
    # against every candidate it can only be less sure than against those it tried
    assert tuner["confidence_overall"] is not None and 0.0 <= tuner["confidence_overall"] <= tuner["confidence"]


def test_the_distorted_prior_moves_predictions_not_truths(group: replay.Group) -> None:
    directory = calibration_dir()
    bent = replay.load_groups(directory, ["ultrascale"], GROUP, distort=1)[0]
    assert bent.truths == group.truths
    before = {p.config.label: p.perf.step_time for p in group.plan.ranked}
    ratios = [p.perf.step_time / before[p.config.label] for p in bent.plan.ranked]
    assert all(1 / replay.DISTORT_MAX - 1e-9 <= r <= replay.DISTORT_MAX + 1e-9 for r in ratios)
    assert max(ratios) / min(ratios) > 1.5  # regimes move apart, not just a common factor
    steps = [p.perf.step_time for p in bent.plan.ranked]
    assert steps == sorted(steps)  # re-ranked by the distorted prediction
    again = replay.load_groups(directory, ["ultrascale"], GROUP, distort=1)[0]
    assert [p.config.label for p in again.plan.ranked] == [p.config.label for p in bent.plan.ranked]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--methods", "tuner,bogus"], "--methods"), (["--seeds", "0"], "--seeds"),
     (["--group", "9B/1"], "--group"), (["--out", "/nonexistent/dir/x.json"], "--out"),
     (["--trial-noise", "-0.1"], "--trial-noise"), (["--trial-noise", "2"], "--trial-noise"),
     (["--reserve", "-1"], "--reserve"), (["--retime", "-2"], "--retime"),
     (["--budget", "4", "--reserve", "4"], "--reserve"), (["--slow-first", "0"], "--slow-first")],
)
def test_bad_flags_name_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay.main(["--source", "ultrascale", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert flag in err


def test_a_job_s_own_reserve_and_round_size_are_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``--reserve``/``--retime``: CI's shaped-cluster job keeps 4 of 8 trials in rounds of 2."""
    seen: list[tuple[int | None, int]] = []
    real = replay.Tuner

    def tuner(plan: Any, options: Any, **kw: Any) -> Any:
        seen.append((options.reserve, options.retime))
        return real(plan, options, **kw)

    monkeypatch.setattr(replay, "Tuner", tuner)
    argv = ["--source", "cpu-both", "--budget", "8", "--seeds", "1", "--methods", "tuner", "--quiet"]
    assert replay.main([*argv, "--reserve", "3", "--retime", "2", "--out", str(tmp_path / "r.json")]) == 0
    assert "reserve 3, retime 2" in capsys.readouterr().out
    # the search runs with re-timing off (its curve), the fork that stops re-times with the job's options
    assert seen and set(seen) == {(3, 0), (3, 2)}, seen
    assert not replay.TUNE_OVERRIDES  # a later run in the same process gets the tuner's own
    seen.clear()
    assert replay.main(argv) == 0
    assert {reserve for reserve, _ in seen} == {None}


def _key(group: replay.Group, label: str) -> tuple[Any, ...]:
    return next(k for k, c in group.configs.items() if c.label == label)


def test_the_recorded_cpu_run_over_both_families_replays_every_candidate() -> None:
    """``--source cpu-both``: the plan over both stacks holds every measured candidate of the
    recorded exhaustive run, each priced with its stack's CPU constants, each replayed with its median."""
    recorded = replay.build_recorded_group()
    assert len(recorded.truths) == 99 and recorded.source == "cpu-both"
    planned = {replay.key_of(p.config): p for p in recorded.plan.ranked}
    assert set(recorded.truths) <= set(planned)
    assert {p.config.stack for p in planned.values()} == {"pipette", "fsdp"}
    best = min(recorded.truths, key=lambda k: recorded.truths[k].step_time or math.inf)
    assert recorded.configs[best].label == "tp1-pp2-dp2-mbs4-z1-rc:none-1f1b-pipette"
    m = replay.ReplayRunner(recorded, 0, replay.Trace("t")).replay(best)
    assert m.status == "ok" and abs(m.step_time / recorded.truths[best].step_time - 1) < 0.3
