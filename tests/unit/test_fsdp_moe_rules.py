"""The PyTorch-native runner and MoE models, pure: the tiny MoE presets, the runner's refusals of
what its MoE layer does not build (``pipette.fsdp_rules.moe_problems``), the expert mesh of a plan
(``FsdpPlan.expert_mesh``: torchtitan's ``efsdp x ep``, the layout's expert groups), and the
DeepSpeed runner's refusal of an MoE model. No torch, no process."""

from __future__ import annotations

import pytest

from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.fsdp_rules import model_problems
from pipette.model import ModelSpec
from pipette.plan import make_plan
from pipette.runners import deepspeed_refusals
from pipette.training import LoraSpec, TrainingSpec
from workers.fsdp_spec import check_fsdp, plan_for

TINY = ModelSpec.preset("tiny-moe")
SHARED = ModelSpec.preset("tiny-moe-shared")
JOB = TrainingSpec(global_batch=8, seq_len=32, dtype="fp32")


def config(**kw: object) -> ParallelConfig:
    base: dict[str, object] = {"tp": 1, "pp": 1, "dp": 4, "mbs": 1, "global_batch": 8, "zero_stage": 3}
    return ParallelConfig(**(base | kw))  # type: ignore[arg-type]


def test_the_tiny_moe_presets_are_read_as_their_families_config_json() -> None:
    assert TINY.moe is not None and SHARED.moe is not None
    assert (TINY.moe.experts, TINY.moe.top_k, TINY.moe.expert_ffn, TINY.moe.shared_ffn) == (8, 2, 192, 0)
    assert (SHARED.moe.experts, SHARED.moe.top_k, SHARED.moe.shared_ffn, SHARED.moe.shared_gate) == (8, 2, 192, True)
    assert TINY.attention is None and SHARED.attention is None  # Llama's attention: the runner builds them
    assert 1e6 < TINY.total_params() < 4e6


@pytest.mark.parametrize(("model", "kw", "field", "words"), [
    (TINY, {"ep": 4, "dp": 4, "cp": 1}, None, None),
    (TINY, {"dp": 2, "tp": 2}, "config.tp", "not tensor-parallel"),
    (TINY, {"dp": 6, "ep": 3, "global_batch": 12}, "config.ep", "ep=3 does not divide the 8 experts"),
    (TINY, {"dp": 2, "cp": 2, "ep": 2}, "config.ep", "expert and context parallelism"),
    (TINY, {"dp": 4, "ep": 2, "zero_stage": 0}, "config.ep", "does not divide dp_shard"),
    (ModelSpec.preset("tiny-llama"), {"ep": 2}, "config.ep", "dense model"),
    (ModelSpec.preset("deepseek-v3"), {}, "model", "latent attention (MLA)"),
    (ModelSpec.preset("gpt-oss-20b"), {}, "model", "attention sinks"),
    (ModelSpec.preset("qwen3-30b-a3b"), {}, "model", "attention the runner's MoE model does not build"),
])
def test_what_the_runners_moe_layer_does_not_build_is_refused_in_one_line(
        model: ModelSpec, kw: dict[str, object], field: str | None, words: str | None) -> None:
    c = config(**kw)
    if field is None:
        check_fsdp(model, JOB, c, "cpu", c.world)
        return
    with pytest.raises(SpecError) as e:
        check_fsdp(model, JOB, c, "cpu", c.world)
    assert e.value.field == field and str(words) in e.value.message and "\n" not in str(e.value), str(e.value)


def test_every_part_of_a_model_the_runner_does_not_build_is_listed() -> None:
    problems = [message for message, _, _ in model_problems(ModelSpec.preset("deepseek-v3"), JOB, "cpu")]
    for part in ("latent attention (MLA)", "router scoring 'sigmoid'", "group-limited routing", "dense layers",
                 "multi-token-prediction"):
        assert any(part in message for message in problems), (part, problems)
    oss = [message for message, _, _ in model_problems(ModelSpec.preset("gpt-oss-20b"), JOB, "cpu")]
    assert any("router or expert biases (gpt-oss)" in message for message in oss), oss


@pytest.mark.parametrize(("kw", "sizes"), [
    ({"ep": 2}, (1, 1, 2, 2, 1)),
    ({"ep": 4}, (1, 1, 1, 4, 1)),
    ({"ep": 2, "dp_shard": 2}, (1, 2, 1, 2, 1)),
    ({"ep": 2, "dp": 2, "pp": 2, "global_batch": 8}, (2, 1, 1, 2, 1)),
])
def test_the_expert_mesh_is_torchtitans_and_its_ep_groups_are_the_layouts(kw: dict[str, object],
                                                                         sizes: tuple[int, ...]) -> None:
    plan = plan_for(TINY, JOB, config(**kw))
    mesh = plan.expert_mesh
    assert mesh.names == ("pp", "dp_replicate", "efsdp", "ep", "tp") and mesh.sizes == sizes
    assert plan.ep == kw["ep"] and mesh.world == plan.world
    assert mesh.groups("ep") == plan.mesh.groups("ep")  # the ranks that exchange tokens
    assert mesh.groups("dp_replicate", "efsdp") == plan.mesh.groups("edp")  # the ranks holding the same experts


def test_deepspeeds_runner_trains_the_autoep_families_and_names_the_fsdp_stack_for_others() -> None:
    """Issue 47: Pipette's DeepSpeed runner trains Mixtral-, Qwen2-MoE- and Qwen3-MoE-shaped models under
    DeepSpeed's AutoEP (tp 1, pp 1, ZeRO 0-2); another family's experts it refuses, naming the fsdp stack."""
    assert deepspeed_refusals(TINY, JOB, config(zero_stage=1, ep=2), "cpu") == []  # Mixtral's shape
    said = deepspeed_refusals(SHARED, JOB, config(zero_stage=1), "cpu")  # a shared expert without Qwen2's biases
    assert len(said) == 1 and "not of a family the DeepSpeed runner builds" in said[0] and "--stack fsdp" in said[0]
    assert any("ZeRO-3 with experts" in r for r in deepspeed_refusals(TINY, JOB, config(), "cpu"))
    assert deepspeed_refusals(ModelSpec.preset("tiny-llama"), JOB, config(), "cpu") == []


def test_a_plan_of_a_model_the_runner_cannot_build_says_why_in_one_line() -> None:
    """Qwen3-30B-A3B LoRA on 8 H100 with ``--stack fsdp``: every layout was refused, and the error was a
    count by rule ("cannot split the model so (tp and the FFN/vocabulary, tied embeddings, ...)": 1839)
    that never named the cause, its attention (head_dim 128 over a 2048-wide model, q/k norms), which
    the runner's MoE model does not build. Alone, the stack says that; beside another stack that runs the
    model, the plan goes on with the other's candidates."""
    cluster = homogeneous_cluster("H100-80GB", 1, 8, 450e9, 50e9, name="h8")
    qwen = ModelSpec.preset("qwen3-30b-a3b")
    lora = TrainingSpec(global_batch=64, seq_len=4096, method="lora", lora=LoraSpec(16, 32.0, ("q_proj", "v_proj")))
    with pytest.raises(SpecError) as e:
        make_plan(qwen, lora, cluster, stack="fsdp")
    assert "has attention the runner's MoE model does not build (heads of 128" in str(e.value)
    assert "\n" not in str(e.value)
    assert e.value.field == "model" and "--stack megatron" in (e.value.fix or "")
    plan = make_plan(qwen, lora, cluster, stack="fsdp,megatron", optimize_top=1)
    assert plan.ranked and {p.config.stack for p in plan.ranked} == {"megatron"}
    assert plan.dropped["stack_native_split"] > 0
