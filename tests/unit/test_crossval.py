"""The cross-validation harness (tests/benchmarks/crossval.py, issue 45) never scores a row with a fit
that saw it: each fold's fit is handed only the other jobs' rows, and every scored prediction comes
from that fold's own fitted vector."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from tests.benchmarks.crossval import Problem, Sample, crossval, fit_least_squares, split
from tests.benchmarks.crossval_problems import fsdp_problem, megatron_problem, pipette_problem


def _recording(calls: list[list[str]]):  # type: ignore[no-untyped-def]
    def fit(samples: Sequence[Sample], problem: Problem) -> np.ndarray:
        calls.append([s.id for s in samples])
        # a distinct vector per fold, so a prediction can be traced to the fold that made it
        return np.array([p.start for p in problem.params]) * (1.0 + 0.01 * len(calls))
    return fit


@pytest.mark.parametrize("make", [pipette_problem, fsdp_problem])
def test_no_fold_fits_a_row_it_scores_and_every_row_is_scored_once(make) -> None:  # type: ignore[no-untyped-def]
    problem = make()
    calls: list[list[str]] = []
    result = crossval(problem, fit=_recording(calls))
    assert len(calls) == len(result.folds) > 1
    job = {s.id: problem.job(s) for s in problem.samples}
    for seen, fold in zip(calls, result.folds, strict=True):
        assert set(seen) == fold.fitted and not set(seen) & fold.held_out
        assert not {job[i] for i in seen} & {job[i] for i in fold.held_out}  # whole jobs held out
        for i, s in enumerate(problem.samples):
            if s.id in fold.held_out:  # the score is this fold's prediction, not another's
                assert result.predicted[i] == pytest.approx(problem.predict(fold.x, s.row))
    held = [i for f in result.folds for i in f.held_out]
    assert sorted(held) == sorted(s.id for s in problem.samples) and not np.isnan(result.predicted).any()


def test_k_folds_hold_out_whole_jobs_and_fit_only_healthy_capped_rows() -> None:
    problem = megatron_problem()
    folds = split(problem)
    assert len(folds) == problem.folds
    jobs = [{problem.job(problem.samples[i]) for i in f} for f in folds]
    assert all(not a & b for k, a in enumerate(jobs) for b in jobs[k + 1:])
    calls: list[list[str]] = []
    fast = Problem(problem.name, problem.samples, problem.params, lambda x, row: 1.0, problem.job,
                   problem.fit_filter, problem.folds, problem.fit_cap)
    result = crossval(fast, fit=_recording(calls))
    by_id = {s.id: s for s in problem.samples}
    for seen, fold in zip(calls, result.folds, strict=True):
        assert 0 < len(seen) <= problem.fit_cap and not set(seen) & fold.held_out
        assert all(problem.fit_filter(by_id[i]) for i in seen)


def test_a_fit_starts_from_the_neutral_start_not_the_shipped_constants() -> None:
    problem = pipette_problem()
    x = fit_least_squares(problem.samples[:4], problem)
    assert x.shape == (len(problem.params),)
    assert [p.start for p in problem.params] == [20.0, 5.0, 2e-4]  # not HF_DEEPSPEED_CONSTANTS' 71.4, 13.4, 8.64e-4


def test_the_accuracy_report_prints_cross_validated_step_verdicts_and_labels_the_rest(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.benchmarks.calibration import calibration_dir
    from tests.benchmarks.stack_accuracy import report

    report(calibration_dir(), ["pipette"])
    out = capsys.readouterr().out
    step, memory = out.split("memory and the plan's drops")
    assert "cross-validated step time" in step
    assert "| h100_single_gpu | pipette | pipette (leave-one-job-out, 3)" in step
    assert "in-sample" in step.splitlines()[0] and "in-sample" in memory.splitlines()[0]
    assert "step MAPE" not in memory and "before: pipette" not in out  # no step verdict on fitted rows


def test_the_per_stack_verdict_pools_shipped_fits_once_and_counts_jobs_against_the_targets() -> None:
    from dataclasses import replace

    from tests.benchmarks.crossval import Result, stack_lines

    problem = pipette_problem()
    meas = np.array([s.measured for s in problem.samples])
    exact = Result(problem, meas.copy())
    # the same rows from an alternative fit (left out, though first) and again 10% slow from a second
    # shipped fit (a row counts once: the first shipped fit's)
    again = Result(replace(problem, name="again"), meas * 1.1)
    other = Result(replace(problem, name="other", alternative=True), meas * 2.0)
    (line,) = stack_lines([other, exact, again])
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[0] == "pipette" and cells[1] == "h100_single_gpu" and cells[2] == str(len(problem.samples))
    assert cells[3] == "0.0%"  # the first problem's predictions, exact; not the 10% or 100% copies
    jobs = cells[5].split("(")[1].split(")")[0]
    assert cells[5].endswith(f"{jobs} of {jobs}")  # every job's pick is the measured best: regret 1.000

    # other rows under the same harness ids (Megatron-Bridge's MoE and dense problems number theirs alike)
    distinct = replace(problem, name="distinct", samples=tuple(
        Sample(s.id, s.set, replace(s.row, row_id=f"other-{k}")) for k, s in enumerate(problem.samples)))
    (line,) = stack_lines([exact, Result(distinct, meas.copy())])
    assert line.split("|")[3].strip() == str(2 * len(problem.samples))

    slow_best = meas.copy()
    slow_best[int(np.argmin(meas))] *= 10.0  # the best row predicted slowest: its job misses the regret target
    (line,) = stack_lines([Result(problem, slow_best)])
    cells = [c.strip() for c in line.strip("|").split("|")]
    met, total = cells[5].rsplit("; ", 1)[1].split(" of ")
    assert int(met) == int(total) - 1 and float(cells[5].split(" / ")[1].split(" ")[0]) > 1.03
