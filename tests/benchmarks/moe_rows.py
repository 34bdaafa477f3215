"""The Mixture-of-Experts rows of the calibration sets as Pipette specs (issue 47).

* ``megatron_bridge_moe_dense.csv``: DeepSeek-V3 and Qwen3-30B-A3B under Megatron-Core (NVIDIA's
  Megatron-Bridge performance tables). The set gives no shapes for them: they are the presets of
  ``pipette.moe_presets`` (the models' published config.json). A "(tokendrop)" row runs with
  capacity factor 1 (Megatron-Bridge's token-drop variant: ``moe_expert_capacity_factor=1.0`` with
  ``moe_pad_expert_input_to_capacity``); every other row dropless. The multi-token-prediction
  module some DeepSeek-V3 rows train beside the model is not priced (its rows are kept and named).
* ``simumax_b200_megatron.csv``: SimuMax's DeepSeek-V2 and V3 truncated to 4 layers on 8 B200 under
  Megatron-LM with measured step times and peak allocated memory. Their shapes are SimuMax's
  launcher's (simu_tools/megatron_scripts/scripts/run_pretrain_deepseekv2.sh of
  github.com/MooreThreads/SimuMax): ``--moe-layer-freq ([0]*1+[1]*(L-1))`` (the first layer dense),
  DeepSeek-V2's 160 experts top-6 of width 1536 with a 3072-wide shared expert, V3's 256 top-8 of
  2048 with a 2048-wide shared expert; ``--moe-expert-capacity-factor 1`` with
  ``--moe-pad-expert-input-to-capacity``; MLA (q rank 1536, kv rank 512, 128 + 64 query-key and 128
  value per head); group-limited routing over ``ep`` groups (not a cost term here).

Rows on a GPU Pipette has no device for, or a layout a rule refuses, are counted in ``skipped``.
"""

from __future__ import annotations

import csv
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipette.attention import AttentionSpec, MlaSpec
from pipette.config import ParallelConfig
from pipette.device import GiB
from pipette.errors import PipetteError
from pipette.model import MODEL_PRESETS, ModelSpec
from pipette.moe import MoeSpec
from pipette.training import LoraSpec, TrainingSpec
from tests.benchmarks.calibration import (
    BRIDGE_GPUS,
    BRIDGE_LORA_RANK,
    BRIDGE_LORA_TARGETS,
    BRIDGE_RECIPES,
    Row,
    _bridge_cluster,
    _stack_cluster,
)

#: the preset of each Megatron-Bridge model name (before any " (variant)")
BRIDGE_MODELS = {"DeepSeekV3": "deepseek-v3", "Qwen3_30B_a3B": "qwen3-30b-a3b"}
@dataclass(frozen=True)
class BridgeMoeRecipe:
    """What a Megatron-Bridge MoE perf recipe sets that the step time reads."""

    #: ``flex`` for the flex dispatcher (DeepEP or HybridEP), else ``alltoall``
    dispatcher: str
    #: ``moe_a2a_overlap``: the all-to-all hidden under the other micro-batch's compute
    overlap: bool
    #: ``"mlp" in recompute_modules``: the MoE layer's forward run again in the backward
    mlp_recompute: bool
    #: ``cuda_graph_impl="full_iteration"``: the whole step one CUDA graph, so no layer waits on the host
    full_graph: bool = False


def bridge_recipe(row: Row) -> BridgeMoeRecipe:
    """The recipe a Megatron-Bridge MoE row ran, matched on its layout and release to the perf configs:
    the newest (scripts/performance/configs/deepseek/deepseek_workload_base_configs.py at 0426418 and
    configs/qwen/qwen3_workload_base_configs.py at 01b2977 of github.com/NVIDIA-NeMo/Megatron-Bridge)
    for the 26.x rows and the layouts they list, the 25.x ones (configs/{deepseek,qwen3}/
    workload_base_configs.py of github.com/pufanyi/Megatron-Bridge at 68aeacf / 3ee64eb) otherwise.
    DeepSeek-V3: MXFP8 on GB300 (pp 2, ep 32, micro-batch 1) and GB200 (pp 4, ep 64) overlap the
    all-to-all and run the step as one CUDA graph, the B200 ep 32 layout overlaps with DeepEP and
    recomputes ``mlp``; B300 runs HybridEP without overlap, its MXFP8 recipe at pp 8, ep 8, micro-batch 1
    as one CUDA graph with overlap (the set's B300 rows are other layouts); H100 runs DeepEP with overlap and
    recomputes ``mlp``; the others HybridEP (B200 ep 8: an all-to-all inside a node) without overlap.
    Qwen3-30B-A3B: HybridEP without overlap, except the H100 pp 2 x vp 12 recipe (alltoall with overlap)
    and B200 at micro-batch 1 (alltoall)."""
    model, _, gpu, _, precision = row.group[:5]
    cfg, new = row.config, row.row_id.startswith("mb:26.")
    if model.startswith("DeepSeekV3"):
        if gpu.startswith("GB"):
            newest = (cfg.pp, cfg.ep, cfg.mbs) == ((2, 32, 1) if gpu == "GB300" else (4, 64, 1))
            graphed = new and precision == "MXFP8" and newest
            return BridgeMoeRecipe("flex", graphed, False, full_graph=graphed)
        if gpu == "B200-180GB":
            return BridgeMoeRecipe("flex", cfg.ep == 32, cfg.ep == 32)
        if gpu == "B300":  # HybridEP without overlap; MXFP8 at pp 8, ep 8, micro-batch 1 one graph with overlap
            graphed = new and precision == "MXFP8" and (cfg.pp, cfg.ep, cfg.mbs) == (8, 8, 1)
            return BridgeMoeRecipe("flex", graphed, False, full_graph=graphed)
        return BridgeMoeRecipe("flex", True, True)
    if gpu == "H100-80GB" and cfg.pp > 1:
        return BridgeMoeRecipe("alltoall", True, False)
    if gpu == "B200-180GB" and cfg.mbs == 1:
        return BridgeMoeRecipe("alltoall", False, False)
    return BridgeMoeRecipe("flex", False, False)


#: DeepSeek-V3's decoder layers per pipeline chunk (pp x vp of them) in Megatron-Bridge's layouts
#: (``_get_deepseek_v3_pipeline_layout`` of megatron/bridge/recipes/deepseek/deepseek_v3.py, the perf configs'
#: ``pp_layout``: "Et*4|(t*4|)*14tmL" for 16 chunks, "Et|(tt|)*30mL" for H100's 32): the embedding beside the
#: first chunk's layers, the MTP module and the loss beside the last one's
DEEPSEEK_V3_CHUNK_LAYERS = {8: (8,) * 7 + (5,), 16: (4,) * 15 + (1,), 32: (1,) + (2,) * 30 + (0,)}


def bridge_moe_memory(row: Row) -> tuple[tuple[str, object], ...]:
    """What a Megatron-Bridge MoE row's recipe sets that its memory reads (``Row.recipe_memory``): both
    families' perf configs reduce the gradients in bf16 (``set_deepseek_v3_common_configs`` /
    ``set_qwen3_common_configs``: ``grad_reduce_in_fp32 = False``); DeepSeek-V3's recipe keeps Adam's moments
    in bf16 (``exp_avg_dtype`` / ``exp_avg_sq_dtype``), recomputes the perf config's ``recompute_modules``
    (25.x, workload_base_configs.py: GB300 ``moe_act``, GB200 and B200 ``mla_up_proj``, H100 with ``mlp``;
    26.x, deepseek_workload_base_configs.py: ``mla_up_proj`` (with ``mlp`` on B200 ep 32) except the
    GB300 MXFP8 micro-batch-1 full-iteration graph, none) and splits its 61 layers by its layout per rank
    (``DEEPSEEK_V3_CHUNK_LAYERS``). Qwen3-30B-A3B's recompute nothing."""
    out: list[tuple[str, object]] = [("bf16_fp32_grads", False)]
    if not row.group[0].startswith("DeepSeekV3"):
        return tuple(out)
    gpu, new, cfg = row.group[2], row.row_id.startswith("mb:26."), row.config
    recipe = bridge_recipe(row)
    if gpu == "GB300":
        modules: tuple[str, ...] = (() if recipe.full_graph else ("mla_up_proj",)) if new else ("moe_act",)
    else:
        modules = ("mla_up_proj",) + (("mlp",) if recipe.mlp_recompute else ())
    out += [("optimizer_moment_bytes", 4), ("recompute_modules", modules)]
    chunks = DEEPSEEK_V3_CHUNK_LAYERS.get(cfg.pp * cfg.virtual_stages)
    if chunks is not None:
        out.append(("stage_layers", tuple(sum(chunks[r::cfg.pp]) for r in range(cfg.pp))))
    return tuple(out)


@dataclass
class MoeSet:
    name: str
    rows: list[Row]
    skipped: Counter[str] = field(default_factory=Counter)


def bridge_model(name: str, seq: int) -> ModelSpec:
    """The preset of a Megatron-Bridge MoE row (capacity factor 1 for a token-drop variant)."""
    base, _, variant = name.partition(" (")
    m = MODEL_PRESETS[BRIDGE_MODELS[base]]
    moe = m.moe if m.moe is not None else None
    if moe is None:
        raise ValueError(f"{base} has no experts")
    capacity = 1.0 if variant.startswith("tokendrop") else None
    return replace(m, name=name.lower(), max_seq=max(m.max_seq, seq), moe=replace(moe, capacity_factor=capacity))


def _bridge_row(r: dict[str, str]) -> Row:
    seq, gb = int(r["seq"]), int(r["global_batch"])
    tp, pp, dp, ep, mbs, vp = (int(r[k]) for k in ("tp", "pp", "dp", "ep", "mbs", "vp"))
    lora = LoraSpec(BRIDGE_LORA_RANK, 2.0 * BRIDGE_LORA_RANK, BRIDGE_LORA_TARGETS) if r["method"] == "lora" else None
    schedule = "interleaved" if vp > 1 else "1f1b"
    training = TrainingSpec(global_batch=gb, seq_len=seq, dtype="bf16", optimizer="adamw", recompute=("none",),
                            zero_stages=(1,), schedules=(schedule,), method="lora" if lora else "full", lora=lora)
    # Megatron-Bridge's MoE recipes run the experts without tensor parallelism (expert_tensor_parallel_size 1)
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, etp=1, mbs=mbs, global_batch=gb, zero_stage=1,
                            recompute="none", schedule=schedule, virtual_stages=vp)
    recipe = BRIDGE_RECIPES[r["precision"]]
    row = Row(source="megatron_bridge", group=(r["model"], r["task"], r["gpu"], r["world"], r["precision"]),
               model=bridge_model(r["model"], seq), training=training, config=config,
               cluster=_bridge_cluster(r["gpu"], int(r["nodes"]), int(r["gpus_per_node"])), ok=True,
               step_time=float(r["meas_step_s"]), tokens_per_s_per_gpu=float(r["tps_per_gpu"]),
               stack="megatron" + (f"+{recipe}" if recipe else ""), row_id=r["row_id"])
    # the recipe's token dispatcher is the candidate's (pipette.routing): the step time and the memory read it
    flex = bridge_recipe(row).dispatcher == "flex" and tp * ep > 1
    row = replace(row, config=replace(config, dispatcher="flex" if flex else None))
    return replace(row, recipe_memory=bridge_moe_memory(row))


def load_bridge_moe(directory: Path) -> MoeSet:
    """The MoE rows, one per layout: a layout the set repeats over releases keeps its newest release's
    row (the file lists the newest first; the README: "treat a release as part of the stack, or keep
    one row per layout": an older release's slower run of the same layout is the software's progress,
    which no step-time model of one stack can tell apart)."""
    out = MoeSet("megatron_bridge_moe", [])
    seen: set[tuple[str, ...]] = set()
    with open(directory / "megatron_bridge_moe_dense.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["layers"]:
                continue  # a dense row: tests/benchmarks/calibration.py's
            # a precision by its recipe: the 25.x tables' "FP8-MX" / "FP8-CS" are the 26.x "MXFP8" / "FP8"
            precision = BRIDGE_RECIPES.get(r["precision"], r["precision"])
            key = (precision, *(r[k] for k in ("model", "task", "method", "gpu", "world", "tp", "pp", "dp", "ep",
                                               "cp", "vp", "mbs", "global_batch", "seq")))
            if key in seen:
                out.skipped["an older release of a layout kept once"] += 1
                continue
            seen.add(key)
            if r["gpu"] not in BRIDGE_GPUS:  # no device preset to build its cluster on
                out.skipped[f"no cluster preset for {r['gpu']}"] += 1
                continue
            try:
                out.rows.append(_bridge_row(r))
            except (PipetteError, ValueError, KeyError) as e:
                out.skipped[str(e).split("(")[0].strip()] += 1
    return out


def simumax_model(name: str) -> ModelSpec:
    """DeepSeek-V2 / V3 truncated as SimuMax's launcher builds them (the module docstring)."""
    layers = int(name.rsplit("-l", 1)[1])
    mla = MlaSpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    attention = AttentionSpec(head_dim=192, qk_norm=False, mla=mla)
    if name.startswith("deepseekv2"):
        hidden, ffn, vocab = 5120, 12288, 102400
        moe = MoeSpec(experts=160, top_k=6, expert_ffn=1536, shared_experts=2, shared_ffn=3072, dense_layers=(0,),
                      capacity_factor=1.0)
    else:
        hidden, ffn, vocab = 7168, 18432, 129280
        moe = MoeSpec(experts=256, top_k=8, expert_ffn=2048, shared_experts=1, shared_ffn=2048, dense_layers=(0,),
                      capacity_factor=1.0)
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=128, kv_heads=128, ffn_hidden=ffn, vocab=vocab,
                     max_seq=4096, tied_embeddings=False, arch="llama", moe=moe, attention=attention)


def load_simumax_moe(directory: Path) -> MoeSet:
    out = MoeSet("simumax_b200_moe", [])
    with open(directory / "simumax_b200_megatron.csv", newline="") as f:
        for r in csv.DictReader(f):
            if not r["model"].startswith("deepseek"):
                continue
            seq, gb = int(r["seq"]), int(r["global_batch"])
            training = TrainingSpec(global_batch=gb, seq_len=seq, dtype="bf16", optimizer="adamw",
                                    recompute=("none",), zero_stages=(1,), schedules=("1f1b",))
            config = ParallelConfig(tp=int(r["tp"]), pp=int(r["pp"]), dp=int(r["dp"]), ep=int(r["ep"]),
                                    mbs=int(r["mbs"]), global_batch=gb, zero_stage=1)
            out.rows.append(Row(
                source="simumax", group=(r["model"], r["world"], r["seq"], r["precision"]),
                model=simumax_model(r["model"]), training=training, config=config,
                cluster=_stack_cluster(r["gpu"], int(r["nodes"]), int(r["gpus_per_node"])), ok=True,
                step_time=float(r["meas_step_s"]), peak_memory=float(r["meas_mem_gib"]) * GiB, stack="megatron",
                memory_kind=r["mem_kind"], fused_loss=True, row_id=r["row_id"],
                reserved_memory=float(r["meas_mem2_gib"]) * GiB if r["meas_mem2_gib"] else None))
    return out


__all__ = ["BRIDGE_MODELS", "DEEPSEEK_V3_CHUNK_LAYERS", "BridgeMoeRecipe", "MoeSet", "bridge_model",
           "bridge_moe_memory", "bridge_recipe", "load_bridge_moe", "load_simumax_moe", "simumax_model"]
