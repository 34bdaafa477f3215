"""The per-stack terms of the performance model (issue 28): FSDP's prefetch overlap, one gather per
unit under activation checkpointing, multi-NIC data-parallel rings, fused attention at its own
efficiency, the loss's bytes per logit, and the B200 family's curve."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.efficiency import A100_MAX_FRACTION, B200_MAX_FRACTION, default_curve, family
from pipette.model import ModelSpec
from pipette.perf import FUSED_LOSS_BYTES_PER_LOGIT, MEGATRON_CONSTANTS, PerfConstants, estimate_perf
from pipette.stacks import FSDP_A100_ATTENTION_EFFICIENCY, FSDP_CONSTANTS, get_stack
from pipette.training import TrainingSpec

MODEL = ModelSpec.preset("llama2-7b")
TRAIN = TrainingSpec(global_batch=64, seq_len=2048, dtype="bf16")
GB = 1e9
# 4 nodes of 8 H100 with 50 GB/s of NIC per GPU: FSDP's gathers cross nodes.
NODES = homogeneous_cluster("H100-80GB", 4, 8, 450 * GB, 50 * GB)
EAGER = replace(MEGATRON_CONSTANTS, flash_attention=True)


def zero3(recompute: str = "none", mbs: int = 2) -> ParallelConfig:
    return ParallelConfig(tp=1, pp=1, dp=32, mbs=mbs, global_batch=64, zero_stage=3,
                          recompute=recompute)


def test_prefetch_overlap_hides_gathers_under_compute() -> None:
    exposed = estimate_perf(MODEL, TRAIN, zero3(), NODES, constants=replace(EAGER, shard_overlap=0.0))
    hidden = estimate_perf(MODEL, TRAIN, zero3(), NODES, constants=replace(EAGER, shard_overlap=1.0))
    half = estimate_perf(MODEL, TRAIN, zero3(), NODES, constants=replace(EAGER, shard_overlap=0.5))
    assert exposed.breakdown["compute"] == hidden.breakdown["compute"]
    assert hidden.breakdown["zero3_gather"] < half.breakdown["zero3_gather"] < exposed.breakdown["zero3_gather"]
    assert hidden.step_time < half.step_time < exposed.step_time
    # with no overlap every gather and reduce-scatter is on the critical path, as the old rule had it
    old = estimate_perf(MODEL, TRAIN, zero3(), NODES, constants=EAGER)
    assert exposed.step_time == pytest.approx(old.step_time, rel=1e-9)


def test_fsdp_gathers_once_per_unit_and_pass_under_full_recompute() -> None:
    ds = replace(EAGER, recompute_regathers=True)
    fsdp = replace(EAGER, recompute_regathers=False)
    for k, gathers in ((ds, 3.0), (fsdp, 2.0)):
        none = estimate_perf(MODEL, TRAIN, zero3(), NODES, constants=k).breakdown["zero3_gather"]
        full = estimate_perf(MODEL, TRAIN, zero3("full"), NODES, constants=k).breakdown["zero3_gather"]
        assert full == pytest.approx(none * gathers / 2.0, rel=1e-6)


def test_data_parallel_rings_across_nodes_use_every_nic_of_a_node() -> None:
    one_link = estimate_perf(MODEL, TRAIN, zero3(), NODES, constants=EAGER)
    every_nic = estimate_perf(MODEL, TRAIN, zero3(), NODES, constants=replace(EAGER, dp_cut_fraction=1.0))
    assert every_nic.breakdown["zero3_gather"] < one_link.breakdown["zero3_gather"] / 4
    # inside one node nothing changes: the ring already runs on NVLink
    node = homogeneous_cluster("H100-80GB", 1, 8, 450 * GB, 50 * GB)
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=64, zero_stage=3)
    assert estimate_perf(MODEL, TRAIN, cfg, node, constants=EAGER).step_time == pytest.approx(
        estimate_perf(MODEL, TRAIN, cfg, node, constants=replace(EAGER, dp_cut_fraction=1.0)).step_time)


def test_fused_attention_at_its_own_efficiency_dominates_long_sequences() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, global_batch=8)
    node = homogeneous_cluster("H100-80GB", 1, 8, 450 * GB, 50 * GB)
    times = {}
    for seq in (2048, 32768):
        tr = TrainingSpec(global_batch=8, seq_len=seq, dtype="bf16")
        model = replace(MODEL, max_seq=seq)
        curve = estimate_perf(model, tr, cfg, node, constants=EAGER).breakdown["compute"]
        slow = estimate_perf(model, tr, cfg, node, constants=replace(EAGER, attention_efficiency=0.05))
        times[seq] = slow.breakdown["compute"] / curve
    # a slower attention kernel costs more where attention is a larger share of the FLOPs
    assert 1.0 < times[2048] < times[32768]


def test_a_fused_loss_touches_fewer_bytes() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=4, global_batch=64)
    node = homogeneous_cluster("H100-80GB", 1, 8, 450 * GB, 50 * GB)
    eager = estimate_perf(MODEL, TRAIN, cfg, node, constants=EAGER)
    fused = estimate_perf(MODEL, TRAIN, cfg, node,
                          constants=replace(EAGER, loss_bytes_per_logit=FUSED_LOSS_BYTES_PER_LOGIT))
    assert fused.breakdown["compute"] < eager.breakdown["compute"]


def test_b200_has_its_own_family_and_curve() -> None:
    b200 = DeviceSpec.preset("b200-180gb")
    assert family(b200) == "b200"
    assert default_curve(b200).max_fraction == B200_MAX_FRACTION != A100_MAX_FRACTION


def test_the_fsdp_stack_prices_with_its_own_terms() -> None:
    k = get_stack("fsdp").constants
    assert k is FSDP_CONSTANTS
    assert k.shard_overlap is not None and 0.0 < k.shard_overlap <= 1.0
    assert not k.recompute_regathers and k.flash_attention and k.attention_efficiency > 0
    # the other stacks keep the rule their constants were fitted with
    for name in ("pipette", "megatron"):
        other: PerfConstants = get_stack(name).constants
        assert other.shard_overlap is None and other.recompute_regathers and other.dp_cut_fraction is None


def test_fp8_runs_the_linear_layers_at_the_fp8_peak_where_the_device_has_one() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=4, global_batch=64)
    h100 = homogeneous_cluster("H100-80GB", 1, 8, 450 * GB, 50 * GB)
    a100 = homogeneous_cluster("A100-80GB", 1, 8, 300 * GB, 25 * GB)
    bf16, fp8 = get_stack("fsdp"), get_stack("fsdp+fp8")
    assert fp8.constants.fp8_gemms and not bf16.constants.fp8_gemms and fp8.options_note is None
    fast = estimate_perf(MODEL, TRAIN, cfg, h100, stack=fp8).breakdown["compute"]
    slow = estimate_perf(MODEL, TRAIN, cfg, h100, stack=bf16).breakdown["compute"]
    assert 1.2 * fast < slow < 2.0 * fast  # the linear layers only, not attention, loss or norms
    # an A100 has no FP8 tensor cores: the option changes nothing there
    assert estimate_perf(MODEL, TRAIN, cfg, a100, stack=fp8).step_time \
        == estimate_perf(MODEL, TRAIN, cfg, a100, stack=bf16).step_time
    note = get_stack("hf-deepspeed+compile").options_note
    assert note == "compile: not modelled yet: predicted as the stack without it"
    assert get_stack("fsdp+compile").options_note is None  # priced since issue 28 (CompileTerms)


def test_per_op_selective_checkpointing_recomputes_matmuls_and_elementwise_ops() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=64, recompute="selective")
    none = replace(cfg, recompute="none")
    node = homogeneous_cluster("H100-80GB", 1, 8, 450 * GB, 50 * GB)
    korthikanti = replace(EAGER, attention_efficiency=0.2)
    op_sac = replace(korthikanti, op_sac_linear_share=0.5)
    t = {name: estimate_perf(MODEL, TRAIN, c, node, constants=k).breakdown["compute"]
         for name, c, k in (("none", none, korthikanti), ("attn", cfg, korthikanti), ("op", cfg, op_sac))}
    assert t["none"] < t["attn"] < t["op"]
    full = estimate_perf(MODEL, TRAIN, replace(cfg, recompute="full"), node, constants=op_sac).breakdown["compute"]
    assert t["op"] < full


def test_the_fsdp_attention_efficiency_is_the_devices_not_the_h100s_carried_over() -> None:
    """FlashAttention-2 fills an A100's peak further than an H100's: the fsdp stack's attention
    efficiency fitted on H100 runs (0.181) is carried to A100s scaled by the kernel's published
    utilization on each (0.318); the H100 family keeps the fitted value."""
    model = ModelSpec.preset("llama3-8b")
    train = TrainingSpec(global_batch=16, seq_len=8192)
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=2, global_batch=16, zero_stage=3, recompute="none")
    times = {}
    for device in ("A100-80GB", "H100-80GB"):
        cluster = homogeneous_cluster(device, 1, 8, 300e9, 25e9, name="one-node")
        for eff in (FSDP_CONSTANTS.attention_efficiency, FSDP_A100_ATTENTION_EFFICIENCY):
            k = replace(FSDP_CONSTANTS, attention_efficiency=eff, attention_efficiencies=())
            times[device, eff] = estimate_perf(model, train, cfg, cluster, constants=k).step_time
        times[device, "stack"] = estimate_perf(model, train, cfg, cluster, stack="fsdp").step_time
    assert times["A100-80GB", "stack"] == times["A100-80GB", FSDP_A100_ATTENTION_EFFICIENCY]
    assert times["A100-80GB", "stack"] < times["A100-80GB", FSDP_CONSTANTS.attention_efficiency]
    assert times["H100-80GB", "stack"] == times["H100-80GB", FSDP_CONSTANTS.attention_efficiency]
