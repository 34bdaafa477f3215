"""make_plan: ranking, dropping, placement and the infeasible answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipette.clusterfile import homogeneous_cluster, load_cluster
from pipette.emit import deepspeed_config, hostfile, rank_map
from pipette.errors import InfeasibleError
from pipette.fits import KEEP_THRESHOLD
from pipette.model import ModelSpec
from pipette.plan import OUT_OF_MEMORY, make_plan
from pipette.training import TrainingSpec

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def test_plan_ranks_feasible_candidates_and_counts_the_rest() -> None:
    model = ModelSpec.preset("llama2-13b")
    training = TrainingSpec(global_batch=32, seq_len=4096)
    cluster = homogeneous_cluster("A100-80GB", 2, 8, 300e9, 25e9)
    plan = make_plan(model, training, cluster, optimize_top=5)
    expected = [p.expected_step_time for p in plan.ranked]
    assert expected == sorted(expected)
    # the expectation weighs a candidate's own time by its chance to fit, never below it
    assert all(p.expected_step_time >= p.perf.step_time * (1 - 1e-12) for p in plan.ranked)
    assert all(p.chance_to_fit >= KEEP_THRESHOLD for p in plan.ranked)
    assert plan.dropped[OUT_OF_MEMORY] == len(plan.out_of_memory) > 0
    assert len(plan.ranked) + sum(plan.dropped.values()) == plan.enumerated
    assert all(d.chance_to_fit < KEEP_THRESHOLD and not d.memory.fits() for d in plan.out_of_memory)
    assert all(p.config.placement is not None and sorted(p.config.placement) == list(range(16)) for p in plan.ranked)


def test_placement_never_worse_than_default_on_slow_links() -> None:
    plan = make_plan(ModelSpec.preset("llama2-7b"), TrainingSpec(global_batch=64, seq_len=4096),
                     load_cluster(CLUSTERS / "h100-4x8-slow-links.yaml"), optimize_top=10)
    for p in plan.ranked[:10]:
        assert p.perf.step_time <= p.default_step_time * (1 + 1e-9)


def test_nothing_fits_reports_shortfall_and_remedies() -> None:
    model = ModelSpec.preset("llama2-70b")
    training = TrainingSpec(global_batch=8, seq_len=4096, zero_stages=(0,), recompute=("none",))
    with pytest.raises(InfeasibleError) as e:
        make_plan(model, training, homogeneous_cluster("A100-40GB", 1, 8, 300e9, 300e9))
    err = e.value
    assert err.shortfall_bytes is not None and err.shortfall_bytes > 0
    assert err.reasons[OUT_OF_MEMORY] > 0
    for remedy in ("more devices", "LoRA", "ZeRO-3", "recomputation"):
        assert remedy in (err.fix or "")


def test_lora_fits_where_full_does_not() -> None:
    model = ModelSpec.preset("llama2-7b")
    one_gpu = homogeneous_cluster("A100-80GB", 1, 1, 300e9, 300e9)
    with pytest.raises(InfeasibleError):
        make_plan(model, TrainingSpec(global_batch=4, seq_len=2048), one_gpu)
    plan = make_plan(model, TrainingSpec(global_batch=4, seq_len=2048, method="lora"), one_gpu)
    assert plan.best.config.world == 1


def test_emitted_files_agree_with_the_candidate() -> None:
    model = ModelSpec.preset("llama2-7b")
    training = TrainingSpec(global_batch=64, seq_len=4096, method="lora", dtype="fp16")
    cluster = load_cluster(CLUSTERS / "a100-2x8.yaml")
    best = make_plan(model, training, cluster, optimize_top=3).best.config
    ds = deepspeed_config(training, best)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * best.dp
    assert ds["fp16"]["enabled"] and "bf16" not in ds
    assert ds.get("tensor_parallel", {"autotp_size": 1})["autotp_size"] == best.tp
    ranks = rank_map(best, cluster)
    assert [r["device"] for r in ranks] == list(best.devices())
    assert all(best.layout.rank({"pp": r["pp"], "dp": r["dp"], "tp": r["tp"]}) == r["rank"] for r in ranks)
    slots = sum(int(line.split("slots=")[1]) for line in hostfile(best, cluster).splitlines())
    assert slots == best.world


def test_buckets_are_sized_to_what_trains() -> None:
    from pipette.emit import trainable_params

    training = TrainingSpec(global_batch=8, seq_len=128, method="lora", zero_stages=(1,))
    model = ModelSpec.preset("tiny-llama")
    config = make_plan(model, training, homogeneous_cluster("cpu", 1, 2, 1e9, 1e9)).best.config
    # LoRA r=16 on q, k, v, o of 128x128 projections, 4 layers: 4 * 4 * 16 * 256.
    assert trainable_params(model, training) == 65_536
    zero = deepspeed_config(training, config, model=model)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 65_536
    big = deepspeed_config(TrainingSpec(global_batch=8, seq_len=128, zero_stages=(1,)), config,
                           model=ModelSpec.preset("llama2-70b"))
    assert big["zero_optimization"]["reduce_bucket_size"] == 500_000_000
