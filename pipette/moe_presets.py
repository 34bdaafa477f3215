"""The Mixture-of-Experts presets: the shape fields of each released config.json on the Hugging
Face Hub (repository named beside each), read by ``pipette.moe_config`` as a file would be.

Model cards, for the parameter counts the tests check (tests/unit/test_moe_model.py):
Mixtral-8x7B 46.7B total / 12.9B active and Mixtral-8x22B 141B / 39B (Mistral AI, "Mixtral of
experts", 2023-12-11, and "Cheaper, Better, Faster, Stronger", 2024-04-17); Qwen3-30B-A3B 30.5B /
3.3B and Qwen3-235B-A22B 235B / 22B (their Hugging Face model cards); DeepSeek-V3 671B / 37B
(its model card; 36.6B in README_WEIGHTS.md), DeepSeek-V2-Lite 15.7B / 2.4B (DeepSeek-V2 paper,
arXiv 2405.04434, app. B); gpt-oss-120b 116.83B / 5.13B and gpt-oss-20b 20.91B / 3.61B (OpenAI,
gpt-oss-120b & gpt-oss-20b model card, arXiv 2508.10925, table 1); Qwen1.5-MoE-A2.7B 14.3B /
2.7B and Qwen2-57B-A14B 57B / 14B (their model cards).

Two tiny ones train in seconds on a CPU (``tiny-llama``'s attention, 8 experts, top-2), for the
PyTorch-native runner's trials with expert parallelism (``workers.rank.moe_layer``): ``tiny-moe``
in Mixtral's fields (routed experts only), ``tiny-moe-shared`` in Qwen2-MoE's (a shared expert
behind its sigmoid gate, no q/k/v biases, top-k weights renormalised as Mixtral's).
"""

from __future__ import annotations

from typing import Any

_QWEN3 = {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "head_dim": 128,
          "num_key_value_heads": 4, "vocab_size": 151936, "max_position_embeddings": 40960, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": False, "tie_word_embeddings": False}
_DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 (the same shapes as DeepSeek-V3-Base, -0324 and R1)
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "num_nextn_predict_layers": 1, "vocab_size": 129280, "max_position_embeddings": 163840,
    "attention_bias": False, "tie_word_embeddings": False,
}
_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4, "experts_per_token": 4,
            "vocab_size": 201088, "max_position_embeddings": 131072, "sliding_window": 128, "attention_bias": True,
            "tie_word_embeddings": False}
_QWEN2_MOE = {"model_type": "qwen2_moe", "decoder_sparse_step": 1, "vocab_size": 151936, "tie_word_embeddings": False,
              "use_sliding_window": False}

#: preset name -> the shape fields of the released config.json
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False,
    },
    "mixtral-8x22b": {  # mistralai/Mixtral-8x22B-v0.1
        "model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
        "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "max_position_embeddings": 65536, "sliding_window": None, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32},  # Qwen/Qwen3-30B-A3B
    "qwen3-235b-a22b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                        "num_hidden_layers": 94, "num_attention_heads": 64},  # Qwen/Qwen3-235B-A22B
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-v2-lite": {  # deepseek-ai/DeepSeek-V2-Lite
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 102400, "max_position_embeddings": 163840, "attention_bias": False, "tie_word_embeddings": False,
    },
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},  # openai/gpt-oss-20b
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},  # openai/gpt-oss-120b
    "qwen1.5-moe-a2.7b": {  # Qwen/Qwen1.5-MoE-A2.7B
        **_QWEN2_MOE, "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "max_position_embeddings": 8192,
    },
    "qwen2-57b-a14b": {  # Qwen/Qwen2-57B-A14B
        **_QWEN2_MOE, "hidden_size": 3584, "intermediate_size": 18944, "moe_intermediate_size": 2560,
        "shared_expert_intermediate_size": 20480, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 131072,
    },
    # tiny models for CPU trials: not released models, the fields of their families' config.json
    "tiny-moe": {
        "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 512, "max_position_embeddings": 256, "sliding_window": None, "tie_word_embeddings": False,
    },
    "tiny-moe-shared": {
        **_QWEN2_MOE, "hidden_size": 128, "intermediate_size": 344, "moe_intermediate_size": 96,
        "shared_expert_intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
        "vocab_size": 512, "qkv_bias": False, "norm_topk_prob": True,
    },
}

__all__ = ["MOE_CONFIGS"]
