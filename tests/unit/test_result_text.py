"""What a tuning result says (issue 32, item 4): what happened to every trial, the two
confidences in words, the placement, memory like with like, the pick's mean, fp32 on CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipette.clusterfile import load_cluster
from pipette.measurement import Measurement
from pipette.model import ModelSpec
from pipette.plan import Plan, make_plan
from pipette.result_text import result_dict, summary_lines
from pipette.training import TrainingSpec
from pipette.tuner import TrialRecord, TuneOptions, Tuner, TuneResult, tensor_peak_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu_plan() -> Plan:
    training = TrainingSpec(global_batch=16, seq_len=128, dtype="fp32", method="lora")
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    return make_plan(ModelSpec.preset("tiny-llama"), training, cluster)


def _run(plan: Plan, statuses: list[str], times: dict[int, float] | None = None) -> TuneResult:
    """A tuner over a runner that ends trial i with statuses[i] (ok: the time in ``times``)."""
    calls = iter(range(len(statuses)))

    def runner(config: object, on_step: object) -> Measurement:
        i = next(calls)
        status = statuses[i]
        if status == "ok":
            t = (times or {}).get(i, 1.0)
            return Measurement("ok", (t, t, t), plan.training.tokens_per_step, (40 * 2**20,) * 4)
        return Measurement(status, error=f"rank 0: {status}")  # type: ignore[arg-type]

    options = TuneOptions(max_trials=len(statuses), retries=0, retime=0, stop_probability=0.0)
    return Tuner(plan, options).run(runner)


def test_the_result_says_how_many_trials_timed_out_not_just_found_in_n(cpu_plan: Plan) -> None:
    """Was: "found in 7 trials of 40 candidates that fit" where 6 of the 7 timed out."""
    result = _run(cpu_plan, ["timeout"] * 3 + ["ok"] + ["timeout"] * 3)
    text = "\n".join(summary_lines(result))
    assert f"7 trials of {result.runnable} candidates runnable: 6 timed out, 1 ran ok" in text, text
    assert 0 < result.runnable <= len(cpu_plan.ranked)
    assert "--trial-timeout" in text
    assert result.to_dict()["outcomes"] == {"ok": 1, "timeout": 6}
    assert result_dict(result)["summary"] == summary_lines(result)  # what --json and a job's result say


def test_the_two_confidences_are_said_in_words_that_do_not_contradict(cpu_plan: Plan) -> None:
    """Was: "100% sure ... of the best candidate tried" above "0% sure ... of every candidate"."""
    result = _run(cpu_plan, ["ok", "ok"], {0: 1.0, 1: 2.0})
    lines = summary_lines(result)
    tried = next(x for x in lines if x.startswith("among the 2 candidates that ran ok"))
    assert "sure the pick is within 2% of the fastest" in tried
    untried = next(x for x in lines if "never tried, predicted by the learned model" in x)
    assert "a prediction, not a measurement" in untried
    assert not any("sure to be within 2% of every candidate" in x for x in lines)
    alone = summary_lines(_run(cpu_plan, ["ok"]))  # one candidate measured: nothing to be sure of among them
    assert any(x.startswith("only the pick ran ok: no measured candidate to compare it with") for x in alone), alone


def test_a_placement_permutation_is_explained(cpu_plan: Plan) -> None:
    from pipette.result_text import placement_line

    config = cpu_plan.best.config.with_placement([0, 2, 1, 3]) if cpu_plan.best.config.world == 4 else None
    if config is None:
        pytest.skip("the best candidate does not use 4 devices")
    line = placement_line(config)
    assert "rank i runs on device placement[i], here rank 0 on device 0, rank 1 on device 2, rank 2 on device 1, " \
           "rank 3 on device 3;" in line, line
    assert "launch.sh and rank_map.json keep this order" in line


def test_the_placement_sentence_names_every_rank(cpu_plan: Plan) -> None:
    """Issue 43, item 18: "here rank 0 on device 1, rank 1 on device 2, rank 2 on device 0;" for 4
    ranks: the last rank, which stayed on its own device, was left out."""
    from pipette.config import ParallelConfig
    from pipette.result_text import LISTED_RANKS, placement_line

    line = placement_line(cpu_plan.best.config.with_placement([1, 2, 0, 3]))
    assert "here rank 0 on device 1, rank 1 on device 2, rank 2 on device 0, rank 3 on device 3;" in line, line
    many = ParallelConfig(tp=2, pp=1, dp=8, mbs=1, global_batch=16, placement=tuple(reversed(range(16))))
    line = placement_line(many)
    assert f"rank {LISTED_RANKS - 1} on device {16 - LISTED_RANKS}, ... (all 16 in rank_map.json)" in line, line
    assert "(tp groups are 2 consecutive ranks)" in line


def _tuner_run(plan: Plan, times: dict[int, float], trials: int, stop: float) -> tuple[Tuner, TuneResult]:
    calls = iter(range(trials))

    def runner(config: object, on_step: object) -> Measurement:
        i = next(calls)
        t = times.get(i, 1.3 + 0.01 * i)
        return Measurement("ok", (t, t, t), plan.training.tokens_per_step, (40 * 2**20,) * 4)

    tuner = Tuner(plan, TuneOptions(max_trials=trials, retries=0, retime=0, stop_probability=stop))
    return tuner, tuner.run(runner)


def test_the_untried_candidates_are_said_without_alarm_when_the_tried_ones_decided(cpu_plan: Plan) -> None:
    """Issue 43, item 18: "the pick is 0% sure ... 100% chance to be more than 2% faster" ended every
    run, good ones too. Now: what it means (many small chances adding up, the likeliest named), what
    to do (more trials: about how many), and no verdict on the pick when the measured ones decided."""
    from pipette.tuner import chance_any_beats

    tuner, result = _tuner_run(cpu_plan, {0: 1.0, 1: 2.0, 2: 1.5, 3: 1.8}, 4, 0.1)
    assert result.decided and result.untried_to_try
    chances = sorted((s.p_beat for s in tuner.ranking()), reverse=True)
    k = result.untried_to_try  # the fewest of the likeliest whose trying leaves the rest under stop_probability
    assert chance_any_beats(chances[k:]) < 0.1 <= chance_any_beats(chances[k - 1:])
    line = next(x for x in summary_lines(result) if "never tried" in x)
    assert "% sure" not in line and "the pick stands among those measured" in line, line
    assert f"(the likeliest, {result.untried_likeliest[0]}," in line if result.untried_likeliest else False
    assert "give the search more trials (--max-trials)" in line and f"about {k} more trials" in line, line
    assert result.to_dict()["untried_to_try"] == k


def test_untried_candidates_under_the_stop_rule_are_called_unlikely(cpu_plan: Plan) -> None:
    _, result = _tuner_run(cpu_plan, {0: 1.0, 1: 2.0, 2: 1.5, 3: 1.8}, 60, 0.1)
    assert result.stop_reason.startswith("converged") and result.untried_to_try == 0
    line = next(x for x in summary_lines(result) if "never tried" in x)
    assert line.endswith("none worth a trial") and "more trials" not in line, line


def test_peak_memory_compares_tensors_with_tensors_in_the_json(cpu_plan: Plan) -> None:
    """Was: the whole estimate (512 MiB of process overhead included) against the measured
    tensor peak: 24x apart."""
    result = _run(cpu_plan, ["ok"])
    assert result.best is not None
    side = result.to_dict()["best"]["side_by_side"]["peak_memory_bytes"]
    overhead = result.best.memory.breakdown["overhead"]
    assert overhead > 0
    assert side["predicted"] == result.best.memory.peak_bytes - overhead == tensor_peak_bytes(result.best.memory)
    assert side["predicted_overhead"] == overhead
    assert result.best.to_dict()["predicted_peak_bytes"] == side["predicted"]


def test_the_picks_measured_step_time_is_the_mean_it_was_picked_by(cpu_plan: Plan) -> None:
    """Was: the step time of one of its trials (the median one), not the mean that picked it."""
    plan = cpu_plan
    first = plan.ranked[0]
    records = [TrialRecord(i, first.config, Measurement("ok", (t,) * 3, plan.training.tokens_per_step),
                           first.perf, first.memory, first.perf.step_time, purpose="search" if i == 0 else "retime")
               for i, t in enumerate((1.0, 1.2, 4.0))]
    tuner = Tuner(plan, TuneOptions(max_trials=4, retime=0), history=records)
    result = tuner.result("test")
    mean = math.exp((math.log(1.0) + math.log(1.2) + math.log(4.0)) / 3)  # 1.69: the mean of the logs
    assert result.pick_trials == 3 and result.pick_step_time == pytest.approx(mean)
    assert result.best is not None and result.best.measurement.step_time == 1.2  # the median trial stands for it
    side = result.to_dict()["best"]["side_by_side"]["step_time_s"]
    assert side["measured"] == pytest.approx(mean) and side["measured_trials"] == 3


def test_a_cpu_job_in_fp32_says_so(cpu_plan: Plan) -> None:
    result = _run(cpu_plan, ["ok"])
    assert any(line.startswith("trained in fp32: CPU devices") for line in summary_lines(result))


def test_the_cli_says_an_undecided_verdict_before_the_best(cpu_plan: Plan, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 32, item 9: "23% sure" came on the second-to-last line, below a result that read as one."""
    from dataclasses import replace

    from cli.tune import _print_result

    result = _run(cpu_plan, ["ok", "ok", "ok"], {0: 1.0, 1: 1.01, 2: 1.3})
    undecided = replace(result, confidence=0.23, to_decide={result.trials[1].label: 4},
                        interference={"cores": 2, "others_cores": [0.4, 1.3], "load_1m": [2.0, 3.5]})
    _print_result(undecided, "out", {})
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert lines[0].startswith(f"UNDECIDED: {result.best.label} is only 23% sure") if result.best else False, lines
    assert "about 8 more trials would decide it" in lines[1] and "--max-trials" in lines[1], lines
    assert lines[2].startswith("best so far: "), lines
    noise = next(x for x in lines if "trial-to-trial noise" in x)
    assert "other processes kept 0.4-1.3 of the 2 cores busy during the trials: a busy machine" in noise, noise


def test_interference_counts_other_processes_cpu_not_this_jobs_ranks() -> None:
    """Real processes: a busy one's CPU seconds are read from /proc; one carrying the job's rank
    tag (a rank) is the job's own, the other is interference."""
    import os
    import subprocess
    import sys
    import time

    from cli.interference import Interference, cpu_seconds_by_pid, is_ours

    burn = [sys.executable, "-c", "import time\nend = time.time() + 20\nwhile time.time() < end: pass"]
    other = subprocess.Popen(burn)
    rank = subprocess.Popen(burn, env={**os.environ, "PIPETTE_RANK_TAG": "tag-under-test"})
    try:
        seen = Interference("tag-under-test")
        seen.start()
        time.sleep(1.5)
        before = cpu_seconds_by_pid()
        time.sleep(1.0)
        after = cpu_seconds_by_pid()
        seen.end()
        assert after[other.pid] > before[other.pid] > 0 and after[rank.pid] > before[rank.pid]
        assert is_ours(rank.pid, "tag-under-test") and not is_ours(other.pid, "tag-under-test")
        summary = seen.summary()
        assert summary["cores"] == os.cpu_count() and len(summary["others_cores"]) == 1
        assert summary["others_cores"][0] > 0.2, summary  # the untagged burner, at least
    finally:
        for p in (other, rank):
            p.kill()
            p.wait()


def test_nothing_left_to_try_says_how_many_were_tried(cpu_plan: Plan) -> None:
    """Issue 32, item 10: "every candidate predicted to fit was tried" closed a job that tried 5 of 16."""
    result = _run(cpu_plan, ["failed"] * 30)
    tried = len({t.label for t in result.trials})
    assert tried < len(cpu_plan.ranked)
    assert result.stop_reason.startswith(f"no untried candidate is left worth a trial: {tried} of "
                                         f"{len(cpu_plan.ranked)} tried"), result.stop_reason
    assert "every candidate predicted to fit was tried" not in result.stop_reason


def test_other_processes_on_the_gpus_are_named_beside_the_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32, item 9: the GPU's interference. NVML cannot run here (no GPU): a stand-in
    module answers NVML's calls, listing one real process of the job (tagged) and one other,
    and one pid from another pid namespace; only the other is interference."""
    import os
    import subprocess
    import sys
    import types
    from collections import namedtuple

    from cli.interference import Interference, foreign_gpu_processes
    from pipette.result_text import interference_words

    assert foreign_gpu_processes("t") is None  # this machine: NVML not found, nothing said
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    other = subprocess.Popen(sleep)
    rank = subprocess.Popen(sleep, env={**os.environ, "PIPETTE_RANK_TAG": "gpu-tag"})
    # until the child has exec'd, /proc/PID/environ is the parent's (no tag): a loaded machine
    # read it in that moment and called the job's own rank interference
    import time
    from pathlib import Path

    deadline = time.monotonic() + 30
    while b"PIPETTE_RANK_TAG=gpu-tag" not in Path(f"/proc/{rank.pid}/environ").read_bytes():
        assert time.monotonic() < deadline, "the rank's environment never showed its tag"
        time.sleep(0.01)
    Proc = namedtuple("Proc", "pid usedGpuMemory")
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    listed = {0: [Proc(rank.pid, 30 * 2**30)], 1: [Proc(other.pid, 6 * 2**30), Proc(2**22 + 7, 2**30)]}
    fake.NVMLError = NVMLError  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    fake.nvmlDeviceGetComputeRunningProcesses = lambda h: listed[h]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    try:
        assert foreign_gpu_processes("gpu-tag") == [(1, other.pid, 6 * 2**30)]
        seen = Interference("gpu-tag")
        for _ in range(3):
            seen.start()
            seen.end()
        listed[1] = []  # the other process left: a fourth trial without it
        seen.start()
        seen.end()
        summary = seen.summary()
        assert summary["gpu_others"] == [1, 1, 1, 0] and summary["gpu_others_bytes"][0] == 6 * 2**30
        words = interference_words(summary)
        assert "1 other process on the GPUs (up to 6.0 GiB) during 3 of 4 trials" in words, words
    finally:
        for p in (other, rank):
            p.kill()
            p.wait()
    quiet = {"cores": 2, "others_cores": [0.1], "gpu_others": [0, 0]}
    assert "GPUs" not in interference_words(quiet)


def test_a_trial_stopped_by_a_signal_is_interrupted_not_pruned(cpu_plan: Plan,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43, item 15: a trial stopped by Ctrl-C or SIGTERM showed as `pruned` and was counted
    "stopped early (slower than the best)", and after Ctrl-C stdout never said the run was
    interrupted. The tuner stops the second trial at its first step, as a signal makes it."""
    from cli.tune import Progress, _print_result
    from pipette.tuner import StepProgress, how_it_ended

    stop = {"now": False}
    calls = iter(range(3))

    def runner(config: object, on_step: object) -> Measurement:
        i = next(calls)
        if i == 1:
            stop["now"] = True  # the signal arrives while trial #1 runs
        for step in range(3):
            if on_step(StepProgress(step, 1.0, False)):  # type: ignore[operator]
                return Measurement("pruned", (1.0,) * (step + 1), cpu_plan.training.tokens_per_step)
        return Measurement("ok", (1.0, 1.0, 1.0), cpu_plan.training.tokens_per_step, (40 * 2**20,) * 4)

    result = Tuner(cpu_plan, TuneOptions(max_trials=3, retries=0, retime=0, stop_probability=0.0)).run(
        runner, should_stop=lambda: stop["now"])
    result.interrupted, result.stop_reason = True, "interrupted (Ctrl-C); the running trial was stopped"
    stopped = result.trials[-1]
    assert how_it_ended(stopped.measurement) == "interrupted" and result.to_dict()["outcomes"] == {
        "ok": 1, "interrupted": 1}
    text = "\n".join(summary_lines(result))
    assert "1 interrupted before its end (Ctrl-C, SIGTERM or a cancel: not for its speed)" in text, text
    assert "stopped early" not in text
    _print_result(result, "out", {})
    out = capsys.readouterr().out.splitlines()
    first = next(line for line in out if line.strip())
    assert first.startswith("INTERRUPTED: interrupted (Ctrl-C)") and "best so far" in first, out
    assert any(line.startswith("best so far: ") for line in out), out
    import io

    stream = io.StringIO()
    Progress(total=3, stream=stream).end(stopped)  # the trial's line on stderr
    assert "interrupted" in stream.getvalue() and "pruned" not in stream.getvalue(), stream.getvalue()


def test_degrees_print_cp_and_ep_only_when_not_1() -> None:
    """The tune's and the client's best lines (``degrees``): tp, pp, dp always, cp and ep as the label
    and the dict write them."""
    from pipette.config import ParallelConfig
    from pipette.result_text import degrees

    plain = ParallelConfig(tp=2, pp=1, dp=2, mbs=1, global_batch=4)
    assert degrees(plain.to_dict()) == [("tp", 2), ("pp", 1), ("dp", 2)]
    both = ParallelConfig(tp=1, pp=1, dp=4, cp=2, ep=4, mbs=1, global_batch=4)
    assert degrees(both.to_dict()) == [("tp", 1), ("pp", 1), ("dp", 4), ("cp", 2), ("ep", 4)]
    assert "-cp2-ep4-" in both.label
