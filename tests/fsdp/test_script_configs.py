"""The files Pipette writes for an FSDP script, read by the stacks' own code (issue 31): the
installed Accelerate's launcher on the emitted config YAML exports what a trial's ranks get
(``pipette.script_fsdp.accelerate_fsdp_env``); the installed transformers' ``TrainingArguments``
turn the emitted ``--fsdp --fsdp_config`` into the candidate's FSDP plugin; every key of the
emitted torchtitan TOML is a field of torchtitan's ``JobConfig``, whose section the value's type
fits. Neither Ray nor a process group: seconds."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.script_fsdp import accelerate_fsdp_env, accelerate_fsdp_yaml, torchtitan_toml, trainer_fsdp_config
from pipette.training import TrainingSpec

MODEL = ModelSpec.preset("tiny-llama")
CANDIDATES = [
    ParallelConfig(tp=1, pp=1, dp=4, mbs=2, global_batch=16, zero_stage=3),
    ParallelConfig(tp=1, pp=1, dp=4, mbs=1, global_batch=16, zero_stage=2, offload=True, recompute="full"),
    ParallelConfig(tp=1, pp=1, dp=4, mbs=2, global_batch=16, zero_stage=3, dp_shard=2),
]
IDS = ["full-shard", "shard-grad-op-offload-ac", "hsdp2x2"]


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


#: torchtitan's ``JobConfig`` (pytorch/torchtitan, torchtitan/config/job_config.py at commit
#: 000204a4a8bf3d0f31adc44fc29855fbb6ea13d8): the fields of the sections Pipette writes, with
#: their types, copied from the dataclasses ``Parallelism``, ``Training`` and ``ActivationCheckpoint``.
JOB_CONFIG: dict[str, dict[str, Any]] = {
    "parallelism": {
        "data_parallel_replicate_degree": int, "enable_compiled_autograd": bool, "data_parallel_shard_degree": int,
        "fsdp_reshard_after_forward": ("default", "always", "never"), "tensor_parallel_degree": int,
        "disable_loss_parallel": bool, "enable_async_tensor_parallel": bool, "pipeline_parallel_degree": int,
        "pipeline_parallel_split_points": list, "pipeline_parallel_layers_per_stage": int,
        "pipeline_parallel_schedule": str, "pipeline_parallel_schedule_csv": str,
        "pipeline_parallel_microbatch_size": int, "context_parallel_degree": int,
        "context_parallel_rotate_method": ("allgather", "alltoall"), "expert_parallel_degree": int,
    },
    "training": {
        "dataset": str, "dataset_path": str, "local_batch_size": int, "global_batch_size": int, "seq_len": int,
        "max_norm": float, "steps": int, "enable_cpu_offload": bool,
        "mixed_precision_param": ("bfloat16", "float32"), "mixed_precision_reduce": ("float32",), "compile": bool,
        "gc_freq": int, "gc_debug": bool, "seed": int, "deterministic": bool,
    },
    "activation_checkpoint": {
        "mode": ("selective", "full", "none"), "selective_ac_option": str,
        "per_op_sac_force_recompute_mm_shapes_by_fqns": list,
    },
}
#: torch.distributed.pipelining's schedule names torchtitan takes (``get_schedule_class``)
SCHEDULES = {"1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"}


@pytest.mark.parametrize("config", [
    *CANDIDATES,
    ParallelConfig(tp=2, pp=2, dp=1, mbs=2, global_batch=16, zero_stage=3, recompute="selective"),
    ParallelConfig(tp=1, pp=2, dp=2, mbs=1, global_batch=16, zero_stage=2, schedule="interleaved", virtual_stages=2),
    ParallelConfig(tp=1, pp=1, dp=4, mbs=2, global_batch=16, zero_stage=0),
], ids=[*IDS, "tp2-pp2-sac", "pp2-interleaved", "ddp"])
def test_every_key_of_the_torchtitan_toml_is_a_job_config_field(config: ParallelConfig) -> None:
    training = TrainingSpec(global_batch=16, seq_len=64, dtype="bf16")
    script = ScriptSpec(argv=("python", "-m", "torchtitan.train"), kind="torchtitan")
    toml = tomllib.loads(torchtitan_toml(training, config, MODEL, script))
    assert set(toml) <= set(JOB_CONFIG)
    for section, values in toml.items():
        for key, value in values.items():
            kind = JOB_CONFIG[section].get(key)
            assert kind is not None, f"[{section}] {key} is not a torchtitan JobConfig field"
            if isinstance(kind, tuple):
                assert value in kind, (section, key, value)
            else:
                assert isinstance(value, kind) and not (kind is int and isinstance(value, bool)), (section, key)
    p = toml["parallelism"]
    assert p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] * p["tensor_parallel_degree"] \
        * p["pipeline_parallel_degree"] == config.world
    assert p.get("pipeline_parallel_schedule", "1F1B") in SCHEDULES
