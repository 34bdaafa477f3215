"""What a Megatron-LM or nanotron user pastes into their job (pipette.emit_frameworks): the
framework's own argument and key names, with the candidate's degrees, batch, schedule,
recomputation and precision, and nothing the candidate does not decide."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipette.cluster import ClusterProfile
from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.emit import write_launch_files
from pipette.emit_frameworks import megatron_arguments, nanotron_config
from pipette.model import ModelSpec
from pipette.stacks import get_stack
from pipette.training import LoraSpec, TrainingSpec

MODEL = ModelSpec.preset("llama3-8b")
TRAINING = TrainingSpec(global_batch=128, seq_len=4096)
H100S = homogeneous_cluster("H100-80GB", 2, 8, 450e9, 50e9)
A100S = homogeneous_cluster("A100-80GB", 2, 8, 300e9, 25e9)
#: ``ParallelismArgs``, ``TokensArgs`` and ``OptimizerArgs`` fields of nanotron's config
#: (nanotron/config/parallelism_config.py, config.py): the keys the file may set.
NANOTRON_KEYS = {
    "parallelism": {"dp", "pp", "tp", "pp_engine", "tp_mode", "tp_linear_async_communication", "recompute_layer",
                    "moe_layer_recompute", "tp_recompute_allgather", "expert_parallel_size", "context_parallel_size"},
    "tokens": {"sequence_length", "train_steps", "micro_batch_size", "batch_accumulation_per_replica",
               "val_check_interval", "limit_val_batches", "limit_test_batches"},
    "optimizer": {"zero_stage", "accumulate_grad_in_fp32", "clip_grad", "weight_decay", "optimizer_factory",
                  "learning_rate_scheduler"},
}


def _flags(args: list[str]) -> dict[str, str]:
    return {a.split()[0]: (a.split()[1] if " " in a else "") for a in args}


def test_megatron_arguments_say_the_candidates_layout_in_megatrons_flags() -> None:
    cfg = ParallelConfig(tp=2, pp=2, dp=4, mbs=2, global_batch=128, zero_stage=1, recompute="full",
                         schedule="interleaved", virtual_stages=2)
    flags = _flags(megatron_arguments(TRAINING, cfg, MODEL.layers))
    assert flags == {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
                     "--micro-batch-size": "2", "--global-batch-size": "128", "--seq-length": "4096",
                     "--sequence-parallel": "", "--use-distributed-optimizer": "",
                     "--num-layers-per-virtual-pipeline-stage": "8",  # 32 layers / (pp 2 x 2 chunks)
                     "--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": "1",
                     "--bf16": ""}
    plain = _flags(megatron_arguments(TRAINING, ParallelConfig(tp=1, pp=1, dp=16, mbs=1, global_batch=128,
                                                               zero_stage=0, recompute="selective"), MODEL.layers))
    assert "--sequence-parallel" not in plain and "--use-distributed-optimizer" not in plain  # tp 1, ZeRO-0
    assert plain["--recompute-granularity"] == "selective" and "--recompute-method" not in plain


def test_megatron_and_nanotron_say_cp_only_above_1() -> None:
    """Megatron-LM's ``--context-parallel-size`` (megatron/training/arguments.py) and nanotron's
    ``ParallelismArgs.context_parallel_size``, written only for cp > 1: a cp = 1 file is as before."""
    cp2 = ParallelConfig(tp=2, pp=1, dp=4, cp=2, mbs=1, global_batch=128)
    assert _flags(megatron_arguments(TRAINING, cp2, MODEL.layers))["--context-parallel-size"] == "2"
    assert "  context_parallel_size: 2" in nanotron_config(TRAINING, cp2, "h").splitlines()
    cp1 = ParallelConfig(tp=2, pp=1, dp=4, mbs=1, global_batch=128)
    assert "--context-parallel-size" not in _flags(megatron_arguments(TRAINING, cp1, MODEL.layers))
    assert "context_parallel_size" not in nanotron_config(TRAINING, cp1, "h")


@pytest.mark.parametrize(("cluster", "fp8"), [(H100S, True), (A100S, False)])
def test_megatron_fp8_flags_only_where_the_device_has_fp8(tmp_path: Path, cluster: ClusterProfile, fp8: bool) -> None:
    cfg = ParallelConfig(tp=4, pp=1, dp=4, mbs=1, global_batch=128, zero_stage=1)
    files = write_launch_files(tmp_path, MODEL, TRAINING, cfg, cluster, stack="megatron+fp8")
    text = files["megatron_args.txt"].read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# Pipette: tp4-pp1-dp4-mbs1-z1") and "stack megatron+fp8." in lines[0]
    args = [line for line in lines if line and not line.startswith("#")]
    assert all(a.startswith("--") for a in args)  # what `grep -v '^#'` hands pretrain_gpt.py
    assert ("--fp8-format hybrid" in args) is fp8 and ("--fp8-param-gather" in args) is fp8


@pytest.mark.parametrize("stack", ["megatron", "megatron+te", "megatron+fp8"])
@pytest.mark.parametrize("tp", [1, 4])
def test_transformer_engine_and_its_tp_overlap_are_written_where_priced(tmp_path: Path, stack: str, tp: int) -> None:
    """``megatron+te`` and the FP8 recipes are priced with Transformer Engine's layers and the TP
    communication overlapped (``tp_overlap`` 1): their file asks for both (the overlap only with tp, where
    Megatron-LM allows it); ``megatron`` alone, priced as unfused Megatron, asks for neither."""
    cfg = ParallelConfig(tp=tp, pp=1, dp=16 // tp, mbs=1, global_batch=128, zero_stage=1)
    files = write_launch_files(tmp_path, MODEL, TRAINING, cfg, H100S, stack=stack)
    flags = _flags([a for a in files["megatron_args.txt"].read_text().splitlines() if a and not a.startswith("#")])
    priced = get_stack(stack).constants
    te = stack != "megatron"
    assert (flags.get("--transformer-impl") == "transformer_engine") is te
    assert ("--tp-comm-overlap" in flags) is (te and tp > 1) is (priced.tp_overlap == 1.0 and tp > 1)
    assert ("--sequence-parallel" in flags) is (tp > 1)


B200S = homogeneous_cluster("B200-180GB", 2, 8, 900e9, 50e9)
#: Megatron-LM's choices (megatron/training/arguments.py): --fp8-format {e4m3,hybrid},
#: --fp8-recipe {tensorwise,delayed,mxfp8,blockwise}, --fp4-format {e2m1}, --fp4-recipe {nvfp4}
RECIPE_FLAGS = {
    "megatron+mxfp8": {"--fp8-format": "e4m3", "--fp8-recipe": "mxfp8", "--fp8-param-gather": ""},
    "megatron+nvfp4": {"--fp4-format": "e2m1", "--fp4-recipe": "nvfp4"},
}


@pytest.mark.parametrize("stack", sorted(RECIPE_FLAGS))
@pytest.mark.parametrize(("cluster", "blackwell"), [(B200S, True), (H100S, False)])
def test_megatron_block_scaled_recipes_name_their_format_and_recipe(
        tmp_path: Path, stack: str, cluster: ClusterProfile, blackwell: bool) -> None:
    cfg = ParallelConfig(tp=2, pp=1, dp=8, mbs=1, global_batch=128, zero_stage=1)
    files = write_launch_files(tmp_path, MODEL, TRAINING, cfg, cluster, stack=stack)
    flags = _flags([a for a in files["megatron_args.txt"].read_text().splitlines() if a and not a.startswith("#")])
    precision = {k: v for k, v in flags.items() if k.startswith(("--fp8", "--fp4"))}
    # MXFP8 and NVFP4 are Blackwell's block-scaled formats: on an H100 the file asks for neither
    assert precision == (RECIPE_FLAGS[stack] if blackwell else {})


def test_megatron_lora_says_nemo_takes_the_same_layout() -> None:
    from pipette.emit_frameworks import megatron_args_file

    lora = TrainingSpec(global_batch=8, seq_len=8192, method="lora", lora=LoraSpec(rank=16))
    text = megatron_args_file(lora, ParallelConfig(tp=4, pp=1, dp=2, mbs=1, global_batch=8, zero_stage=1),
                              80, "header")
    assert "NeMo's PEFT" in text


def test_nanotron_config_has_nanotrons_keys_and_its_global_batch() -> None:
    cfg = ParallelConfig(tp=2, pp=4, dp=2, mbs=2, global_batch=128, zero_stage=1, recompute="full")
    doc = yaml.safe_load(nanotron_config(TRAINING, cfg, "header"))
    for section, keys in doc.items():
        assert set(keys) <= NANOTRON_KEYS[section], section
    p, t, o = doc["parallelism"], doc["tokens"], doc["optimizer"]
    assert (p["dp"], p["pp"], p["tp"]) == (2, 4, 2)
    # what the nanotron stack's memory estimate assumes, where nanotron's defaults differ
    assert p["pp_engine"] == "1f1b" and p["tp_mode"] == "REDUCE_SCATTER" and p["tp_recompute_allgather"] is True
    assert p["recompute_layer"] is True and p["tp_linear_async_communication"] is True
    # nanotron's global batch: micro_batch_size x batch_accumulation_per_replica x dp (Config.global_batch_size)
    assert t["micro_batch_size"] * t["batch_accumulation_per_replica"] * p["dp"] == cfg.global_batch
    assert t["sequence_length"] == TRAINING.seq_len
    assert o == {"zero_stage": 1, "accumulate_grad_in_fp32": True}
