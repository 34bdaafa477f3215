"""Routing and the token dispatcher as choices of the search (issue 47, ``pipette.routing``): a
capacity factor only where the job allows it and the stack runs it, the flex dispatcher where
Megatron-Core, DeepEP and the devices run it; each priced (the host floor, the padded load, the
cross-node copies), sized (DeepEP's buffer) and written to the launch files as priced."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipette import perf_moe
from pipette.clusterfile import homogeneous_cluster, load_cluster
from pipette.config import ParallelConfig
from pipette.emit import write_launch_files
from pipette.emit_frameworks import megatron_arguments
from pipette.errors import SpecError
from pipette.memory import estimate_memory
from pipette.memory_moe import flex_buffer_bytes
from pipette.model import ModelSpec
from pipette.perf import estimate_perf
from pipette.perf_constants import MEGATRON_CONSTANTS
from pipette.plan import make_plan
from pipette.routing import parse_routing, routed
from pipette.space_moe import expert_variants, routings
from pipette.training import TrainingSpec
from workers.rank.moe_layer import moe_options

QWEN = ModelSpec.preset("qwen3-30b-a3b")
DEEPSEEK = ModelSpec.preset("deepseek-v3")
TRAINING = TrainingSpec(global_batch=64, seq_len=4096)
H100_2X8 = homogeneous_cluster("H100-80GB", 2, 8, 450e9, 50e9, name="h2x8")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("given", "name"), [("dropless", "dropless"), ("Dropless ", "dropless"), (1.0, "cf1"),
                                             ("1.25", "cf1.25"), ("cf1.5", "cf1.5"), (2, "cf2")])
def test_a_routing_has_one_name(given: object, name: str) -> None:
    assert parse_routing(given) == name


@pytest.mark.parametrize("bad", ["drop", "cf", "cfx", 0, -1.0, "nan", "inf", True, None, [1.0]])
def test_a_bad_routing_says_what_to_give(bad: object) -> None:
    with pytest.raises(SpecError) as e:
        parse_routing(bad)
    assert e.value.field == "training.moe_routing" and "dropless" in (e.value.fix or "")


def test_a_candidate_names_its_routing_and_dispatcher_only_when_it_has_them() -> None:
    base = ParallelConfig(tp=1, pp=1, dp=16, ep=8, mbs=1, global_batch=64)
    assert "cf" not in base.label and "flex" not in base.label and "routing" not in base.to_dict()
    chosen = replace(base, routing=1.25, dispatcher="flex")  # type: ignore[arg-type]  # a number, as a user gives
    assert chosen.routing == "cf1.25" and chosen.label.endswith("-ep8-cf1.25-flex-mbs1-z0-rc:none-1f1b")
    assert ParallelConfig.from_dict(chosen.to_dict()) == chosen
    assert replace(base, dispatcher="alltoall").dispatcher is None  # the all-to-all is the default's one spelling
    with pytest.raises(SpecError, match="tp x ep > 1"):
        replace(base, ep=1, dispatcher="flex")
    with pytest.raises(SpecError, match="unknown token dispatcher"):
        replace(base, dispatcher="deepep")


def test_the_job_lists_the_routings_and_each_stack_plans_what_it_runs() -> None:
    allowed = replace(TRAINING, moe_routing=("dropless", "1.0"))
    assert routings(QWEN, TRAINING, "megatron") == [None]  # nothing listed: the model's own alone
    assert routings(QWEN, allowed, "megatron") == [None, "cf1"]  # dropless is the model's own: None
    assert routings(QWEN, allowed, "fsdp") == [None]  # torchtitan's router is dropless
    with pytest.raises(SpecError, match="the fsdp stack routes dropless only") as e:
        routings(QWEN, replace(TRAINING, moe_routing=("1.0",)), "fsdp")
    assert "\n" not in str(e.value)
    with pytest.raises(SpecError, match="dense model"):
        routings(ModelSpec.preset("llama2-7b"), allowed, "megatron")
    capped = replace(QWEN, moe=replace(QWEN.moe, capacity_factor=1.0))  # type: ignore[type-var]
    assert routings(capped, allowed, "megatron") == ["dropless", None]


def test_the_flex_dispatcher_is_planned_where_megatron_deepep_and_the_devices_run_it() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=16, mbs=1, global_batch=64)
    both = expert_variants(QWEN, cfg, "megatron", flex=True)
    flex = [c for c in both if c.dispatcher == "flex"]
    assert flex and {c.ep for c in flex} == {c.ep for c in both} - {1}  # every ep > 1, never ep 1
    assert len(both) == len({c.label for c in both})
    assert not [c for c in expert_variants(QWEN, cfg, "megatron", flex=False) if c.dispatcher]  # an A100's
    assert not [c for c in expert_variants(QWEN, cfg, "fsdp", flex=True) if c.dispatcher]  # torchtitan's a2a
    # DeepEP's configs list group sizes 2, 4, 8, 16, 24, 32, 64, ...: a 12-rank group has none
    odd = expert_variants(replace(QWEN, moe=replace(QWEN.moe, experts=96)), replace(cfg, dp=12, global_batch=48),  # type: ignore[type-var]
                          "megatron", flex=True)
    assert not [c for c in odd if c.dispatcher and c.ep == 12] and [c for c in odd if c.dispatcher and c.ep == 4]


def _step(config: ParallelConfig, model: ModelSpec = QWEN, host_s: float = 1e-3) -> float:
    k = replace(MEGATRON_CONSTANTS, moe=replace(perf_moe.DEFAULT_MOE, layer_host_s=host_s, imbalance=1.2))
    return estimate_perf(model, TRAINING, config, H100_2X8, constants=k).step_time


def test_each_routing_and_dispatcher_is_priced_as_megatron_core_runs_it() -> None:
    """Dropless waits on the host; a capacity factor under the all-to-all pads (no wait, the capacity's
    load); under the flex dispatcher it drops without padding (the imbalance up to the capacity) and
    the host still waits on DeepEP's list of tokens per expert."""
    cfg = ParallelConfig(tp=1, pp=1, dp=16, ep=16, mbs=1, global_batch=64)
    host = 1.0  # a floor far above the kernels: who waits shows
    dropless, padded = _step(cfg, host_s=host), _step(replace(cfg, routing="cf2"), host_s=host)
    dropped = _step(replace(cfg, routing="cf2", dispatcher="flex"), host_s=host)
    # 48 layers, 4 micro-batches
    assert dropless > 48 * 4 * host and dropped > 48 * 4 * host and padded < 0.5 * dropless
    assert _step(replace(cfg, routing="cf2")) > _step(cfg)  # padded to 2x the copies: more than 1.2x
    assert _step(replace(cfg, routing="cf1.1", dispatcher="flex")) < _step(replace(cfg, dispatcher="flex"))


def test_the_flex_dispatcher_sends_a_token_across_nodes_once() -> None:
    """DeepSeek-V3's top-8 over two nodes: the all-to-all sends ~4 of 8 copies over the NICs, DeepEP one."""
    cfg = ParallelConfig(tp=1, pp=1, dp=16, ep=16, mbs=1, global_batch=64)
    moe = perf_moe.moe_times
    k = MEGATRON_CONSTANTS.moe
    times = moe(DEEPSEEK, TRAINING, cfg, gemm=lambda f: f / 1e15, grouped_peak=1e15, large=0.5, bandwidth=3e12,
                ffn_passes=4.0, k=k)
    devices = np.arange(16)
    a2a = perf_moe.a2a_per_stage(H100_2X8, cfg, DEEPSEEK, devices, times.a2a_bytes, k)[0]
    flex = perf_moe.a2a_per_stage(H100_2X8, replace(cfg, dispatcher="flex"), DEEPSEEK, devices, times.a2a_bytes, k)[0]
    assert flex < 0.5 * a2a


def test_deepeps_buffer_is_sized_as_its_config_sizes_it() -> None:
    """csrc/config.hpp's hints with deep_ep/buffer.py's configs, 20 SMs (10 channels): 8 ranks of a
    2,048-wide model: 10 x 8 x (5 x 4 + 256 x (4,096 + 2,056)) bytes, no RDMA part inside 8 peers."""
    assert flex_buffer_bytes(2048, 8) == 10 * 8 * (5 * 4 + 256 * (4096 + 2056))
    rdma = 10 * 2 * (18 * 2 * 4 + 128 * 2 * (4096 + 2056 + 16)) + 2 ** 20
    assert flex_buffer_bytes(2048, 16) == 10 * 8 * (7 * 4 + 288 * (4096 + 2056)) + rdma
    assert flex_buffer_bytes(2048, 12) == 0.0 and flex_buffer_bytes(2048, 1) == 0.0
    cfg = ParallelConfig(tp=1, pp=1, dp=16, ep=8, mbs=1, global_batch=64, zero_stage=1)
    a2a = estimate_memory(QWEN, TRAINING, cfg, 80e9).peak_bytes
    flex = estimate_memory(QWEN, TRAINING, replace(cfg, dispatcher="flex"), 80e9).peak_bytes
    assert flex - a2a == pytest.approx(flex_buffer_bytes(QWEN.hidden, 8), rel=1e-9)


def _flags(args: list[str]) -> dict[str, str]:
    return {a.split()[0]: (a.split()[1] if " " in a else "") for a in args}


def test_megatron_args_say_the_candidates_routing_and_dispatcher() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=16, ep=16, mbs=1, global_batch=64, zero_stage=1)
    plain = _flags(megatron_arguments(TRAINING, cfg, QWEN.layers, moe=QWEN.moe))
    assert plain["--moe-token-dispatcher-type"] == "alltoall" and "--moe-expert-capacity-factor" not in plain
    padded = _flags(megatron_arguments(TRAINING, replace(cfg, routing="cf1.25"), QWEN.layers, moe=QWEN.moe))
    assert padded["--moe-expert-capacity-factor"] == "1.25" and "--moe-pad-expert-input-to-capacity" in padded
    flex = _flags(megatron_arguments(TRAINING, replace(cfg, routing="cf1", dispatcher="flex"), QWEN.layers,
                                     moe=QWEN.moe, flex_backend="hybridep"))
    assert flex["--moe-token-dispatcher-type"] == "flex" and flex["--moe-flex-dispatcher-backend"] == "hybridep"
    assert flex["--moe-expert-capacity-factor"] == "1"
    assert "--moe-pad-expert-input-to-capacity" not in flex  # the flex dispatcher refuses the padding
    capped = replace(QWEN.moe, capacity_factor=1.5)  # type: ignore[type-var]
    dropless = _flags(megatron_arguments(TRAINING, replace(cfg, routing="dropless"), QWEN.layers, moe=capped))
    assert "--moe-expert-capacity-factor" not in dropless


def test_an_nvl72_rack_runs_hybridep_and_a_dgx_deepep(tmp_path: Path) -> None:
    rack = load_cluster(ROOT / "examples" / "clusters" / "gb200-nvl72.yaml")
    cfg = ParallelConfig(tp=1, pp=1, dp=16, ep=16, mbs=1, global_batch=64, zero_stage=1, dispatcher="flex")
    for cluster, backend in ((rack, "hybridep"), (H100_2X8, "deepep")):
        files = write_launch_files(tmp_path / backend, QWEN, TRAINING, cfg, cluster, stack="megatron")
        assert f"--moe-flex-dispatcher-backend {backend}" in files["megatron_args.txt"].read_text().splitlines()


def test_a_plan_ranks_the_routings_the_job_allows_and_says_them() -> None:
    allowed = replace(TRAINING, moe_routing=("dropless", "1.0"), zero_stages=(1,), recompute=("none",))
    plan = make_plan(QWEN, allowed, H100_2X8, stack="megatron")
    routes = {p.config.routing for p in plan.ranked}
    assert routes == {None, "cf1"}
    assert {p.config.dispatcher for p in plan.ranked} == {None, "flex"}
    only_own = make_plan(QWEN, replace(allowed, moe_routing=()), H100_2X8, stack="megatron")
    assert {p.config.routing for p in only_own.ranked} == {None}
    # fsdp with capacity factors alone: refused in one line; beside megatron its candidates are counted
    tiny, cpu = ModelSpec.preset("tiny-moe"), homogeneous_cluster("H100-80GB", 1, 4, 450e9, 50e9)
    small = replace(allowed, global_batch=16, seq_len=64, moe_routing=("1.0",))
    with pytest.raises(SpecError, match="routes dropless only"):
        make_plan(tiny, small, cpu, stack="fsdp")
    both = make_plan(tiny, small, cpu, stack=["megatron", "fsdp"])
    assert both.dropped["stack_routing"] > 0 and {p.config.stack for p in both.ranked} == {"megatron"}


def test_the_runner_trains_the_candidates_routing() -> None:
    assert moe_options(routed(QWEN, "cf1.25")).capacity_factor == 1.25  # type: ignore[union-attr]
    capped = replace(QWEN, moe=replace(QWEN.moe, capacity_factor=1.0))  # type: ignore[type-var]
    assert moe_options(routed(capped, "dropless")).capacity_factor is None  # type: ignore[union-attr]
    assert routed(capped, None) is capped


def test_the_cli_plans_the_routings_it_is_given_and_refuses_a_bad_one_in_one_line() -> None:
    from tests.unit.test_cli import CLUSTERS, pipette

    cluster = str(CLUSTERS / "h100-4x8-slow-links.yaml")
    r = pipette("plan", "--model", "qwen3-30b-a3b", "--cluster", cluster, "--global-batch", "64", "--seq-len",
                "4096", "--stack", "megatron", "--zero", "1", "--recompute", "none", "--moe-routing", "dropless,1.0",
                "--no-files", "--top", "40")
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if line.lstrip().startswith("#  tp"))
    assert "routing" in header.split() and "dispatch" in header.split()
    rows = [line.split() for line in r.stdout.splitlines()
            if line[:3].strip().isdigit() and len(line.split()) == len(header.split()) - 2]  # "step s", "peak GiB"
    assert len(rows) == 40
    assert {row[header.split().index("routing")] for row in rows} <= {"dropless", "cf1"}
    bad = pipette("plan", "--model", "qwen3-30b-a3b", "--cluster", cluster, "--global-batch", "64", "--seq-len",
                  "4096", "--stack", "megatron", "--moe-routing", "dropless,often", "--no-files")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--moe-routing" in bad.stderr and "unknown MoE routing 'often'" in bad.stderr
