"""The search space: every dimension, the validity rules, and explained rejections."""

from __future__ import annotations

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.space import RULES, check, enumerate_space
from pipette.training import TrainingSpec


def _all_valid(model: ModelSpec, training: TrainingSpec, world: int) -> None:
    space = enumerate_space(model, training, world)
    assert space.candidates
    for c in space.candidates:
        assert check(model, training, c, world) == []
        assert model.heads % c.tp == 0 and model.kv_heads % c.tp == 0
        assert c.pp <= model.layers and c.world == world
        assert training.global_batch % (c.dp * c.mbs) == 0
        assert not (c.pp > 1 and c.zero_stage >= 2)
    assert set(space.rejected) <= set(RULES)


def test_every_dimension_is_enumerated() -> None:
    model = ModelSpec.preset("llama2-7b")
    training = TrainingSpec(global_batch=32, seq_len=4096)
    space = enumerate_space(model, training, 16)
    cs = space.candidates
    assert {c.tp for c in cs} == {1, 2, 4, 8, 16}
    assert {c.pp for c in cs} == {1, 2, 4, 8, 16}
    assert {c.zero_stage for c in cs} == {0, 1, 2, 3}
    assert {c.recompute for c in cs} == {"none", "selective", "full"}
    assert {(c.schedule, c.virtual_stages) for c in cs} == {("1f1b", 1), ("interleaved", 2), ("interleaved", 4)}
    assert {c.mbs for c in cs} == {1, 2, 4, 8, 16, 32}
    _all_valid(model, training, 16)
    assert len({c.label for c in cs}) == len(cs)


def test_gqa_limits_tp_and_rules_are_counted() -> None:
    model = ModelSpec.preset("tiny-llama-gqa")  # 8 heads, 4 kv heads
    training = TrainingSpec(global_batch=8, seq_len=64)
    space = enumerate_space(model, training, 8)
    assert max(c.tp for c in space.candidates) == 4
    assert space.rejected["tp_kv_heads"] >= 1
    assert space.rejected["zero_pipeline"] > 0
    _all_valid(model, training, 8)


def test_check_explains_each_rule() -> None:
    model = ModelSpec.preset("tiny-llama")  # 4 layers, 4 heads
    training = TrainingSpec(global_batch=8, seq_len=64, zero_stages=(0, 1), recompute=("none",))
    bad = ParallelConfig(tp=8, pp=8, dp=1, mbs=8, global_batch=8, zero_stage=3, recompute="full",
                         schedule="interleaved", virtual_stages=2)
    broken = set(check(model, training, bad, 64))
    assert {"tp_heads", "tp_kv_heads", "pp_layers", "zero_pipeline", "interleaved_layers",
            "interleaved_microbatches", "recompute_not_allowed", "zero_not_allowed"} <= broken
    assert all(code in RULES for code in broken)


def test_recipe_limits_the_space() -> None:
    model = ModelSpec.preset("tiny-llama")
    training = TrainingSpec(global_batch=12, seq_len=64, micro_batches=(2, 3), zero_stages=(1,),
                            recompute=("full",), schedules=("1f1b",))
    space = enumerate_space(model, training, 4)
    assert {c.mbs for c in space.candidates} <= {2, 3}
    assert {c.zero_stage for c in space.candidates} == {1}
    assert space.rejected["batch_divisible"] > 0


def test_a_batch_no_dp_divides_leaves_nothing() -> None:
    model = ModelSpec.preset("tiny-llama")
    training = TrainingSpec(global_batch=3, seq_len=64, micro_batches=(2,))
    space = enumerate_space(model, training, 4)
    assert not space.candidates and sum(space.rejected.values()) > 0


def test_a_stack_that_splits_layers_unevenly_keeps_interleaving_they_do_not_divide() -> None:
    """Llama 3.1 405B's 126 layers over pp 8 with 2 virtual stages each (torchtitan's own benchmark
    layout): Megatron-LM's even split refuses it, torchtitan and Pipette's fsdp runner split the layers
    as evenly as they go (``Stack.uneven_virtual_stages``)."""
    model = ModelSpec(name="llama3.1-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                      vocab=128256, max_seq=8192, tied_embeddings=False, arch="llama")
    training = TrainingSpec(global_batch=64, seq_len=8192, zero_stages=(3,), recompute=("full",))
    c = ParallelConfig(tp=8, pp=8, dp=8, mbs=1, global_batch=64, zero_stage=3, recompute="full",
                       schedule="interleaved", virtual_stages=2)
    assert check(model, training, c, 512) == ["zero_pipeline", "interleaved_layers"]
    assert check(model, training, c, 512, sharded_pipeline=True, uneven_virtual_stages=True) == []
    even = enumerate_space(model, training, 64, sharded_pipeline=True)
    uneven = enumerate_space(model, training, 64, sharded_pipeline=True, uneven_virtual_stages=True)
    assert even.rejected["interleaved_layers"] > 0 and "interleaved_layers" not in uneven.rejected
    assert {c.label for c in even.candidates} < {c.label for c in uneven.candidates}
    assert any(c.schedule == "interleaved" and model.layers % (c.pp * c.virtual_stages) for c in uneven.candidates)
