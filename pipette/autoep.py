"""Which Mixture-of-Experts models DeepSpeed's AutoEP trains (issue 47): the Hugging Face families it has
presets for (deepspeed/module_inject/auto_ep_presets, DeepSpeed 0.19: mixtral, qwen2_moe / qwen3_moe,
deepseek_v2, deepseek_v3), told apart by a model's shape, and those of them Pipette's DeepSpeed runner
builds (``workers.rank.hf_model.moe_config``). Read by the planner (``pipette.space_moe``), the runner's
rules (``pipette.runners``) and the runner itself.
"""

from __future__ import annotations

from pipette.model import ModelSpec

#: the AutoEP families whose models the DeepSpeed runner builds: not DeepSeek's latent attention
DEEPSPEED_MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen3_moe", "qwen2_moe")


def autoep_family(model: ModelSpec) -> str | None:
    """The AutoEP preset of ``model``'s shape (None: none fits, or routing AutoEP does not run): DeepSeek's
    latent attention (V2 softmax, V3 sigmoid scores), Qwen2-MoE's gated shared expert, Qwen3-MoE's q/k
    norms without shared experts, Mixtral's Llama attention with routed experts alone. Biased routers or
    experts (gpt-oss) and a capacity factor (AutoEP's router is torchtitan's dropless one) have none."""
    moe = model.moe
    if moe is None or moe.router_bias or moe.expert_bias or moe.capacity_factor is not None:
        return None
    a = model.attention
    if a is not None and a.mla is not None:
        return "deepseek_v3" if moe.scoring == "sigmoid" else "deepseek_v2"
    if moe.scoring != "softmax" or moe.groups > 1:
        return None
    if moe.shared_ffn:
        return "qwen2_moe" if moe.shared_gate and a is not None and a.qkv_bias and not a.o_bias else None
    if a is not None and a.qk_norm and not a.qkv_bias and not a.sinks and a.window is None:
        return "qwen3_moe"
    return "mixtral" if a is None and not moe.dense_layers else None


__all__ = ["DEEPSPEED_MOE_FAMILIES", "autoep_family"]
