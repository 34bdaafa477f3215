"""Build the job's model as a Hugging Face ``LlamaForCausalLM`` from a ``ModelSpec`` (or the family's
model where its attention is not Llama's: Qwen3's, Qwen2's; ``llama_config``).

Random weights by default (seeded, so every rank of a trial builds the same model);
a local checkpoint directory is loaded when given (a Llama one only). Nothing is downloaded.

The model is built where the rank computes and in the dtype it trains in (``device``,
``dtype``): a GPU rank initialises on its GPU, where the host took most of a trial's wall
time before (an H100 trial of llama3.2-3b spent 40-80 s building fp32 weights on the host for
12 s of steps; ``data/calibration/h100_single_gpu.csv``, ``trial_wall_s``).
DeepSpeed then casts nothing and moves nothing, and keeps fp32 master copies of the
trainable parameters itself, as it did when it cast an fp32 build.

Random weights use a standard deviation of ``max(0.02, 1 / sqrt(hidden))``: Hugging Face's
0.02 (GPT-2's) bounds the largest logit a unit-RMS hidden state can reach on a random LM
head at ``0.02 * hidden``, 2.6 nats at hidden 128, so a tiny model whose head is frozen
(LoRA) could not learn even a deterministic task (measured on tiny-llama, V = 512: LoRA
plateaued at 3.75 nats on ``workers.rank.data``'s task, and reaches 0.03 with this scale);
``1 / sqrt(hidden)`` (LeCun's fan-in scale) lifts that bound to
``sqrt(hidden)``, and leaves every model of hidden >= 2500 at 0.02.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from pipette.autoep import DEEPSPEED_MOE_FAMILIES, autoep_family
from pipette.errors import SpecError
from pipette.model import ModelSpec

#: The torch dtype a rank builds and trains its model in: ``tf32`` trains in fp32, its matmuls on TF32
#: tensor cores (``workers.rank.devices.set_matmul_precision``).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
}


def llama_config(model: ModelSpec, attn_implementation: str = "sdpa", seq_len: int | None = None,
                 experts: bool = False) -> PretrainedConfig:
    """The Hugging Face config of ``model``: Llama's, or, where the model's attention is not Llama's
    (``ModelSpec.attention``), the family's that builds it: Qwen3's (q/k norms over each head),
    Qwen2's (q, k and v with a bias, o without), Llama's with ``head_dim`` and ``attention_bias``
    (an explicit head size, biases on all four). The decoder layers of the three take the same
    inputs, so every path of the runners drives them alike. What none builds (a sliding window
    ``seq_len`` exceeds, latent attention, sinks) is refused (``pipette.runners.builds_the_model``
    says so first). With ``experts``, an MoE model's experts as its Hugging Face family builds them
    (``moe_config``: the DeepSpeed runner, under AutoEP); without, its MLPs dense of ``ffn_hidden``, which
    the fsdp runner replaces with its own MoE layer (``workers.rank.moe_layer.use_moe``)."""
    if model.arch != "llama":
        raise SpecError(
            f"the trial runner builds Llama models, not {model.arch!r}",
            field="model.arch", fix="use a Llama-architecture model (arch: llama)",
        )
    shape = {
        "vocab_size": model.vocab, "hidden_size": model.hidden, "intermediate_size": model.ffn_hidden,
        "num_hidden_layers": model.layers, "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads, "max_position_embeddings": model.max_seq,
        "tie_word_embeddings": model.tied_embeddings, "use_cache": False,
        "initializer_range": max(0.02, model.hidden**-0.5),
    }
    a = model.attention
    config: PretrainedConfig
    if model.moe is not None and experts:
        config = moe_config(model, shape)
    elif a is None:
        config = LlamaConfig(**shape)
    else:
        unbuilt = a.unbuilt(model.hidden, model.heads, seq_len)
        if unbuilt:
            raise SpecError(f"{model.name}'s attention has {unbuilt}, which the trial runner does not build",
                            field="model.attention", fix="tune it with your own training script (--script)")
        if a.qk_norm:
            config = Qwen3Config(**shape, head_dim=a.head_dim, attention_bias=a.qkv_bias, use_sliding_window=False)
        elif a.qkv_bias and not a.o_bias:
            config = Qwen2Config(**shape, use_sliding_window=False)
        else:
            config = LlamaConfig(**shape, head_dim=a.head_dim, attention_bias=a.qkv_bias)
    config._attn_implementation = attn_implementation
    return config


def moe_config(model: ModelSpec, shape: dict[str, Any]) -> PretrainedConfig:
    """The Hugging Face config of a Mixture-of-Experts ``model`` of a family DeepSpeed's AutoEP has a
    preset for (``pipette.autoep.autoep_family``) whose attention the runner builds: Mixtral (Llama
    attention, routed experts alone), Qwen3-MoE (q/k norms; dense layers as ``mlp_only_layers``),
    Qwen2-MoE (q, k, v biases; a gated shared expert). The experts train under AutoEP
    (``workers.rank.autoep``). Another is refused (``pipette.space_moe.refuse_stack`` says so first)."""
    moe, a = model.moe, model.attention
    family = autoep_family(model)
    if moe is None or family not in DEEPSPEED_MOE_FAMILIES:
        raise SpecError(f"{model.name}'s experts are not of a family the DeepSpeed runner builds "
                        f"({', '.join(DEEPSPEED_MOE_FAMILIES)})", field="model.moe",
                        fix="plan it with --stack fsdp or --stack megatron, or tune your own script (--script)")
    sparse: dict[str, Any] = {"num_experts_per_tok": moe.top_k, "output_router_logits": False}
    head_dim = a.head_dim if a is not None else model.hidden // model.heads
    if family == "mixtral":
        return MixtralConfig(**{**shape, "intermediate_size": moe.expert_ffn}, head_dim=head_dim,
                             num_local_experts=moe.experts, **sparse)
    moe_shape: dict[str, Any] = {"moe_intermediate_size": moe.expert_ffn, "num_experts": moe.experts,
                                 "decoder_sparse_step": 1, "mlp_only_layers": list(moe.dense_layers),
                                 "use_sliding_window": False, **sparse}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**shape, **moe_shape, head_dim=head_dim,  # type: ignore[call-arg]  # a kwarg it keeps
                              attention_bias=False)
    return Qwen2MoeConfig(**shape, **moe_shape, shared_expert_intermediate_size=moe.shared_ffn, qkv_bias=True)


#: the model class of each config ``llama_config`` makes
CAUSAL_LM: dict[type, type] = {LlamaConfig: LlamaForCausalLM, Qwen2Config: Qwen2ForCausalLM,
                               Qwen3Config: Qwen3ForCausalLM, MixtralConfig: MixtralForCausalLM,
                               Qwen3MoeConfig: Qwen3MoeForCausalLM, Qwen2MoeConfig: Qwen2MoeForCausalLM}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_llama(
    model: ModelSpec,
    seed: int = 0,
    checkpoint: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seq_len: int | None = None,
    experts: bool = False,
) -> LlamaForCausalLM:
    """The model on ``device`` in ``dtype`` (fp32 on the host by default), for sequences of
    ``seq_len`` tokens (a sliding window they never exceed is left out); ``experts``: ``llama_config``'s."""
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_dir():
            raise SpecError(f"no checkpoint directory {checkpoint!r}", field="checkpoint", fix="give a local path")
        loaded = LlamaForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        if not isinstance(loaded, LlamaForCausalLM):
            raise SpecError(f"{checkpoint} holds a {type(loaded).__name__}, not a Llama model", field="checkpoint",
                            fix="give a Llama checkpoint (config.json with model_type llama)")
        moved: LlamaForCausalLM = loaded.to(torch.device(device))  # type: ignore[arg-type]  # HF wraps .to
        return moved
    torch.manual_seed(seed)  # seeds every device's generator: each rank builds the same weights
    with torch.device(device), _default_dtype(dtype):
        config = llama_config(model, seq_len=seq_len, experts=experts)
        built: LlamaForCausalLM = CAUSAL_LM[type(config)](config)
        return built
