"""What an FSDP script takes for a candidate of the ``fsdp`` stack, in each stack's own words.

* Accelerate's FSDP2 plugin (``--script-kind accelerate-fsdp``): the config YAML of ``accelerate
  launch`` (``distributed_type: FSDP``, ``fsdp_config``) and the environment ``accelerate
  launch`` exports from it (``accelerate/utils/launch.py``, ``prepare_multi_gpu_env``, accelerate
  1.15), which a trial's ranks get directly: the plugin (``FullyShardedDataParallelPlugin``)
  reads only that environment.
* The HF Trainer (``hf-trainer`` under the ``fsdp`` stack): ``--fsdp`` and the ``--fsdp_config``
  JSON (``TrainingArguments.fsdp_config``'s keys, transformers 5.24: ``version``,
  ``reshard_after_forward``, ``cpu_offload``, ``auto_wrap_policy``,
  ``transformer_layer_cls_to_wrap``, ``activation_checkpointing``, ``state_dict_type``; the
  string form ``--fsdp "full_shard auto_wrap"`` is deprecated there and maps to the same keys).
* torchtitan (``torchtitan``): a job TOML (``torchtitan/config/job_config.py``: ``[parallelism]``,
  ``[activation_checkpoint]``, ``[training]``) over the user's own.

``zero_stage`` names the sharding (``pipette.config``): 3 reshards after forward (FULL_SHARD),
2 does not (SHARD_GRAD_OP), 0 replicates (NO_SHARD: DDP). Pure: strings and dicts only.
"""

from __future__ import annotations

import json
from typing import Any

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.script import ScriptSpec, sharded
from pipette.training import TrainingSpec

#: The Hugging Face decoder layer class FSDP wraps one unit per, by architecture (the auto wrap
#: policy's ``transformer_layer_cls_to_wrap``); an architecture not here falls back to the
#: model's ``_no_split_modules`` (Accelerate's and the Trainer's default).
DECODER_LAYER = {"llama": "LlamaDecoderLayer"}
#: Files an FSDP script's trial writes beside its ranks (the flag takes the path).
TRAINER_FSDP_CONFIG = "fsdp_config.json"


def _shard_degrees(config: ParallelConfig) -> tuple[int, int]:
    """(replicate, shard) degrees of dp: HSDP's ``dp // dp_shard`` x ``dp_shard``; NO_SHARD is
    all replicate (DDP)."""
    if not sharded(config):
        return config.dp, 1
    shard = config.dp if config.dp_shard is None else config.dp_shard
    return config.dp // shard, shard


def _mixed_precision(training: TrainingSpec) -> str:
    return training.dtype if training.dtype in ("bf16", "fp16") else "no"


# ---- Accelerate ----------------------------------------------------------------------------

def accelerate_fsdp_settings(training: TrainingSpec, config: ParallelConfig, model: ModelSpec) -> dict[str, Any]:
    """The ``fsdp_config`` block of Accelerate's config YAML (the launcher's ``--fsdp_*`` flags)."""
    out: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": config.zero_stage == 3,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_activation_checkpointing": config.recompute == "full",
        "fsdp_offload_params": config.offload,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": False,
    }
    layer = DECODER_LAYER.get(model.arch)
    if layer is not None:
        out["fsdp_transformer_layer_cls_to_wrap"] = layer
    return out


def accelerate_parallelism(config: ParallelConfig) -> dict[str, int] | None:
    """Accelerate's ``parallelism_config`` for HSDP (replicate x shard) or context parallelism
    (``cp_size``: accelerate/parallelism_config.py ``ParallelismConfig``, whose ``dp_shard_size``
    leaves cp out), None without either."""
    if config.dp_shard is None and config.cp == 1:
        return None
    replicate, shard = _shard_degrees(config)
    return {"parallelism_config_dp_replicate_size": replicate, "parallelism_config_dp_shard_size": shard,
            "parallelism_config_tp_size": 1, "parallelism_config_cp_size": config.cp}


def accelerate_fsdp_env(training: TrainingSpec, config: ParallelConfig, model: ModelSpec) -> dict[str, str]:
    """What ``accelerate launch --config_file`` exports to each rank for this config
    (``prepare_multi_gpu_env``): a trial's ranks get it without the launcher."""
    fsdp = accelerate_fsdp_settings(training, config, model)

    def flag(value: bool) -> str:
        return str(value).lower()

    env = {
        "ACCELERATE_USE_FSDP": "true",
        "ACCELERATE_MIXED_PRECISION": _mixed_precision(training),
        "FSDP_VERSION": str(fsdp["fsdp_version"]),
        "FSDP_RESHARD_AFTER_FORWARD": flag(fsdp["fsdp_reshard_after_forward"]),
        "FSDP_OFFLOAD_PARAMS": flag(fsdp["fsdp_offload_params"]),
        "FSDP_AUTO_WRAP_POLICY": fsdp["fsdp_auto_wrap_policy"],
        "FSDP_STATE_DICT_TYPE": fsdp["fsdp_state_dict_type"],
        "FSDP_ACTIVATION_CHECKPOINTING": flag(fsdp["fsdp_activation_checkpointing"]),
        "FSDP_CPU_RAM_EFFICIENT_LOADING": flag(fsdp["fsdp_cpu_ram_efficient_loading"]),
        # the launcher's defaults for what the config leaves out (accelerate/commands/launch.py's
        # flags), so a trial's ranks see what a launch's see
        "FSDP_SHARDING_STRATEGY": "FULL_SHARD",  # FSDP1's; FSDP2 reads FSDP_RESHARD_AFTER_FORWARD
        "FSDP_MIN_NUM_PARAMS": "100000000",
        "FSDP_FORWARD_PREFETCH": "false",
        "FSDP_USE_ORIG_PARAMS": "true",
        "FSDP_SYNC_MODULE_STATES": "true",
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
    }
    if "fsdp_transformer_layer_cls_to_wrap" in fsdp:
        env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = fsdp["fsdp_transformer_layer_cls_to_wrap"]
    parallel = accelerate_parallelism(config)
    if parallel is not None:
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
        env |= {k.upper(): str(v) for k, v in parallel.items()}
    return env


def accelerate_fsdp_yaml(training: TrainingSpec, config: ParallelConfig, model: ModelSpec, *, machines: int,
                         main_ip: str, use_cpu: bool) -> str:
    """Accelerate's config YAML (``accelerate launch --config_file``) for an FSDP candidate."""
    lines = [
        "# Pipette: Accelerate with FSDP2 for " + config.label,
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: FSDP",
        f"mixed_precision: '{_mixed_precision(training)}'",  # quoted: YAML reads a bare no as false
        "fsdp_config:",
        *(f"  {k}: {_yaml(v)}" for k, v in accelerate_fsdp_settings(training, config, model).items()),
    ]
    parallel = accelerate_parallelism(config)
    if parallel is not None:
        lines += ["parallelism_config:", *(f"  {k}: {v}" for k, v in parallel.items())]
    lines += [
        f"num_machines: {machines}",
        f"num_processes: {config.world}",
        "machine_rank: 0",
        f"main_process_ip: {main_ip}",
        "main_process_port: 29500",
        "rdzv_backend: static",
        "same_network: true",
        f"use_cpu: {_yaml(use_cpu)}",
        "",
    ]
    return "\n".join(lines)


def _yaml(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# ---- HF Trainer ----------------------------------------------------------------------------

def trainer_fsdp_config(training: TrainingSpec, config: ParallelConfig, model: ModelSpec) -> dict[str, Any]:
    """The Trainer's ``--fsdp_config`` JSON for a sharded candidate."""
    out: dict[str, Any] = {
        "version": 2,
        "reshard_after_forward": config.zero_stage == 3,
        "cpu_offload": config.offload,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "activation_checkpointing": config.recompute == "full",
        "state_dict_type": "SHARDED_STATE_DICT",
    }
    layer = DECODER_LAYER.get(model.arch)
    if layer is not None:
        out["transformer_layer_cls_to_wrap"] = [layer]
    return out


# ---- torchtitan ----------------------------------------------------------------------------

#: ``torch.distributed.pipelining`` schedule names as torchtitan's ``pipeline_parallel_schedule`` takes them
TORCHTITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B"}


#: torchtitan's ``activation_checkpoint`` choice (a subcommand of its command line, 0.3.0:
#: ``ActivationCheckpointing`` configs ``none``, ``full``, ``selective`` per-op SAC)
TORCHTITAN_AC = {"none": "activation-checkpoint:none", "full": "activation-checkpoint:full",
                 "selective": "activation-checkpoint:selective"}


def torchtitan_settings(training: TrainingSpec, config: ParallelConfig, model: ModelSpec) -> dict[str, dict[str, Any]]:
    """The fields of torchtitan's config (0.3.0: ``torchtitan/config/configs.py``'s
    ``ParallelismConfig`` and ``TrainingConfig``) that the candidate sets, by section."""
    c = config
    replicate, shard = _shard_degrees(c)
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": "always" if c.zero_stage == 3 else "never",
        "tensor_parallel_degree": c.tp,
        "pipeline_parallel_degree": c.pp,
    }
    if c.cp > 1:  # ring attention over cp, FSDP over dp_shard x cp (ParallelDims)
        parallelism["context_parallel_degree"] = c.cp
    if model.moe is not None:
        # ParallelismConfig's expert keys ("no effect for non-MoE models"): ep borrowed from
        # dp_shard x cp, the experts' tp either tp (Pipette's default, etp None) or 1
        parallelism["expert_parallel_degree"] = c.ep
        parallelism["expert_tensor_parallel_degree"] = c.tp if c.etp is None else c.etp
    # Without pp a rank runs mbs sequences a micro-step and accumulates (global / (mbs * dp)
    # micro-steps); with pp its local batch is the pipeline's micro-batches of mbs each.
    local = c.mbs * c.grad_accum if c.pp > 1 else c.mbs
    if c.pp > 1:
        parallelism["pipeline_parallel_schedule"] = TORCHTITAN_SCHEDULES[c.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = c.mbs
        # the decoder layers alone split over the stages, the first ``layers % stages`` one
        # heavier, as priced (torchtitan counts the embedding and the head as a layer each unless
        # told not to: ``_generate_llm_fqn_per_model_part``)
        parallelism["pipeline_parallel_first_stage_less_layers"] = 0
        parallelism["pipeline_parallel_last_stage_less_layers"] = 0
        stages = c.pp * (c.virtual_stages if c.schedule == "interleaved" else 1)
        per_stage = -(-model.layers // stages)  # torchtitan derives the stages as ceil(layers / this)
        if c.schedule == "interleaved" and -(-model.layers // per_stage) == stages:
            parallelism["pipeline_parallel_layers_per_stage"] = per_stage  # its stages per rank
    return {
        "parallelism": parallelism,
        "training": {
            "local_batch_size": local,
            "global_batch_size": c.global_batch,
            "seq_len": training.seq_len,
            "enable_cpu_offload": c.offload,
            "mixed_precision_param": "bfloat16" if training.dtype == "bf16" else "float32",
            # torchtitan 0.3.0 refuses CUDA graphs with pipeline parallelism
            "disable_cuda_graphs": c.pp > 1,
        },
    }


def torchtitan_args(training: TrainingSpec, config: ParallelConfig, model: ModelSpec) -> list[str]:
    """The candidate as torchtitan 0.3.0's command line takes it (its ``tyro`` parser, after the
    user's ``--module``/``--config``): ``--section.field value`` (a switch ``--section.field`` or
    ``--section.no-field``), then the activation checkpointing subcommand, which comes last."""
    out: list[str] = []
    for section, values in torchtitan_settings(training, config, model).items():
        for key, value in values.items():
            flag = f"--{section}.{key.replace('_', '-')}"
            if isinstance(value, bool):
                out.append(flag if value else f"--{section}.no-{key.replace('_', '-')}")
            else:
                out += [flag, str(value)]
    return [*out, TORCHTITAN_AC[config.recompute]]


# ---- one trial's files and environment -----------------------------------------------------

def fsdp_trial_parts(training: TrainingSpec, config: ParallelConfig, model: ModelSpec,
                     script: ScriptSpec) -> tuple[dict[str, str], str | None, dict[str, str]]:
    """(files, the file the ``fsdp_config`` knob names or None, environment) of an FSDP script's
    ranks for ``config``."""
    if script.kind == "accelerate-fsdp":
        return {}, None, accelerate_fsdp_env(training, config, model)
    if script.kind == "torchtitan":
        return {}, None, {}  # all on its command line (``fsdp_script_args``)
    if sharded(config):
        text = json.dumps(trainer_fsdp_config(training, config, model), indent=2) + "\n"
        return {TRAINER_FSDP_CONFIG: text}, TRAINER_FSDP_CONFIG, {}
    return {}, None, {}  # the Trainer without --fsdp: DDP


def fsdp_script_args(training: TrainingSpec, config: ParallelConfig, model: ModelSpec, script: ScriptSpec) -> list[str]:
    """What an FSDP script's command takes after its knobs for ``config``: torchtitan's settings
    (``torchtitan_args``, the subcommand last); nothing for the others (their files and environment)."""
    return torchtitan_args(training, config, model) if script.kind == "torchtitan" else []
