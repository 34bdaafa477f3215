"""What a script cannot run: said by the user (``--script-unsupported``), or by the script when a
trial fails (not retried), and torchtitan 0.3's command line (issue 43, item 31)."""

from __future__ import annotations

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.measurement import Measurement
from pipette.model import ModelSpec
from pipette.plan import make_plan
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from pipette.tuner import TuneOptions, Tuner

TITAN_ARGV = ("python", "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_8b")
FP32 = TrainingSpec(global_batch=16, seq_len=64, dtype="fp32")


def test_what_the_user_says_the_script_cannot_run_is_never_tried() -> None:
    script = ScriptSpec(argv=TITAN_ARGV, kind="torchtitan", unsupported=("pp", "selective"))
    pp2 = ParallelConfig(tp=1, pp=2, dp=2, mbs=2, global_batch=16, zero_stage=3)
    assert script.refusals(FP32, pp2) == ["pipeline parallelism (pp > 1): the script does not run it "
                                          "(--script-unsupported pp)"]
    sac = ParallelConfig(tp=2, pp=1, dp=2, mbs=2, global_batch=16, zero_stage=3, recompute="selective")
    assert script.refusals(FP32, sac) == ["selective recomputation: the script does not run it "
                                          "(--script-unsupported selective)"]
    assert script.refusals(FP32, ParallelConfig(tp=2, pp=1, dp=2, mbs=2, global_batch=16, zero_stage=3)) == []
    assert script.to_dict()["unsupported"] == ["pp", "selective"]
    with pytest.raises(SpecError, match="script.unsupported: holds 'pipeline'"):
        ScriptSpec(argv=TITAN_ARGV, kind="torchtitan", unsupported=("pipeline",))


@pytest.mark.parametrize(("argv", "said"), [
    (("python", "-m", "torchtitan.train"), "lacks --module and --config"),
    (("python", "-m", "torchtitan.train", "--module", "llama3"), "lacks --config"),
    ((*TITAN_ARGV, "activation-checkpoint:full"), "holds activation-checkpoint:full"),
])
def test_torchtitans_entry_without_its_model_and_job_is_one_line(argv: tuple[str, ...], said: str) -> None:
    with pytest.raises(SpecError, match=said):
        ScriptSpec(argv=argv, kind="torchtitan")
    with pytest.raises(SpecError, match="torchtitan \\(0.3\\) takes its job from --module and --config"):
        ScriptSpec(argv=TITAN_ARGV, kind="torchtitan", base_config={"training": {"steps": 1}})


def test_a_failure_that_says_unsupported_names_the_flag_and_is_not_retried() -> None:
    from workers.host.outcome import Outcome
    from workers.host.script_trial import script_events, script_measurement
    from workers.spec import TrialSpec

    config = ParallelConfig(tp=1, pp=2, dp=2, mbs=2, global_batch=16, zero_stage=3)
    trial = TrialSpec(ModelSpec.preset("tiny-llama"), FP32, config,
                      script=ScriptSpec(argv=TITAN_ARGV, kind="torchtitan"))
    tail = "Traceback (most recent call last):\nNotImplementedError: pipeline parallelism is not supported here"
    m = script_measurement(trial, Outcome("failed", "rank 0 exited with status 1"), script_events(trial), 1.0, tail)
    assert "--script-unsupported pp" in m.details.unsupported and not m.details.script_fault
    assert "fix: the script says it cannot run this candidate" in m.error

    cluster = homogeneous_cluster("a100-40gb", nodes=1, devices_per_node=8, intra_bandwidth=300e9,
                                  inter_bandwidth=25e9)
    plan = make_plan(ModelSpec.preset("llama2-7b"), TrainingSpec(global_batch=32, seq_len=2048), cluster)
    calls: list[str] = []

    def runner(c: ParallelConfig, on_step: object) -> Measurement:
        calls.append(c.label)
        return Measurement("failed", error="NotImplementedError: x", extra={"unsupported": "say it"})

    result = Tuner(plan, TuneOptions(max_trials=2, retries=2, retime=0)).run(runner)
    assert len(calls) == len(set(calls)) == 2  # no retry of either
    assert all("cannot run this candidate: a retry" in t.details.not_retried for t in result.trials)
