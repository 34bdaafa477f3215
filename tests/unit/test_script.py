"""``pipette.script``: what a user's script accepts, the command each candidate runs, what it
cannot run, and the DeepSpeed config written on top of the user's own."""

from __future__ import annotations

import pytest

from pipette.config import ParallelConfig
from pipette.emit import deepspeed_config
from pipette.errors import SpecError
from pipette.script import KINDS, ScriptSpec, script_ds_config
from pipette.training import LoraSpec, TrainingSpec

FULL = TrainingSpec(global_batch=16, seq_len=128, dtype="bf16")
LORA = TrainingSpec(global_batch=16, seq_len=128, dtype="bf16", method="lora", lora=LoraSpec(rank=8, alpha=16))


def _config(**kw: object) -> ParallelConfig:
    base: dict[str, object] = {"tp": 1, "pp": 1, "dp": 4, "mbs": 2, "global_batch": 16}
    return ParallelConfig(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "words"), [
    ("python train.py", "argument list"),
    ((), "is empty"),
    (("python", ""), "non-empty"),
    (("python train.py --lr 1e-4",), "shell string"),
    (("python", 3), "non-empty"),
])
def test_a_command_that_is_not_an_argument_list_is_refused(argv: object, words: str) -> None:
    with pytest.raises(SpecError, match=words) as caught:
        ScriptSpec(argv=argv)  # type: ignore[arg-type]
    assert caught.value.field == "script.argv"


def test_knobs_fill_from_the_kind_and_can_be_set_or_cleared() -> None:
    spec = ScriptSpec(argv=("python", "t.py"), kind="hf-trainer",
                      knobs={"seq_len": "--max_len", "checkpointing": ""})
    assert spec.knobs["deepspeed_config"] == "--deepspeed" and spec.knobs["seq_len"] == "--max_len"
    assert "checkpointing" not in spec.knobs
    assert ScriptSpec(argv=("t",), kind="deepspeed").knobs == KINDS["deepspeed"]


@pytest.mark.parametrize(("kw", "field"), [
    ({"kind": "megatron"}, "script.kind"),
    ({"knobs": {"learning_rate": "--lr"}}, "script.knobs"),
    ({"knobs": {"micro_batch": "batch"}}, "script.knobs.micro_batch"),
    ({"knobs": {"micro_batch": "--a b"}}, "script.knobs.micro_batch"),
    ({"base_config": ["zero"]}, "script.base_config"),
])
def test_bad_knobs_kinds_and_configs_name_their_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as caught:
        ScriptSpec(argv=("python", "t.py"), **kw)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_the_program_and_its_arguments() -> None:
    py = ScriptSpec(argv=("/venv/bin/python3", "train.py", "--a", "1"))
    assert py.is_python and py.program == "train.py" and py.script_args == ("--a", "1")
    exe = ScriptSpec(argv=("./train.sh", "--a"))
    assert not exe.is_python and exe.program == "./train.sh" and exe.script_args == ("--a",)


def test_the_command_appends_each_knob_pipette_sets() -> None:
    spec = ScriptSpec(argv=("python", "t.py", "--lr", "1e-4"), kind="hf-trainer", knobs={"seq_len": "--seq"})
    config = _config(recompute="full", global_batch=32)  # mbs 2 x dp 4 x accum 4
    assert spec.command(FULL, config, "/tmp/ds.json", steps=7) == [
        "python", "t.py", "--lr", "1e-4", "--deepspeed", "/tmp/ds.json", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "4", "--seq", "128", "--max_steps", "7", "--gradient_checkpointing",
        "--bf16",
    ]
    # no recomputation, no steps: neither flag
    out = spec.command(FULL, _config(), "/tmp/ds.json")
    assert "--gradient_checkpointing" not in out and "--max_steps" not in out


def test_what_a_script_cannot_run_is_refused_with_the_reason() -> None:
    plain = ScriptSpec(argv=("python", "t.py"), kind="deepspeed")
    assert plain.refusals(FULL, _config()) == []
    assert any("PipelineModule" in r for r in plain.refusals(FULL, _config(pp=2, dp=2)))
    assert any("AutoTP" in r for r in plain.refusals(FULL, _config(tp=2, dp=2)))
    assert any("selective" in r for r in plain.refusals(FULL, _config(recompute="selective")))
    assert any("no checkpointing knob" in r for r in plain.refusals(FULL, _config(recompute="full")))
    autotp = ScriptSpec(argv=("python", "t.py"), kind="deepspeed", autotp=True, pipeline=True)
    assert autotp.refusals(FULL, _config(tp=2, dp=2)) == []
    assert any("LoRA" in r for r in autotp.refusals(LORA, _config(tp=2, dp=2)))
    assert autotp.refusals(FULL, _config(pp=2, dp=2)) == []
    bare = ScriptSpec(argv=("python", "t.py"))
    assert any("micro-batch" in r for r in bare.refusals(FULL, _config()))
    assert bare.refusals(FULL, _config(mbs=1, global_batch=4)) == []


def test_a_placement_that_interleaves_nodes_is_refused() -> None:
    spec = ScriptSpec(argv=("python", "t.py"), kind="deepspeed")
    nodes = [0, 0, 1, 1]
    assert spec.refusals(FULL, _config(placement=(2, 3, 0, 1)), nodes) == []
    assert any("interleaves" in r for r in spec.refusals(FULL, _config(placement=(0, 2, 1, 3)), nodes))


def test_from_dict_round_trips_and_names_bad_keys() -> None:
    spec = ScriptSpec(argv=("python", "t.py"), kind="hf-trainer", autotp=True, base_config={"steps_per_print": 1})
    assert ScriptSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match="unknown key"):
        ScriptSpec.from_dict({"argv": ["t"], "shell": True})
    with pytest.raises(SpecError, match="is missing"):
        ScriptSpec.from_dict({"kind": "deepspeed"})
    with pytest.raises(SpecError, match="not a mapping"):
        ScriptSpec.from_dict(["python", "t.py"])  # type: ignore[arg-type]


def test_the_users_config_keeps_its_own_keys_under_pipettes() -> None:
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "steps_per_print": 5,
            "train_batch_size": 999, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e8,
                                                           "offload_optimizer": {"device": "cpu"}},
            "tensor_parallel": {"autotp_size": 4}, "fp16": {"enabled": True}}
    spec = ScriptSpec(argv=("python", "t.py"), kind="deepspeed", base_config=base)
    config = _config(zero_stage=2)
    out = script_ds_config(deepspeed_config(FULL, config), spec)
    assert out["optimizer"] == base["optimizer"] and out["steps_per_print"] == 5
    assert out["train_batch_size"] == 16 and out["train_micro_batch_size_per_gpu"] == 2
    zero = out["zero_optimization"]
    # another stage than the user's: their stage-3 tuning goes, their offload stays
    assert zero["stage"] == 2 and "stage3_max_live_parameters" not in zero and zero["offload_optimizer"]
    assert "tensor_parallel" not in out  # tp 1: no AutoTP
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False
    # the same stage keeps the user's tuning
    same = script_ds_config(deepspeed_config(FULL, _config(zero_stage=3)), spec)
    assert same["zero_optimization"]["stage3_max_live_parameters"] == 1e8
    assert base["train_batch_size"] == 999  # the user's dict is not changed


def test_pipettes_optimizer_block_is_left_to_the_script() -> None:
    spec = ScriptSpec(argv=("python", "t.py"), kind="hf-trainer")
    out = script_ds_config(deepspeed_config(FULL, _config()), spec)
    assert "optimizer" not in out and out["gradient_clipping"] > 0


def test_a_scripts_step_time_is_the_mean_over_ranks_not_their_jitter() -> None:
    from workers.host.script_trial import steps_across_ranks

    # two ranks in lock-step, each late by turns: the run took 0.1 s a step, not 0.12
    per_rank = [[0.12, 0.08, 0.12, 0.08], [0.08, 0.12, 0.08, 0.12, 0.1]]
    steps = steps_across_ranks(per_rank)
    assert len(steps) == 4
    assert steps == pytest.approx((0.1, 0.1, 0.1, 0.1))
    assert steps_across_ranks([]) == ()


def test_a_scripts_trial_figure_is_the_mean_of_its_steps_and_survives_its_record() -> None:
    """A script's steps are unaligned intervals: their mean is the run's time per step (what
    its own samples/s says); the median of a skewed series reads low. The record keeps which."""
    from pipette.measurement import Measurement

    steps = (0.07, 0.07, 0.07, 0.13)  # a slow step in four: the run took 0.085 s a step
    script = Measurement("ok", steps, 10, statistic="mean")
    runner = Measurement("ok", steps, 10)
    assert script.step_time == pytest.approx(0.085) and runner.step_time == pytest.approx(0.07)
    back = Measurement.from_dict(script.to_dict())
    assert back == script and back.step_time == pytest.approx(0.085)
    assert Measurement.from_dict({k: v for k, v in runner.to_dict().items() if k != "statistic"}) == runner


def test_only_a_rank_that_exits_before_any_rank_stepped_makes_the_script_stopped_before_its_first_step() -> None:
    """CI once saw rank 1's first step (training the wrong batch) arrive before any line of
    rank 0's: the trial's error read "stopped before its first step: <rank 0's last line>"
    on top of the one line that says the script ignores its config."""
    from pipette.model import ModelSpec
    from workers.host.outcome import Outcome
    from workers.host.script_trial import ScriptEvents, script_measurement
    from workers.spec import TrialSpec

    training = TrainingSpec(global_batch=8, seq_len=32, dtype="fp32")
    trial = TrialSpec(ModelSpec.preset("tiny-llama"), training,
                      ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=8),
                      script=ScriptSpec(argv=("python", "t.py"), kind="deepspeed"))
    tail = "Traceback (most recent call last):\nValueError: no such dataset"
    events = ScriptEvents(world=2, global_batch=8)
    events.add(1, {"event": "step", "step": 0, "time": 0.1, "samples": 2})
    ignored = events.ignored_config()
    assert ignored is not None and ignored.startswith("the script ignores the DeepSpeed config: rank 1")
    # Pipette ended it (no rank's exit): the one line alone
    assert script_measurement(trial, Outcome("failed", ignored), events, 1.0).error == ignored
    # a rank exited after rank 1 stepped: not "before its first step", though rank 0 reported none
    assert script_measurement(trial, Outcome("failed", "rank 0 exited 1"), events, 1.0, tail).error == \
        "rank 0 exited 1"
    quiet = ScriptEvents(world=2, global_batch=8)
    m = script_measurement(trial, Outcome("failed", "rank 0 exited 1"), quiet, 1.0, tail)
    assert m.error == "the script stopped before its first step: ValueError: no such dataset\nrank 0 exited 1"


def test_a_script_that_drops_the_zero_stage_is_caught_once_it_steps() -> None:
    """Issue 32, item 10: only an ignored batch was detected; a script that built another ZeRO
    stage, or no DeepSpeed engine at all (Accelerate on CPU with use_cpu), went unseen."""
    from workers.host.script_trial import ScriptEvents

    step = {"event": "step", "step": 0, "time": 0.1, "samples": 8}
    fine = ScriptEvents(world=2, global_batch=8, zero_stage=3)
    fine.add(0, {"event": "ds_engine", "zero_stage": 3})
    fine.add(0, step)
    fine.add(1, {"event": "ds_engine", "zero_stage": 3})  # rank 1 built it, has not stepped yet
    assert fine.ignored_config() is None
    other = ScriptEvents(world=2, global_batch=8, zero_stage=3)
    other.add(1, {"event": "ds_engine", "zero_stage": 1})
    other.add(1, step)
    assert (other.ignored_config() or "").startswith(
        "the script ignores the DeepSpeed config's ZeRO stage: rank 1 built a ZeRO-1 engine, the candidate's is ZeRO-3")
    none = ScriptEvents(world=2, global_batch=8, zero_stage=2)
    none.add(0, {"event": "ds_engine", "zero_stage": None})  # a DeepSpeed that would not say: not judged
    none.add(0, step)
    assert none.ignored_config() is None
    none.add(1, step)
    assert (none.ignored_config() or "").startswith("the script trains without a DeepSpeed engine: rank 1 stepped")
    unchecked = ScriptEvents(world=2, global_batch=8)  # no stage given: as before, the batch alone
    unchecked.add(0, step)
    assert unchecked.ignored_config() is None
