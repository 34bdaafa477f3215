"""The files Pipette writes for an FSDP script, read by the stacks' own code (issue 31): the
installed Accelerate's launcher on the emitted config YAML exports what a trial's ranks get
(``pipette.script_fsdp.accelerate_fsdp_env``); the installed transformers' ``TrainingArguments``
turn the emitted ``--fsdp --fsdp_config`` into the candidate's FSDP plugin; every key of the
torchtitan flags are fields of torchtitan 0.3.0's config, and where torchtitan is installed its own
parser reads them. Neither Ray nor a process group: seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.script_fsdp import accelerate_fsdp_env, accelerate_fsdp_yaml, trainer_fsdp_config
from pipette.training import TrainingSpec

MODEL = ModelSpec.preset("tiny-llama")
CANDIDATES = [
    ParallelConfig(tp=1, pp=1, dp=4, mbs=2, global_batch=16, zero_stage=3),
    ParallelConfig(tp=1, pp=1, dp=4, mbs=1, global_batch=16, zero_stage=2, offload=True, recompute="full"),
    ParallelConfig(tp=1, pp=1, dp=4, mbs=2, global_batch=16, zero_stage=3, dp_shard=2),
    ParallelConfig(tp=1, pp=1, dp=2, cp=2, mbs=2, global_batch=16, zero_stage=3),
]
IDS = ["full-shard", "shard-grad-op-offload-ac", "hsdp2x2", "cp2"]


@pytest.mark.parametrize("config", CANDIDATES, ids=IDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_accelerate_launch_exports_what_a_trial_gives_the_ranks(tmp_path: Path, config: ParallelConfig,
                                                                  dtype: str) -> None:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    training = TrainingSpec(global_batch=16, seq_len=64, dtype=dtype)
    path = tmp_path / "accelerate_config.yaml"
    path.write_text(accelerate_fsdp_yaml(training, config, MODEL, machines=1, main_ip="127.0.0.1", use_cpu=True))
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.num_processes == config.world
    theirs = prepare_multi_gpu_env(args)
    ours = accelerate_fsdp_env(training, config, MODEL)
    assert {k: theirs.get(k) for k in ours} == ours
    assert {k for k in theirs if k.startswith("FSDP_")} <= set(ours)  # every FSDP setting the launch makes


@pytest.mark.parametrize("config", CANDIDATES[:2], ids=IDS[:2])
def test_the_trainer_reads_the_emitted_fsdp_flags_into_the_candidates_plugin(tmp_path: Path,
                                                                              config: ParallelConfig) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    training = TrainingSpec(global_batch=16, seq_len=64, dtype="fp32")
    script = ScriptSpec(argv=("python", "train.py"), kind="hf-trainer", fsdp=True)
    path = tmp_path / "fsdp_config.json"
    path.write_text(json.dumps(trainer_fsdp_config(training, config, MODEL)))
    argv = script.command(training, config, "", steps=5, fsdp_config_path=str(path))
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [*argv[2:], "--output_dir", str(tmp_path / "out")])
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2
    assert plugin["reshard_after_forward"] is (config.zero_stage == 3)
    assert plugin.get("cpu_offload", False) is config.offload
    assert plugin.get("activation_checkpointing", False) is (config.recompute == "full")
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    assert args.per_device_train_batch_size == config.mbs and args.gradient_accumulation_steps == config.grad_accum


#: torchtitan 0.3.0's config (PyPI torchtitan==0.3.0, torchtitan/config/configs.py): the fields of
#: the sections Pipette sets, with their types (``ParallelismConfig``, ``TrainingConfig``), and the
#: activation checkpointing subcommands its ``tyro`` parser takes (``torchtitan.train --help``).
CONFIG_0_3: dict[str, dict[str, Any]] = {
    "parallelism": {
        "data_parallel_replicate_degree": int, "data_parallel_shard_degree": int,
        "fsdp_reshard_after_forward": ("default", "always", "never"), "tensor_parallel_degree": int,
        "pipeline_parallel_degree": int, "pipeline_parallel_first_stage_less_layers": int,
        "pipeline_parallel_last_stage_less_layers": int, "pipeline_parallel_layers_per_stage": int,
        "pipeline_parallel_schedule": str, "pipeline_parallel_microbatch_size": int, "context_parallel_degree": int,
        "expert_parallel_degree": int, "expert_tensor_parallel_degree": int,
    },
    "training": {
        "local_batch_size": int, "global_batch_size": int, "seq_len": int, "max_norm": float, "steps": int,
        "enable_cpu_offload": bool, "disable_cuda_graphs": bool, "dtype": ("bfloat16", "float32"),
        "mixed_precision_param": ("bfloat16", "float32"), "mixed_precision_reduce": ("float32",),
    },
}
AC_SUBCOMMANDS = {"activation-checkpoint:selective", "activation-checkpoint:full",
                  "activation-checkpoint:memory-budget", "activation-checkpoint:none"}
#: torch.distributed.pipelining's schedule names torchtitan takes (``get_schedule_class``)
SCHEDULES = {"1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"}
TITAN = ScriptSpec(argv=("python", "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel"),
                   kind="torchtitan")
TITAN_CANDIDATES = [
    *CANDIDATES,
    ParallelConfig(tp=2, pp=2, dp=1, mbs=2, global_batch=16, zero_stage=3, recompute="selective"),
    ParallelConfig(tp=1, pp=2, dp=2, mbs=1, global_batch=16, zero_stage=2, schedule="interleaved", virtual_stages=2),
    ParallelConfig(tp=1, pp=1, dp=4, mbs=2, global_batch=16, zero_stage=0),
]
TITAN_IDS = [*IDS, "tp2-pp2-sac", "pp2-interleaved", "ddp"]


def _flags(args: list[str]) -> dict[str, Any]:
    """``--section.field value`` / ``--section.field`` / ``--section.no-field`` as {(section, field): value}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args) and args[i].startswith("--"):
        section, _, name = args[i][2:].partition(".")
        name = name.replace("-", "_")
        if i + 1 < len(args) and not args[i + 1].startswith("--") and not args[i + 1].startswith("activation-"):
            out[(section, name)] = args[i + 1]
            i += 2
        else:
            out[(section, name.removeprefix("no_"))] = not name.startswith("no_")
            i += 1
    assert args[i:] == [args[-1]], f"only the subcommand follows the options: {args[i:]}"
    return out


@pytest.mark.parametrize("config", TITAN_CANDIDATES, ids=TITAN_IDS)
def test_every_flag_of_a_torchtitan_trial_is_a_0_3_config_field(config: ParallelConfig) -> None:
    """Issue 43, item 31: the emitted ``--job.config_file`` was refused by torchtitan 0.3.0 ("--module
    is required"); 0.3 takes ``--module``/``--config`` and ``--section.field`` flags."""
    from pipette.script_fsdp import torchtitan_args

    training = TrainingSpec(global_batch=16, seq_len=64, dtype="bf16")
    args = torchtitan_args(training, config, MODEL)
    assert args[-1] in AC_SUBCOMMANDS
    flags = _flags(args)
    for (section, name), value in flags.items():
        kind = CONFIG_0_3[section].get(name)
        assert kind is not None, f"--{section}.{name} is not a torchtitan 0.3.0 config field"
        if isinstance(kind, tuple):
            assert value in kind, (section, name, value)
        elif kind is bool:
            assert isinstance(value, bool), (section, name, value)
        else:
            kind(value)  # parses as its type
    p = {name: int(v) for (section, name), v in flags.items() if section == "parallelism" and name.endswith("degree")}
    assert p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] * p["tensor_parallel_degree"] \
        * p["pipeline_parallel_degree"] * p.get("context_parallel_degree", 1) == config.world
    assert ("context_parallel_degree" in p) is (config.cp > 1)  # cp = 1: the flags as before cp existed
    assert flags.get(("parallelism", "pipeline_parallel_schedule"), "1F1B") in SCHEDULES


@pytest.mark.parametrize("config", [
    ParallelConfig(tp=1, pp=1, dp=4, ep=2, mbs=2, global_batch=16, zero_stage=3),
    ParallelConfig(tp=1, pp=2, dp=2, ep=2, mbs=1, global_batch=16, zero_stage=2, dp_shard=2),
], ids=["ep2xdp4", "pp2-ep2"])
def test_an_moe_candidates_torchtitan_flags_name_its_expert_degrees(config: ParallelConfig) -> None:
    """An MoE model's candidate: ``expert_parallel_degree`` and ``expert_tensor_parallel_degree``
    (0.3.0's ``ParallelismConfig``), each a field; a dense model's flags have neither."""
    from pipette.script_fsdp import torchtitan_args

    training = TrainingSpec(global_batch=16, seq_len=64, dtype="bf16")
    flags = _flags(torchtitan_args(training, config, ModelSpec.preset("tiny-moe")))
    assert all(key[1] in CONFIG_0_3[key[0]] for key in flags), sorted(flags)
    assert int(flags[("parallelism", "expert_parallel_degree")]) == config.ep
    assert int(flags[("parallelism", "expert_tensor_parallel_degree")]) == config.tp
    dense = _flags(torchtitan_args(training, ParallelConfig(tp=1, pp=1, dp=4, mbs=2, global_batch=16,
                                                            zero_stage=3), MODEL))
    assert not any(name.startswith("expert_") for _, name in dense)


@pytest.mark.parametrize("config", TITAN_CANDIDATES, ids=TITAN_IDS)
def test_torchtitans_own_parser_reads_the_command_a_trial_runs(config: ParallelConfig) -> None:
    """Where torchtitan is installed: its ``ConfigManager`` (what ``python -m torchtitan.train``
    parses with) reads the trial's command into the candidate's config."""
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    from pipette.script_fsdp import torchtitan_args

    training = TrainingSpec(global_batch=16, seq_len=64, dtype="bf16")
    argv = [*TITAN.command(training, config, "", steps=5), *torchtitan_args(training, config, MODEL)]
    job = ConfigManager().parse_args(argv[3:])
    assert job.training.steps == 5 and job.training.global_batch_size == 16
    assert job.parallelism.tensor_parallel_degree == config.tp and job.parallelism.pipeline_parallel_degree == config.pp
    assert job.parallelism.context_parallel_degree == config.cp
    assert type(job.activation_checkpoint).__qualname__.split(".")[0] == \
        {"none": "NoneType", "full": "FullAC", "selective": "SelectiveAC"}[config.recompute]
