"""The fsdp stack's step-time terms of issue 28 (torchtitan): DTensor sequence parallelism over the
elementwise work and the FP8 casts, per-op checkpointing's recomputed all-gathers, the compile option
(``CompileTerms``), the async-tp and fp8-rowwise options (docs/stacks.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.perf import PerfModel
from pipette.stacks import FSDP, FSDP_CONSTANTS, get_stack
from pipette.training import TrainingSpec

MODEL = ModelSpec.preset("llama3-8b")
TRAIN = TrainingSpec(global_batch=64, seq_len=4096, dtype="bf16")
NODE = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9)
TP8 = ParallelConfig(tp=8, pp=1, dp=1, mbs=1, global_batch=64, zero_stage=3, recompute="selective")


def _parts(config: ParallelConfig, constants: object) -> dict[str, float]:
    return PerfModel(MODEL, TRAIN, config, NODE, constants=constants).estimate().breakdown  # type: ignore[arg-type]


def test_sequence_parallelism_splits_the_elementwise_passes_by_tp() -> None:
    replicated = replace(FSDP_CONSTANTS, sequence_parallel=False, layer_overhead_s=0.0)
    split = replace(replicated, sequence_parallel=True)
    no_passes = replace(replicated, elementwise_passes=0.0)
    elementwise = _parts(TP8, replicated)["compute"] - _parts(TP8, no_passes)["compute"]
    assert _parts(TP8, replicated)["compute"] - _parts(TP8, split)["compute"] == pytest.approx(
        elementwise * (1 - 1 / 8), rel=1e-6)
    one = replace(TP8, tp=1, dp=8)
    assert _parts(one, replicated)["compute"] == pytest.approx(_parts(one, split)["compute"])


def test_fp8_casts_run_on_the_sequence_shard_under_tp() -> None:
    fp8 = replace(FSDP_CONSTANTS, fp8_gemms=True)
    assert _parts(TP8, replace(fp8, sequence_parallel=True))["compute"] < \
        _parts(TP8, replace(fp8, sequence_parallel=False, elementwise_passes=0.0))["compute"] - 0.01


def test_per_op_checkpointing_recomputes_the_sequence_parallel_all_gathers() -> None:
    sac = _parts(TP8, FSDP_CONSTANTS)["tp_comm"]
    without = _parts(TP8, replace(FSDP_CONSTANTS, sequence_parallel=False))["tp_comm"]
    # 4 all-reduce equivalents per layer plus the two recomputed all-gathers (half an all-reduce each)
    assert sac == pytest.approx(without * (MODEL.layers * 5 + 4) / (MODEL.layers * 4 + 4), rel=1e-6)


def test_compile_terms_fuse_the_elementwise_work_and_the_fp8_casts() -> None:
    terms = FSDP.compiled
    assert terms is not None
    eager, compiled = get_stack("fsdp+fp8").constants, get_stack("fsdp+compile+fp8").constants
    assert compiled.elementwise_passes == eager.elementwise_passes * terms.elementwise_share
    assert compiled.layer_overhead_s == eager.layer_overhead_s * terms.elementwise_share
    assert compiled.fp8_casts_fused and not eager.fp8_casts_fused
    assert compiled.fp8_efficiency == terms.fp8_efficiency != eager.fp8_efficiency
    one = replace(TP8, tp=1, dp=8)
    assert _parts(one, get_stack("fsdp+compile").constants)["compute"] < _parts(one, FSDP_CONSTANTS)["compute"]
    # a stack without compile terms predicts compile as the stack without it
    assert get_stack("hf-deepspeed+compile").constants == get_stack("hf-deepspeed").constants


def test_async_tp_hides_tensor_parallel_collectives_under_the_matmuls() -> None:
    sync, overlapped = get_stack("fsdp+compile"), get_stack("fsdp+async-tp+compile")
    assert overlapped.constants.tp_overlap == FSDP.async_tp_overlap > 0 == sync.constants.tp_overlap
    assert overlapped.unmodelled_options == ()
    assert _parts(TP8, overlapped.constants)["tp_comm"] < _parts(TP8, sync.constants)["tp_comm"]
    with pytest.raises(Exception, match="async-tp"):
        get_stack("megatron+async-tp")


def test_fp8_rowwise_is_fp8_at_its_own_efficiency() -> None:
    tensorwise, rowwise = get_stack("fsdp+compile+fp8"), get_stack("fsdp+compile+fp8-rowwise")
    assert rowwise.constants.fp8_gemms and rowwise.constants.fp8_casts_fused
    assert FSDP.fp8_rowwise_efficiency is not None
    assert rowwise.constants.fp8_efficiency == FSDP.fp8_rowwise_efficiency < tensorwise.constants.fp8_efficiency
    assert rowwise.memory_options == tensorwise.memory_options and rowwise.unmodelled_options == ()
    one = replace(TP8, tp=1, dp=8)
    assert _parts(one, rowwise.constants)["compute"] > _parts(one, tensorwise.constants)["compute"]
    with pytest.raises(SpecError, match="two FP8 recipes"):
        get_stack("fsdp+fp8+fp8-rowwise")
