"""An MoE candidate's launch files (issue 47): Megatron-LM's MoE arguments (``moe_arguments``), with
the model's experts, ep and etp, the all-to-all dispatcher, grouped GEMMs and a capacity factor
where the model sets one; the megatron stack's ``megatron_args.txt`` carries them; and the script
kinds that cannot take an expert-parallel layout say so in one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.emit import write_launch_files
from pipette.emit_frameworks import megatron_arguments
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec

QWEN = ModelSpec.preset("qwen3-30b-a3b")
DEEPSEEK = ModelSpec.preset("deepseek-v3")
TRAINING = TrainingSpec(global_batch=64, seq_len=4096)
#: the MoE arguments of Megatron-LM's ``_add_moe_args`` and ``_add_distributed_args``
#: (megatron/training/arguments.py) that Pipette may write
MEGATRON_MOE_FLAGS = {
    "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-shared-expert-intermediate-size",
    "--moe-router-score-function", "--moe-router-num-groups", "--moe-router-group-topk",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--moe-token-dispatcher-type",
    "--moe-grouped-gemm", "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity",
    "--moe-flex-dispatcher-backend",  # TransformerConfig.moe_flex_dispatcher_backend: deepep | hybridep
}


def _flags(args: list[str]) -> dict[str, str]:
    return {a.split()[0]: (a.split()[1] if " " in a else "") for a in args}


def test_megatron_gets_the_experts_and_their_degrees() -> None:
    cfg = ParallelConfig(tp=2, pp=1, dp=8, ep=8, etp=1, mbs=1, global_batch=64, zero_stage=1)
    flags = _flags(megatron_arguments(TRAINING, cfg, QWEN.layers, moe=QWEN.moe))
    moe = {k: v for k, v in flags.items() if k in MEGATRON_MOE_FLAGS}
    assert moe == {"--num-experts": "128", "--moe-ffn-hidden-size": "768", "--moe-router-topk": "8",
                   "--expert-model-parallel-size": "8", "--expert-tensor-parallel-size": "1",
                   "--moe-token-dispatcher-type": "alltoall", "--moe-grouped-gemm": ""}
    assert set(flags) - MEGATRON_MOE_FLAGS == set(_flags(megatron_arguments(TRAINING, cfg, QWEN.layers)))
    # etp left out is Megatron-Core's default, tp: written either way
    tp = _flags(megatron_arguments(TRAINING, replace(cfg, etp=None), QWEN.layers, moe=QWEN.moe))
    assert tp["--expert-tensor-parallel-size"] == "2"


def test_deepseeks_routing_and_capacity_are_said_where_the_model_has_them() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=16, ep=16, mbs=1, global_batch=64, zero_stage=1)
    assert DEEPSEEK.moe is not None and QWEN.moe is not None
    flags = _flags(megatron_arguments(TRAINING, cfg, DEEPSEEK.layers, moe=DEEPSEEK.moe))
    assert flags["--moe-router-score-function"] == "sigmoid" and flags["--moe-router-num-groups"] == "8"
    assert flags["--moe-router-group-topk"] == "4" and flags["--moe-shared-expert-intermediate-size"] == "2048"
    assert "--moe-expert-capacity-factor" not in flags  # dropless: Megatron's default
    capped = replace(QWEN.moe, capacity_factor=1.25)
    assert _flags(megatron_arguments(TRAINING, cfg, QWEN.layers, moe=capped))["--moe-expert-capacity-factor"] == "1.25"


def test_the_megatron_stacks_args_file_carries_the_moe_flags(tmp_path: Path) -> None:
    cluster = homogeneous_cluster("H100-80GB", 2, 8, 450e9, 50e9)
    cfg = ParallelConfig(tp=1, pp=1, dp=16, ep=8, mbs=1, global_batch=64, zero_stage=1)
    files = write_launch_files(tmp_path, DEEPSEEK, TRAINING, cfg, cluster, stack="megatron")
    lines = files["megatron_args.txt"].read_text().splitlines()
    args = [line for line in lines if line and not line.startswith("#")]
    assert all(a.startswith("--") for a in args)  # what `grep -v '^#'` hands pretrain_gpt.py
    assert "--expert-model-parallel-size 8" in args and "--num-experts 256" in args
    note = [line for line in lines if "--moe-layer-freq" in line]
    assert len(note) == 1 and note[0].startswith("# MoE: layers [0, 1, 2] are dense") and '"[0, 0, 0, 1,' in note[0]


def test_script_kinds_without_expert_parallelism_say_so_in_one_line() -> None:
    training = TrainingSpec(global_batch=16, seq_len=64)
    cfg = ParallelConfig(tp=1, pp=1, dp=4, ep=2, mbs=2, global_batch=16, zero_stage=3)
    for kind, words in (("accelerate-fsdp", "ep=2: accelerate-fsdp has no expert parallelism"),
                        ("deepspeed", "ep=2: a DeepSpeed script's expert groups are its model code's")):
        said = ScriptSpec(argv=("python", "t.py"), kind=kind).refusals(training, cfg)
        assert any(words in r for r in said) and all("\n" not in r for r in said), said
    titan = ScriptSpec(argv=("python", "train.py"), kind="torchtitan")
    assert titan.refusals(training, cfg) == []
    assert ScriptSpec(argv=("python", "t.py"), kind="accelerate-fsdp").refusals(training, replace(cfg, ep=1)) == []
