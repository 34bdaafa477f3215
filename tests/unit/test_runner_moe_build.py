"""Pipette's DeepSpeed runner builds an MoE model of the families DeepSpeed's AutoEP has presets for
as the planner counts it (issue 47): the Hugging Face model (on the meta device) holds exactly the
parameters ``ModelSpec.total_params`` counts, experts included; another family is refused in one line."""

from __future__ import annotations

import pytest

from pipette.errors import SpecError
from pipette.model import ModelSpec
from workers.rank.hf_model import build_llama


@pytest.mark.parametrize(("name", "cls"), [
    ("tiny-moe", "MixtralForCausalLM"), ("mixtral-8x7b", "MixtralForCausalLM"),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM"), ("qwen3-235b-a22b", "Qwen3MoeForCausalLM"),
    ("qwen1.5-moe-a2.7b", "Qwen2MoeForCausalLM"), ("qwen2-57b-a14b", "Qwen2MoeForCausalLM"),
])
def test_the_runner_builds_the_experts_the_planner_counts(name: str, cls: str) -> None:
    spec = ModelSpec.preset(name)
    model = build_llama(spec, device="meta", experts=True)
    assert type(model).__name__ == cls
    assert sum(p.numel() for p in model.parameters()) == spec.total_params()


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "gpt-oss-20b", "tiny-moe-shared"])
def test_a_family_it_does_not_build_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(SpecError) as e:
        build_llama(ModelSpec.preset(name), device="meta", experts=True)
    assert "\n" not in str(e.value) and e.value.fix


def test_without_experts_the_mlps_stay_dense_for_the_fsdp_runners_own_moe_layer() -> None:
    """The fsdp runner builds the Llama and swaps each MLP for its MoE layer (``use_moe``): it asks for
    no experts, and gets Llama's dense MLPs of ``ffn_hidden`` whatever the family (tiny-moe-shared too)."""
    for name in ("tiny-moe", "tiny-moe-shared"):
        assert type(build_llama(ModelSpec.preset(name), device="meta")).__name__ == "LlamaForCausalLM"
