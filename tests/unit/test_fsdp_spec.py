"""The fsdp runner's candidate check and plan (``workers.fsdp_spec``), and the config fields
it added (``ParallelConfig.dp_shard``, ``offload``): pure, no torch, no process."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.fsdp_spec import check_fsdp, plan_for
from workers.support import refusals_for

MODEL = ModelSpec(name="tiny-fsdp", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                  max_seq=64, tied_embeddings=False, arch="llama")
JOB = TrainingSpec(global_batch=8, seq_len=32, dtype="fp32")


def config(**kw: object) -> ParallelConfig:
    base: dict[str, object] = {"tp": 1, "pp": 1, "dp": 4, "mbs": 2, "global_batch": 8, "zero_stage": 3}
    return ParallelConfig(**(base | kw))  # type: ignore[arg-type]


def refused(c: ParallelConfig, model: ModelSpec = MODEL, world: int | None = None, kind: str = "cpu",
            job: TrainingSpec = JOB) -> SpecError:
    with pytest.raises(SpecError) as e:
        check_fsdp(model, job, c, kind, world)
    assert "\n" not in str(e.value) and e.value.fix, str(e.value)
    return e.value


@pytest.mark.parametrize(("kw", "field", "words"), [
    ({"tp": 3, "dp": 1, "global_batch": 6}, "config.tp", "tp=3 does not divide the model's heads=4"),
    ({"tp": 4, "dp": 1}, "config.tp", "kv_heads=2"),
    ({"pp": 8, "dp": 1, "mbs": 1}, "config.pp", "8 pipeline stages for 4 layers"),
    ({"pp": 2, "dp": 2, "mbs": 2, "schedule": "interleaved", "virtual_stages": 4}, "config.pp", "8 pipeline stages"),
    ({"zero_stage": 1}, "config.zero_stage", "ZeRO-1"),
    ({"zero_stage": 0, "dp_shard": 2}, "config.dp_shard", "NO_SHARD"),
    ({"pp": 4, "dp": 1, "mbs": 4}, "config.mbs", "1F1B needs at least pp=4 micro-batches"),
])
def test_a_split_the_model_cannot_take_is_refused_in_one_line(kw: dict[str, object], field: str, words: str) -> None:
    e = refused(config(**kw))
    assert e.field == field and words in e.message, str(e)


def test_interleaving_needs_whole_rounds_of_micro_batches() -> None:
    job = replace(JOB, global_batch=10)
    e = refused(config(pp=2, dp=1, mbs=2, global_batch=10, schedule="interleaved", virtual_stages=2), job=job)
    assert e.field == "config.mbs" and "rounds" in e.message


def test_a_world_other_than_the_product_of_the_degrees_is_refused() -> None:
    e = refused(config(tp=2, dp=2), world=3)
    assert e.field == "config" and "3 processes" in e.message and "2 x 1 x 2 = 4" in e.message
    check_fsdp(MODEL, JOB, config(tp=2, dp=2), "cpu", 4)


def test_tied_embeddings_are_refused_under_tp_and_pp() -> None:
    tied = replace(MODEL, tied_embeddings=True)
    assert refused(config(tp=2, dp=2), tied).field == "config.tp"
    assert refused(config(pp=2, dp=2), tied).field == "config.pp"
    check_fsdp(tied, JOB, config(), "cpu", 4)  # FSDP alone shards the tied weight once


def test_fp16_needs_a_gpu() -> None:
    assert refused(config(), job=replace(JOB, dtype="fp16")).field == "training.dtype"
    check_fsdp(MODEL, replace(JOB, dtype="fp16"), config(), "gpu")


def test_a_shard_degree_must_divide_dp() -> None:
    with pytest.raises(SpecError) as e:
        config(dp_shard=3)
    assert e.value.field == "config.dp_shard"
    assert config(dp_shard=4).dp_shard is None  # all of dp: one spelling


def test_the_fsdp_options_name_the_candidate_and_round_trip() -> None:
    hsdp = config(dp_shard=2, offload=True)
    assert hsdp.label.endswith("-hsdp2x2-offload")
    assert ParallelConfig.from_dict(hsdp.to_dict()) == hsdp
    plain = config()
    assert "dp_shard" not in plain.to_dict() and "offload" not in plain.to_dict()  # DeepSpeed's dict unchanged


def test_deepspeed_refuses_the_fsdp_options() -> None:
    for c in (config(dp_shard=2), config(offload=True)):
        assert any("fsdp stack" in r for r in refusals_for(MODEL, JOB, c, "cpu"))


@pytest.mark.parametrize(("kw", "shape", "reshard"), [
    ({}, (1, 1, 4, 1), True),
    ({"zero_stage": 2}, (1, 1, 4, 1), False),
    ({"dp_shard": 2}, (1, 2, 2, 1), True),
    ({"zero_stage": 0}, (1, 4, 1, 1), False),
    ({"tp": 2, "dp": 2}, (1, 1, 2, 2), True),
    ({"pp": 2, "dp": 2}, (2, 1, 2, 1), True),
])
def test_the_mesh_is_torchtitans_in_pipettes_rank_order(kw: dict[str, object], shape: tuple[int, ...],
                                                        reshard: bool) -> None:
    c = config(**kw)
    plan = plan_for(MODEL, JOB, c, "cpu", 4)
    assert plan.mesh.names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert plan.mesh.sizes == shape and plan.reshard_after_forward is reshard and plan.world == c.world
    for rank in range(c.world):
        at = c.layout.coords(rank)
        mine = plan.mesh.coords(rank)
        assert (mine["pp"], mine["dp_replicate"] * plan.dp_shard + mine["dp_shard"], mine["tp"]) == \
            (at["pp"], at["dp"], at["tp"])


def test_interleaved_stages_loop_over_the_pipeline_ranks() -> None:
    plan = plan_for(MODEL, JOB, config(pp=2, dp=1, mbs=2, schedule="interleaved", virtual_stages=2), "cpu")
    assert plan.stages == 4 and plan.stage_ids(0) == [0, 2] and plan.stage_ids(1) == [1, 3]
    assert plan.microbatches == 4 and plan.schedule == "interleaved"


@pytest.mark.parametrize(("kw", "shard_cp", "fsdp"), [
    ({"dp": 2, "cp": 2}, True, True),  # FSDP2 over dp_shard x cp (torchtitan's dp_shard_cp)
    ({"dp": 1, "cp": 4}, True, True),  # fsdp_enabled = dp_shard_enabled or cp_enabled
    ({"dp": 2, "cp": 2, "zero_stage": 0}, False, True),  # NO_SHARD: whole replicas, gradients averaged over cp
    ({"dp": 1, "cp": 2, "tp": 2, "zero_stage": 0}, False, False),
])
def test_cp_is_a_mesh_dimension_and_fsdp_shards_over_it(kw: dict[str, object], shard_cp: bool, fsdp: bool) -> None:
    c = config(**kw)
    plan = plan_for(MODEL, JOB, c, "cpu", c.world)
    assert plan.mesh.names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and plan.cp == c.cp
    assert plan.cp_kind == "ring" and plan.shard_cp is shard_cp and plan.fsdp is fsdp
    assert plan.cp_grad_average is not shard_cp and plan.world == c.world
    # the cp ranks of one replica read the same rows: the data index leaves cp out
    for group in c.layout.groups("cp"):
        assert len({plan.mesh.index(r, "dp") for r in group}) == 1 and len(group) == c.cp
    assert not plan_for(MODEL, JOB, config(), "cpu", 4).shard_cp


def test_cp_needs_2_cp_tp_chunks_of_the_sequence() -> None:
    e = refused(config(dp=1, cp=2, tp=2), job=replace(JOB, seq_len=36))
    assert e.field == "training.seq_len" and "2 x cp x tp = 8" in e.message
    check_fsdp(MODEL, replace(JOB, seq_len=40), config(dp=1, cp=2, tp=2), "cpu", 4)
    e = refused(config(dp=2, cp=2), world=2)
    assert "tp x pp x dp x cp = 1 x 1 x 2 x 2 = 4" in e.message
