"""A failure of the user's script that no layout explains stops the search at once, with its fix
(issue 43, item 26: a missing import failed 5 trials and a retry)."""

from __future__ import annotations

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.measurement import Measurement
from pipette.model import ModelSpec
from pipette.plan import Plan, make_plan
from pipette.script import ScriptSpec
from pipette.script_faults import script_fault
from pipette.training import TrainingSpec
from pipette.tuner import TuneOptions, Tuner

TRAINER = ScriptSpec(argv=("python", "train.py"), kind="hf-trainer")

MISSING = """Traceback (most recent call last):
  File "/w/train.py", line 3, in <module>
    import wandb_helpers
ModuleNotFoundError: No module named 'wandb_helpers'
"""
SYNTAX = """  File "/w/train.py", line 12
    def main(:
             ^
SyntaxError: invalid syntax
"""
USAGE = """usage: train.py [-h] [--lr LR] [--epochs EPOCHS]
train.py: error: unrecognized arguments: --per_device_train_batch_size 2 --seed 3
"""
REQUIRED = """usage: train.py [-h] --data DATA
train.py: error: the following arguments are required: --data
"""
HF_UNUSED = "ValueError: Some specified arguments are not used by the HfArgumentParser: ['--max_steps', '5']\n"


@pytest.mark.parametrize(("output", "what", "fix"), [
    (MISSING, "ModuleNotFoundError: No module named 'wandb_helpers'", "install wandb_helpers into the environment"),
    (SYNTAX, "SyntaxError: invalid syntax", "fix the script's syntax at /w/train.py, line 12"),
    (USAGE, "train.py: error: unrecognized arguments: --per_device_train_batch_size 2 --seed 3",
     "Pipette passed the knob micro_batch (--per_device_train_batch_size): give the script's own flag "
     "(--script-knob micro_batch=--its_flag) or clear it (--script-knob micro_batch=); drop --seed"),
    (REQUIRED, "train.py: error: the following arguments are required: --data", "python train.py --help"),
    (HF_UNUSED, "the script's argument parser refused --max_steps", "knob steps (--max_steps)"),
])
def test_failures_no_layout_explains_are_named_with_their_fix(output: str, what: str, fix: str) -> None:
    fault = script_fault("rank 0 exited with status 1", output, TRAINER, python="/env/bin/python")
    assert fault is not None
    assert fault.what == what
    assert fix in fault.fix


@pytest.mark.parametrize("error", [
    "the script exited without error but reported no step: call pipette.report.Reporter.step ...",
    "the script trains without FSDP: rank 0 stepped but never called fully_shard, ...",
    "the script ignores the DeepSpeed config: rank 0 trained 2 sequences per step, ...",
])
def test_a_script_that_ran_but_reported_or_built_nothing_of_the_candidate_is_its_fault(error: str) -> None:
    fault = script_fault(error, "")
    assert fault is not None and fault.what == error


@pytest.mark.parametrize(("error", "output"), [
    ("rank 1 exited with status 1", "RuntimeError: CUDA error: an illegal memory access was encountered\n"),
    ("the script stopped before its first step: ValueError: 7 layers do not split into 2 stages", ""),
    ("no step reported in 60 s", "loading ...\n"),
    # a warning that names an ImportError, then the real error: the real one decides
    ("rank 0 exited with status 1", "ImportError: flash_attn not found, using sdpa\nRuntimeError: shapes differ\n"),
])
def test_failures_a_layout_may_explain_are_not_the_scripts(error: str, output: str) -> None:
    assert script_fault(error, output) is None


@pytest.fixture(scope="module")
def plan() -> Plan:
    cluster = homogeneous_cluster("a100-40gb", nodes=1, devices_per_node=8, intra_bandwidth=300e9, inter_bandwidth=25e9)
    return make_plan(ModelSpec.preset("llama2-7b"), TrainingSpec(global_batch=32, seq_len=2048), cluster)


def test_the_search_stops_at_the_first_fault_of_the_script_without_a_retry(plan: Plan) -> None:
    calls: list[str] = []

    def runner(config: ParallelConfig, on_step: object) -> Measurement:
        calls.append(config.label)
        return Measurement("failed", error="the script stopped before its first step: ModuleNotFoundError: No "
                           "module named 'x'\nfix: install x", extra={"backend": "script", "script_fault": "install x"})

    result = Tuner(plan, TuneOptions(max_trials=8, retries=1)).run(runner)
    assert len(calls) == 1, calls  # no retry, no second candidate
    assert result.best is None
    assert result.stop_reason == ("the script failed at trial #0 in a way no layout explains, so every "
                                  "candidate would (the script stopped before its first step: ModuleNotFoundError: "
                                  "No module named 'x'); fix: install x")
    assert "a retry would repeat it" in result.trials[0].details.not_retried


def test_a_stored_fault_teaches_nothing_and_stops_no_later_run(plan: Plan) -> None:
    """The records of a failed run (the same script, not yet fixed) are read back as prior: they
    neither stop the next run nor rule its candidates out."""
    def fail(config: ParallelConfig, on_step: object) -> Measurement:
        return Measurement("failed", error="x", extra={"backend": "script", "script_fault": "fix it"})

    first = Tuner(plan, TuneOptions(max_trials=8)).run(fail)
    tuner = Tuner(plan, TuneOptions(max_trials=8), prior=first.trials)
    assert tuner.stop_reason() is None
    assert len(tuner.sampler.learned(tuner.study).observations) == 0
