"""The MoE step-time terms read from the frameworks' sources (issue 47): the host-bound floor only
where the host waits for the tokens per expert (dropless routing, or DeepEP's dispatch), a layout kept
once over releases, a recomputed MoE layer, the NVL72 Slurm segments of Megatron-Bridge's runs,
and the recipe each Megatron-Bridge MoE row ran."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette import perf_moe
from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.model import MODEL_PRESETS, ModelSpec
from pipette.perf import estimate_perf
from pipette.perf_constants import MEGATRON_CONSTANTS
from pipette.training import TrainingSpec
from tests.benchmarks.calibration import _bridge_cluster, calibration_dir
from tests.benchmarks.moe_rows import bridge_recipe, load_bridge_moe

QWEN = MODEL_PRESETS["qwen3-30b-a3b"]
TRAINING = TrainingSpec(global_batch=64, seq_len=4096)
CONFIG = ParallelConfig(tp=1, pp=1, dp=8, ep=8, mbs=1, global_batch=64)
CLUSTER = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9, name="h8")


def _step(model: ModelSpec, moe: perf_moe.MoeConstants, config: ParallelConfig = CONFIG) -> float:
    k = replace(MEGATRON_CONSTANTS, moe=moe)
    return estimate_perf(model, TRAINING, config, CLUSTER, constants=k).step_time


def test_only_dropless_routing_waits_on_the_host() -> None:
    """Megatron-Core's all-to-all dispatcher syncs with the host for the splits only when dropless; a
    capacity factor (drop and pad) sizes everything on the device."""
    slow_host = replace(perf_moe.DEFAULT_MOE, layer_host_s=1.0)
    dropless = _step(QWEN, slow_host)
    assert dropless >= 48 * 8 * 1.0  # 48 MoE layers, 8 micro-batches, at least 1 s each
    assert QWEN.moe is not None
    capped = replace(QWEN, moe=replace(QWEN.moe, capacity_factor=1.0))
    assert _step(capped, slow_host) == pytest.approx(_step(capped, perf_moe.DEFAULT_MOE), rel=1e-12)


def test_deepep_waits_on_the_host_with_a_capacity_factor_too() -> None:
    """DeepEP's dispatch sizes the experts' GEMMs from a host list even when tokens are dropped and
    padded; only the all-to-all dispatcher runs ahead of the host then."""
    assert QWEN.moe is not None
    capped = replace(QWEN, moe=replace(QWEN.moe, capacity_factor=1.0))
    flex = replace(CONFIG, dispatcher="flex")
    slow = _step(capped, replace(perf_moe.DEFAULT_MOE, layer_host_s=1.0), flex)
    assert slow >= 48 * 8 * 1.0
    assert slow > 2.0 * _step(capped, perf_moe.DEFAULT_MOE, flex)
    assert perf_moe.host_floor(True, None, replace(perf_moe.DEFAULT_MOE, layer_host_s=1.0)) == 0.0
    assert perf_moe.host_floor(True, "flex", replace(perf_moe.DEFAULT_MOE, layer_host_s=1.0)) == 1.0


def test_a_layout_is_kept_once_whatever_its_precision_is_spelt() -> None:
    """25.11's "FP8-MX" is 26.x's "MXFP8": Qwen3-30B-A3B on 8 GB200 at micro-batch 4 is kept from
    26.08 only, not again from 25.11."""
    ids = {r.row_id for r in load_bridge_moe(calibration_dir()).rows}
    assert "mb:26.08:DGX-GB200:Qwen3_30B_a3B:MXFP8:pretrain:main" in ids
    assert "mb:25.11:DGX-GB200:Qwen3_30B_a3B:FP8-MX:pretrain:main" not in ids
    assert "mb:25.11:DGX-GB300:Qwen3_30B_a3B:FP8-MX:pretrain:main" in ids  # micro-batch 4: no 26.x row


def test_the_moe_terms_fit_the_current_release_line_and_keep_the_older_aside() -> None:
    """A release is part of the stack for MoE (tests/benchmarks/moe_fit.py): the fit's rows are Megatron-Bridge's
    26.x rows (B300's among them) and SimuMax's; the 25.x rows are only priced, by that fit, as rows kept aside;
    the BF16 recipe's rows are priced by ``megatron+te`` (Transformer Engine in bf16)."""
    from tests.benchmarks.moe_fit import rows

    current, older, every = rows("current"), rows("older"), rows("all")
    assert sorted(r.row_id for r in current + older) == sorted(r.row_id for r in every)
    assert all(r.row_id.startswith("mb:26.") for r in current if r.source == "megatron_bridge")
    assert {r.source for r in current} == {"megatron_bridge", "simumax"}
    assert older and all(r.row_id.startswith("mb:25.") for r in older)
    assert any("B300" in r.row_id for r in current)
    assert {r.stack for r in every if ":BF16:" in r.row_id} == {"megatron+te"}


def test_a_recomputed_moe_layer_runs_its_forward_again_in_the_backward() -> None:
    def times(k: perf_moe.MoeConstants) -> tuple[float, float, float, float]:
        return perf_moe.layer_times(
            QWEN,
            TRAINING,
            CONFIG,
            gemm=lambda f: f / 400e12,
            grouped_peak=989e12,
            large=0.6,
            bandwidth=3.35e12,
            ffn_passes=2.0,
            k=k,
        )

    plain, again = times(perf_moe.DEFAULT_MOE), times(replace(perf_moe.DEFAULT_MOE, layer_recompute=True))
    assert again[:3] == plain[:3]
    assert again[3] == pytest.approx(plain[3] + plain[2], rel=1e-12)


def test_nvl72_runs_beyond_a_rack_are_segments_of_16_trays() -> None:
    """64 trays of 4 GB200s: Slurm segments of 16 trays (the largest divisor of 64 up to 18), so 64
    consecutive GPUs share NVLink and the 65th is across the NICs; 18 trays are one rack."""
    big = _bridge_cluster("GB200", 64, 4)
    assert big.link_domain_of[0] == big.link_domain_of[63] != big.link_domain_of[64]
    assert big.bandwidth[0, 63] > big.bandwidth[0, 64]
    rack = _bridge_cluster("GB300", 18, 4)
    assert len(set(rack.link_domain_of.tolist())) == 1


def test_each_bridge_row_runs_its_recipe_s_dispatcher_and_overlap() -> None:
    rows = {r.row_id: r for r in load_bridge_moe(calibration_dir()).rows}
    gb300 = bridge_recipe(rows["mb:26.08:DGX-GB300:DeepSeekV3:MXFP8:pretrain:main"])
    assert (gb300.dispatcher, gb300.overlap, gb300.mlp_recompute, gb300.full_graph) == ("flex", True, False, True)
    b200 = bridge_recipe(rows["mb:26.04.01:DGX-B200:DeepSeekV3:MXFP8:pretrain:main"])  # ep 32: DeepEP, mlp recomputed
    assert (b200.dispatcher, b200.overlap, b200.mlp_recompute) == ("flex", True, True)
    qwen = bridge_recipe(rows["mb:26.02:DGX-B200:Qwen3_30B_a3B:MXFP8:pretrain:main"])  # micro-batch 1: alltoall
    assert (qwen.dispatcher, qwen.overlap) == ("alltoall", False)
    older = bridge_recipe(rows["mb:26.04.01:DGX-GB300:DeepSeekV3:MXFP8:pretrain:main"])  # micro-batch 2: not the newest
    assert (older.overlap, older.full_graph) == (False, False)
