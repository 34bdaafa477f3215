"""FSDP scripts (issue 31): what each kind takes of an ``fsdp`` candidate (``pipette.script``
refusals and command, ``pipette.script_fsdp`` files), the one-line refusals of a script kind
that does not match its stack, and the check of what the script built (its ``fully_shard``
calls). The files against the installed Accelerate, transformers and torchtitan's field names:
tests/fsdp/test_script_configs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.emit_script import write_script_launch_files
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.registry import stacks_to_tune
from pipette.script import ScriptSpec, bind_stack
from pipette.script_fsdp import accelerate_fsdp_env, torchtitan_args, torchtitan_settings, trainer_fsdp_config
from pipette.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelSpec.preset("tiny-llama")
FP32 = TrainingSpec(global_batch=16, seq_len=64, dtype="fp32")
ACCEL = ScriptSpec(argv=("python", "accelerate_fsdp.py"), kind="accelerate-fsdp")
TRAINER = ScriptSpec(argv=("python", "train.py"), kind="hf-trainer", fsdp=True)
TITAN = ScriptSpec(argv=("python", "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_8b"),
                   kind="torchtitan")


def _config(**kw: object) -> ParallelConfig:
    base: dict[str, object] = {"tp": 1, "pp": 1, "dp": 4, "mbs": 2, "global_batch": 16, "zero_stage": 3}
    return ParallelConfig(**(base | kw))  # type: ignore[arg-type]


def test_the_fsdp_kinds_shard_with_fsdp_and_write_their_flag_only_when_set() -> None:
    assert ACCEL.fsdp and TITAN.fsdp and not ScriptSpec(argv=("python", "t.py"), kind="hf-trainer").fsdp
    assert ACCEL.to_dict()["fsdp"] is True
    assert "fsdp" not in ScriptSpec(argv=("python", "t.py"), kind="deepspeed").to_dict()  # its trials' key unchanged
    assert ScriptSpec.from_dict(TRAINER.to_dict()) == TRAINER


@pytest.mark.parametrize(("script", "kw", "words"), [
    (ACCEL, {"zero_stage": 1}, "ZeRO-1 (optimizer-only sharding) is DeepSpeed's"),
    (TITAN, {"zero_stage": 1}, "ZeRO-1"),
    (ACCEL, {"tp": 2, "dp": 2}, "tp=2: accelerate-fsdp shards with FSDP only"),
    (TRAINER, {"pp": 2, "dp": 2, "mbs": 1}, "pp=2: hf-trainer has no pipeline parallelism"),
    (ACCEL, {"zero_stage": 0}, "Accelerate's FSDP2 plugin always shards"),
    (ACCEL, {"recompute": "selective"}, "selective recomputation"),
    (TRAINER, {"dp_shard": 2}, "HSDP (dp_shard=2): the Trainer's fsdp_config has no replicate degree"),
    (TITAN, {"zero_stage": 0, "offload": True}, "CPU offload with zero_stage 0"),
])
def test_what_a_kind_cannot_run_is_refused(script: ScriptSpec, kw: dict[str, object], words: str) -> None:
    assert any(words in r for r in script.refusals(FP32, _config(**kw))), script.refusals(FP32, _config(**kw))


@pytest.mark.parametrize(("script", "kw"), [
    (ACCEL, {}), (ACCEL, {"zero_stage": 2, "dp_shard": 2, "offload": True, "recompute": "full"}),
    (TRAINER, {"zero_stage": 0}), (TRAINER, {"offload": True, "recompute": "full"}),
    (TITAN, {"tp": 2, "pp": 2, "dp": 1, "mbs": 2, "schedule": "interleaved", "virtual_stages": 2,
             "recompute": "selective"}),
    (TITAN, {"zero_stage": 0}),
])
def test_what_a_kind_runs_is_not_refused(script: ScriptSpec, kw: dict[str, object]) -> None:
    assert script.refusals(FP32, _config(**kw)) == []


def test_the_trainer_gets_fsdp_and_its_config_instead_of_deepspeed() -> None:
    sharded = TRAINER.command(FP32, _config(recompute="full"), "ds.json", steps=5, fsdp_config_path="f.json")
    assert sharded[2:6] == ["--fsdp", "--fsdp_config", "f.json", "--per_device_train_batch_size"]
    assert "--deepspeed" not in sharded and "--gradient_checkpointing" not in sharded  # recompute: in f.json
    ddp = TRAINER.command(FP32, _config(zero_stage=0, recompute="full"), "ds.json", steps=5,
                          fsdp_config_path="f.json")
    assert "--fsdp" not in ddp and "--fsdp_config" not in ddp and "--gradient_checkpointing" in ddp
    titan = TITAN.command(FP32, _config(), "", steps=7)
    assert titan == [*TITAN.argv, "--training.steps", "7"]  # the candidate's flags follow (torchtitan_args)


def test_a_script_kind_that_does_not_match_its_stack_is_one_line() -> None:
    trainer = ScriptSpec(argv=("python", "t.py"), kind="hf-trainer")
    assert bind_stack(trainer, "fsdp").fsdp and not bind_stack(trainer, "hf-deepspeed").fsdp
    assert stacks_to_tune(None, script=True, script_kind="accelerate-fsdp")[0].name == "fsdp"
    assert stacks_to_tune(None, script=True, script_kind="torchtitan")[0].name == "fsdp"
    cases = [
        (lambda: bind_stack(ScriptSpec(argv=("python", "t.py"), kind="deepspeed"), "fsdp"), "--script-kind"),
        (lambda: bind_stack(ACCEL, "hf-deepspeed"), "--stack"),
        (lambda: ScriptSpec(argv=("python", "t.py"), kind="accelerate-fsdp", autotp=True), "script.autotp"),
        (lambda: ScriptSpec(argv=("python", "t.py"), kind="accelerate-fsdp", pipeline=True), "script.pipeline"),
        (lambda: ScriptSpec(argv=("python", "t.py"), kind="accelerate-fsdp",
                            base_config={"zero_optimization": {"stage": 1}}), "script.base_config"),
        (lambda: ScriptSpec(argv=("python", "t.py"), kind="deepspeed", fsdp=True), "script.kind"),
    ]
    for make, field in cases:
        with pytest.raises(SpecError) as caught:
            make()
        assert caught.value.field == field
        assert "\n" not in str(caught.value) and caught.value.fix


def test_accelerate_gets_fsdp2_with_the_candidates_sharding() -> None:
    env = accelerate_fsdp_env(FP32, _config(zero_stage=2, offload=True, recompute="full"), MODEL)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "false" and env["FSDP_OFFLOAD_PARAMS"] == "true"
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == "true" and env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in env
    hsdp = accelerate_fsdp_env(FP32, _config(dp_shard=2), MODEL)
    assert (hsdp["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], hsdp["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "2")
    assert hsdp["FSDP_RESHARD_AFTER_FORWARD"] == "true"


def test_the_trainers_fsdp_config() -> None:
    assert trainer_fsdp_config(FP32, _config(), MODEL) == {
        "version": 2, "reshard_after_forward": True, "cpu_offload": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "activation_checkpointing": False, "state_dict_type": "SHARDED_STATE_DICT",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    }


@pytest.mark.parametrize(("kw", "parallelism", "local"), [
    ({}, {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 4, "fsdp_reshard_after_forward": "always",
          "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1}, 2),
    ({"zero_stage": 2, "dp_shard": 2}, {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2,
                                       "fsdp_reshard_after_forward": "never"}, 2),
    ({"zero_stage": 0}, {"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 1}, 2),
    # pp 2 x dp 2, 16 / (2 x 2) = 4 micro-batches of 2: local batch 8, pipelined in micro-batches of 2
    ({"pp": 2, "dp": 2, "schedule": "interleaved", "virtual_stages": 2},
     {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "Interleaved1F1B",
      "pipeline_parallel_microbatch_size": 2, "pipeline_parallel_layers_per_stage": 1,
      "pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0}, 8),
])
def test_torchtitans_sections(kw: dict[str, object], parallelism: dict[str, object], local: int) -> None:
    config = _config(**kw)
    got = torchtitan_settings(FP32, config, MODEL)
    assert parallelism.items() <= got["parallelism"].items(), got["parallelism"]
    assert got["training"]["local_batch_size"] == local and got["training"]["global_batch_size"] == 16
    # torchtitan's gradient accumulation: global / (local x dp); the pipeline's micro-batches: local / mbs
    steps = 16 // (local * config.dp)
    assert steps * (local // config.mbs if config.pp > 1 else 1) == config.grad_accum


def _torchtitan_split(layers: int, stages: int) -> list[int]:
    """Layers per stage as torchtitan 0.3.0 splits them with no weight for the embedding and the
    head (``_generate_llm_fqn_per_model_part``, first/last_stage_less_layers 0): even, the
    first ``layers % stages`` stages one heavier."""
    return [layers // stages + (i < layers % stages) for i in range(stages)]


@pytest.mark.parametrize(("pp", "schedule", "v"), [(8, "interleaved", 2), (8, "1f1b", 1), (4, "interleaved", 3)])
def test_an_uneven_split_is_the_split_pipette_priced(pp: int, schedule: str, v: int) -> None:
    """126 layers (Llama 3.1 405B) over stages they do not fill evenly: torchtitan 0.3.0 derives
    the stages (1 a rank for 1F1B, else ceil(layers / layers_per_stage)) and splits the decoder
    layers as the plan priced and Pipette's runner trains (``stage_layers``), heavier stages first."""
    from workers.rank.fsdp_model import stage_layers

    model = ModelSpec(name="llama3.1-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                      vocab=128256, max_seq=8192, tied_embeddings=False, arch="llama")
    config = ParallelConfig(tp=1, pp=pp, dp=1, mbs=1, global_batch=8 * pp, zero_stage=3, schedule=schedule,
                            virtual_stages=v)
    got = torchtitan_settings(FP32, config, model)["parallelism"]
    assert got["pipeline_parallel_first_stage_less_layers"] == got["pipeline_parallel_last_stage_less_layers"] == 0
    per_stage = got.get("pipeline_parallel_layers_per_stage")
    stages = pp if per_stage is None else -(-126 // per_stage)
    assert stages == pp * v
    assert _torchtitan_split(126, stages) == [len(r) for r in stage_layers(126, pp * v)]


def test_torchtitans_command_line_ends_with_its_activation_checkpointing() -> None:
    args = torchtitan_args(FP32, _config(recompute="selective", offload=True), MODEL)
    assert args[-1] == "activation-checkpoint:selective"  # a tyro subcommand: after every option
    assert "--training.enable-cpu-offload" in args and "--training.no-disable-cuda-graphs" in args
    assert args[args.index("--parallelism.data-parallel-shard-degree") + 1] == "4"
    assert torchtitan_args(FP32, _config(), MODEL)[-1] == "activation-checkpoint:none"


def test_the_launch_files_of_each_fsdp_kind(tmp_path: Path) -> None:
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    accel = write_script_launch_files(tmp_path / "a", MODEL, FP32, _config(), cluster, ACCEL)
    assert sorted(accel) == ["accelerate_config.yaml", "candidate.json", "launch-accelerate.sh", "rank_map.json"]
    config = yaml.safe_load(accel["accelerate_config.yaml"].read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    assert config["num_processes"] == 4 and config["fsdp_config"]["fsdp_reshard_after_forward"] is True
    launch = accel["launch-accelerate.sh"].read_text()
    assert '--config_file "$HERE/accelerate_config.yaml"' in launch and "deepspeed" not in launch.split("\n")[-2]

    trainer = write_script_launch_files(tmp_path / "t", MODEL, FP32, _config(zero_stage=2), cluster, TRAINER)
    assert sorted(trainer) == ["candidate.json", "fsdp_config.json", "launch-torchrun.sh", "rank_map.json"]
    assert json.loads(trainer["fsdp_config.json"].read_text())["reshard_after_forward"] is False
    assert '--fsdp --fsdp_config "$HERE/fsdp_config.json"' in trainer["launch-torchrun.sh"].read_text()
    ddp = write_script_launch_files(tmp_path / "d", MODEL, FP32, _config(zero_stage=0), cluster, TRAINER)
    assert "fsdp_config.json" not in ddp and "--fsdp" not in ddp["launch-torchrun.sh"].read_text()

    titan = write_script_launch_files(tmp_path / "tt", MODEL, FP32, _config(tp=2, dp=2), cluster, TITAN)
    assert sorted(titan) == ["candidate.json", "launch-torchrun.sh", "rank_map.json"]  # all on its command line
    line = titan["launch-torchrun.sh"].read_text().splitlines()[-1]
    assert "-m torchtitan.train --module llama3 --config llama3_8b --training.steps 50 " in line, line
    assert "--parallelism.tensor-parallel-degree 2 " in line and line.endswith(" activation-checkpoint:none"), line


def test_an_fsdp_script_that_builds_no_fsdp_or_the_other_sharding_is_caught_once_it_steps() -> None:
    from workers.host.script_trial import ScriptEvents, script_events
    from workers.spec import TrialSpec

    step = {"event": "step", "step": 0, "time": 0.1, "samples": 16}
    layer = {"event": "fsdp_shard", "reshard_after_forward": True, "unit": "FSDPLlamaDecoderLayer"}
    tail = {"event": "fsdp_shard", "reshard_after_forward": False, "unit": "list"}  # Accelerate's norm + head
    fine = ScriptEvents(world=2, global_batch=16, reshard_after_forward=True)
    for event in (layer, layer, tail, {**layer, "reshard_after_forward": None}, step):
        fine.add(0, event)
    assert fine.ignored_config() is None
    fine.add(1, step)
    assert (fine.ignored_config() or "").startswith("the script trains without FSDP: rank 1 stepped but never called")
    other = ScriptEvents(world=2, global_batch=16, reshard_after_forward=False)
    for event in (layer, layer, tail, step):
        other.add(0, event)
    assert (other.ignored_config() or "").startswith(
        "the script ignores the candidate's FSDP sharding: rank 0 built FULL_SHARD (reshard after forward) on 2 of 3")
    trial = TrialSpec(MODEL, FP32, _config(zero_stage=2), script=ACCEL)
    assert script_events(trial).reshard_after_forward is False and script_events(trial).zero_stage is None
    ddp = TrialSpec(MODEL, FP32, _config(zero_stage=0), script=TRAINER)
    assert script_events(ddp).reshard_after_forward is None  # DDP: nothing to check


@pytest.mark.parametrize("zero_stage", [3, 0])
def test_an_fsdp_script_whose_ranks_train_alone_is_told_so_in_fsdps_words(zero_stage: int) -> None:
    """Issue 43, item 27: Accelerate on CPU dropped FSDP (DistributedType.NO), each rank trained
    alone, and the trial said the script "ignores the DeepSpeed config" (it has none)."""
    from workers.host.script_trial import script_events
    from workers.spec import TrialSpec

    events = script_events(TrialSpec(MODEL, FP32, _config(zero_stage=zero_stage), script=ACCEL if zero_stage else
                                     TRAINER))
    alone = events.global_batch // events.world  # what one rank trains by itself
    events.add(0, {"event": "step", "step": 0, "time": 0.1, "samples": alone})
    said = events.ignored_config() or ""
    assert "DeepSpeed" not in said, said
    if zero_stage:  # a sharded candidate: no fully_shard call is the cause, said first
        assert said.startswith("the script trains without FSDP: rank 0 stepped but never called fully_shard"), said
    else:  # DDP (NO_SHARD): the batch gives it away
        assert said.startswith(f"the script ignores the candidate's global batch: rank 0 trained {alone} sequences "
                               f"per step, the candidate's is {events.global_batch}: each rank trained alone "
                               "(Accelerate on CPU finds no accelerator, DistributedType.NO"), said
        assert "use_configured_state" in said


def test_cp_runs_in_torchtitan_scripts_only() -> None:
    """torchtitan takes ``context_parallel_degree``; Accelerate and the Trainer split a sequence only
    inside the user's loop (``maybe_context_parallel``), which a trial cannot see: refused there."""
    from pipette.script import fsdp_script_refusals

    c = _config(dp=2, cp=2)
    assert fsdp_script_refusals(TITAN, c) == []
    for script in (ACCEL, TRAINER):
        (said,) = [r for r in fsdp_script_refusals(script, c) if "cp=2" in r]
        assert "torchtitan runs cp" in said
    assert not any("cp=" in r for r in fsdp_script_refusals(ACCEL, _config(dp=4)))
    yaml_cp = accelerate_fsdp_env(TrainingSpec(global_batch=16, seq_len=64), c, MODEL)
    assert yaml_cp["PARALLELISM_CONFIG_CP_SIZE"] == "2" and yaml_cp["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"
