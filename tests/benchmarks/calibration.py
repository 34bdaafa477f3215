"""Load the measured calibration sets of ``data/calibration/`` as Pipette specs.

Shared by the accuracy, memory and tuner-replay benchmarks and their tests. The project carries
the files it reads (``data/calibration/README.md``: each file's source, commit and license), so a
clone reproduces the fits; ``calibration_dir()`` is the one place that finds them.

What each set is (from its README):
* vTrain: GPT on one node of A100 (2/4/8 GPUs), seq 1024, 16 heads, full recomputation,
  1F1B, fp16, Megatron-DeepSpeed (Bang et al. 2024).
* Ultra-Scale: Llama 3.2-1B / 3.2-3B / 3.1-8B shapes on 1-64 nodes of 8x H100 80GB,
  seq 4096, global batch 256, ZeRO 0/1, nanotron (HF Ultra-Scale Playbook, 2025).
* The three stack sets (``STACK_SETS``, one column layout): llm-foundry FSDP and torchtitan
  FSDP2 on H100, Megatron-LM on B200 (SimuMax); each row names its stack's options.
"""

from __future__ import annotations

import csv
import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipette.cluster import ClusterProfile
from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.device import GB, DeviceSpec, GiB
from pipette.errors import PipetteError
from pipette.memory import MemoryOptions
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

# Link figures of the machines the sets were measured on (vendor data sheets), per GPU
# and per direction: DGX A100 NVLink3 300 GB/s; H100 SXM NVLink4 450 GB/s; the
# playbook's cluster (AWS p5) has 3200 Gbit/s of EFA per node of 8 GPUs = 50 GB/s per GPU.
A100_NVLINK = 300e9
H100_NVLINK = 450e9
H100_NODE_NIC_PER_GPU = 50e9

ULTRASCALE_MODELS = {"1B": "llama3.2-1b", "3B": "llama3.2-3b", "8B": "llama3.1-8b"}


#: The repo's copy of the calibration sets (data/calibration/README.md says where each came from)
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "calibration"

#: Every file the loaders below read: the project carries exactly these
DATA_FILES = ("vtrain_a100_single_node.csv", "ultrascale_h100_1b_3b_8b.csv", "h100_single_gpu.csv",
              "llmfoundry_h100_fsdp.csv", "torchtitan_h100_fsdp2.csv", "simumax_b200_megatron.csv",
              "megatron_bridge_moe_dense.csv")


def calibration_dir() -> Path:
    """The repo's ``data/calibration``, or ``$PIPETTE_CALIBRATION_DIR`` (another folder of the
    same files) where that is set; a folder that is missing is an error, never a silent skip."""
    env = os.environ.get("PIPETTE_CALIBRATION_DIR")
    directory = Path(env) if env else DATA_DIR
    if not directory.is_dir():
        where = f"PIPETTE_CALIBRATION_DIR={env}" if env else f"the repo's {DATA_DIR}"
        raise PipetteError(f"no calibration data at {where}: unset PIPETTE_CALIBRATION_DIR to use the "
                           "repo's data/calibration, or restore that folder from git")
    return directory


@dataclass(frozen=True)
class Row:
    """One measured configuration."""

    source: str  # "vtrain" or "ultrascale"
    group: tuple[str, ...]  # the (model, #GPUs[, global batch]) group it belongs to
    model: ModelSpec
    training: TrainingSpec
    config: ParallelConfig
    cluster: ClusterProfile
    ok: bool  # False: crashed or ran out of memory (ultrascale nan rows)
    step_time: float | None  # seconds per optimizer step, when ok
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None  # fraction, as reported
    peak_memory: float | None = None  # bytes (GB in the file, 1e9 bytes)
    #: the stack that ran it (``pipette.stacks`` name with options), and what peak_memory is
    stack: str = ""
    memory_kind: str = ""
    #: whether the run's loss was a fused kernel (``MemoryOptions.fused_loss``) where the framework
    #: decides it apart from the stack's options (``fused_loss``); None: as the stack says
    fused_loss: bool | None = None
    #: the set's own id of the row (``row_id`` of the stack sets)
    row_id: str = ""
    #: the allocator's peak reserved bytes where the set measured them beside ``peak_memory``
    #: (SimuMax's ``meas_mem2_gib``: allocated first, reserved second)
    reserved_memory: float | None = None
    #: memory options the run's own recipe set apart from its stack's (``as_run``), as (field, value)
    recipe_memory: tuple[tuple[str, object], ...] = ()

    @property
    def measured_kind(self) -> str:
        """Which of the estimate's two figures ``peak_memory`` is: "live" (the allocator's peak
        allocated) or "reserved" (its peak reserved, or a figure of unknown kind: the reserved
        estimate is what the fragmentation constants were fitted on)."""
        return "live" if "allocated" in self.memory_kind else "reserved"

    @property
    def needed_memory(self) -> float | None:
        """What the device had to hold, where measured: the peak reserved bytes."""
        return self.reserved_memory if self.measured_kind == "live" else self.peak_memory


_CLUSTERS: dict[tuple[str, int], ClusterProfile] = {}


def _cluster(kind: str, gpus: int) -> ClusterProfile:
    key = (kind, gpus)
    if key not in _CLUSTERS:
        if kind == "a100":
            _CLUSTERS[key] = homogeneous_cluster(
                "A100-80GB", 1, gpus, A100_NVLINK, A100_NVLINK, name=f"dgx-a100-{gpus}"
            )
        else:
            nodes = max(1, gpus // 8)
            _CLUSTERS[key] = homogeneous_cluster(
                "H100-80GB", nodes, min(8, gpus), H100_NVLINK, H100_NODE_NIC_PER_GPU,
                intra_latency=3e-6, inter_latency=10e-6, name=f"p5-{nodes}x8",
            )
    return _CLUSTERS[key]


def load_vtrain(directory: Path) -> list[Row]:
    rows = []
    with open(directory / "vtrain_a100_single_node.csv") as f:
        for r in csv.DictReader(f):
            gpus = int(r["# GPUs"])
            hidden, layers, heads = int(r["hidden size"]), int(r["# layers"]), int(r["attention heads"])
            seq, gb, mbs = int(r["sequence length"]), int(r["global batch"]), int(r["micro batch"])
            tp, dp, pp = (int(r[k]) for k in ("tensor parallelism", "data parallelism", "pipeline parallelism"))
            model = ModelSpec.gpt(hidden, layers, heads, max_seq=seq, name=f"vtrain-gpt-h{hidden}-l{layers}")
            training = TrainingSpec(global_batch=gb, seq_len=seq, dtype="fp16", optimizer="adam", recompute=("full",))
            config = ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=mbs, global_batch=gb, zero_stage=0, recompute="full")
            rows.append(
                Row(
                    source="vtrain", group=(model.name, str(gpus), str(gb)), model=model,
                    training=training, config=config, cluster=_cluster("a100", gpus), ok=True,
                    step_time=float(r["iteration time (ms)"]) / 1e3,
                )
            )
    return rows


def load_ultrascale(directory: Path) -> list[Row]:
    rows = []
    with open(directory / "ultrascale_h100_1b_3b_8b.csv") as f:
        for r in csv.DictReader(f):
            model = ModelSpec.preset(ULTRASCALE_MODELS[r["model"]])
            gpus = int(r["gpus"])
            dp, tp, pp, mbs, gbs = (int(r[k]) for k in ("dp", "tp", "pp", "mbs", "gbs"))
            training = TrainingSpec(
                global_batch=gbs, seq_len=4096, dtype="bf16", optimizer="adamw", recompute=("none",)
            )
            config = ParallelConfig(
                tp=tp, pp=pp, dp=dp, mbs=mbs, global_batch=gbs, zero_stage=int(r["zero"]), recompute="none"
            )
            ok = not math.isnan(float(r["mfu_pct"]))
            tps_gpu = float(r["tok_per_s_per_gpu"]) if ok else None
            rows.append(
                Row(
                    source="ultrascale", group=(r["model"], r["nodes"]), model=model, training=training,
                    config=config, cluster=_cluster("h100", gpus), ok=ok,
                    step_time=(gbs * 4096 / float(r["tok_per_s"])) if ok else None,
                    tokens_per_s_per_gpu=tps_gpu,
                    mfu=float(r["mfu_pct"]) / 100 if ok else None,
                    peak_memory=float(r["gpu_mem_gb"]) * 1e9 if ok else None,
                )
            )
    return rows


@dataclass(frozen=True)
class GpuRun:
    """One row of ``h100_single_gpu.csv``: a real single-GPU trial and what it measured."""

    runner: str
    model: ModelSpec
    training: TrainingSpec
    config: ParallelConfig
    status: str
    step_time: float | None
    peak_allocated_gib: float | None
    trial_wall_s: float | None

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.training.method} seq{self.training.seq_len} {self.config.label}"


def load_h100_single_gpu(directory: Path) -> list[GpuRun]:
    """The rows of ``h100_single_gpu.csv`` (one H100 80GB, bf16, AdamW, ZeRO-0, tp = pp = dp = 1)."""
    from pipette.training import LoraSpec

    out = []
    with open(directory / "h100_single_gpu.csv", newline="") as f:
        for r in csv.DictReader(f):
            lora = None
            if r["method"] == "lora":
                lora = LoraSpec(rank=int(r["lora_rank"]), alpha=2.0 * int(r["lora_rank"]),
                                targets=tuple(r["lora_targets"].split(",")))
            training = TrainingSpec(global_batch=int(r["global_batch"]), seq_len=int(r["seq_len"]),
                                    dtype=r["dtype"], optimizer=r["optimizer"],  # type: ignore[arg-type]
                                    method=r["method"], lora=lora)  # type: ignore[arg-type]
            config = ParallelConfig(tp=int(r["tp"]), pp=int(r["pp"]), dp=int(r["dp"]), mbs=int(r["mbs"]),
                                    global_batch=int(r["global_batch"]), zero_stage=int(r["zero_stage"]),
                                    recompute=r["recompute"])  # type: ignore[arg-type]
            out.append(GpuRun(
                runner=r["runner"], model=ModelSpec.preset(r["model"]), training=training, config=config,
                status=r["status"], step_time=float(r["step_time_s"]) if r["step_time_s"] else None,
                peak_allocated_gib=float(r["peak_allocated_gib"]) if r["peak_allocated_gib"] else None,
                trial_wall_s=float(r["trial_wall_s"]) if r["trial_wall_s"] else None,
            ))
    return out


# ---- the stack sets: llmfoundry_h100_fsdp.csv, torchtitan_h100_fsdp2.csv, simumax_b200_megatron.csv ----
#: file -> the stack its framework is (the README's calibration list)
STACK_SETS = {
    "llmfoundry_h100_fsdp.csv": "fsdp",
    "torchtitan_h100_fsdp2.csv": "fsdp",
    "simumax_b200_megatron.csv": "megatron",
}
# NVLink per GPU and direction (data sheets): H100 NVLink4 450 GB/s, B200 NVLink5 900 GB/s; between
# nodes 400 Gbit/s per GPU = 50 GB/s (what the llm-foundry rows assume; torchtitan's cluster alike).
B200_NVLINK = 900e9
#: torchtitan's H100s run capped at 500 W (96 GB HBM2e at 2.4 TB/s: the rows' assumptions and the
#: README), where the SXM part's 989 TF/s bf16 peak is rated at 700 W. The set gives no clocks, so
#: the share of the tensor-core peak reached under the cap is fitted (tests/benchmarks/torchtitan_fit.py)
#: on its two eager bf16 runs (8B, 1D FSDP on 8 and 128 GPUs: no compile, no FP8), and held out on
#: every other torchtitan run. A device figure of this set, not a stack constant.
TORCHTITAN_POWER_CAP_SHARE = 0.715


def h100_96gb(share: float = TORCHTITAN_POWER_CAP_SHARE) -> DeviceSpec:
    """torchtitan's power-capped H100 96GB, its tensor-core peaks scaled by ``share``; its fused attention
    at the uncapped bf16 peak (``DeviceSpec.attention_flops``: assumed, not measured, that the cap lowers
    the clocks under the power-bound GEMMs, not under FlashAttention; docs/context-parallel.md, "Measured
    against the shared cp runs")."""
    peaks = {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12}
    return DeviceSpec("H100-96GB-HBM2e", 96 * GB, {k: v * share for k, v in peaks.items()}, 2.4e12,
                      attention_flops=peaks["bf16"])


H100_96GB = h100_96gb()


@dataclass
class StackSet:
    """The rows of one stack set that Pipette can express, and why the others were skipped."""

    name: str
    stack: str
    rows: list[Row]
    skipped: Counter[str] = field(default_factory=Counter)


def stack_cluster(gpu: str, nodes: int, per_node: int, device: DeviceSpec | None = None) -> ClusterProfile:
    """The cluster of a stack set's row (``device``: another spec for its GPUs, for fitting)."""
    if device is not None:
        intra = B200_NVLINK if gpu.startswith("B200") else H100_NVLINK
        return homogeneous_cluster(device, nodes, per_node, intra, H100_NODE_NIC_PER_GPU, intra_latency=3e-6,
                                   inter_latency=10e-6, name=f"{gpu}-{nodes}x{per_node}")
    return _stack_cluster(gpu, nodes, per_node)


def _stack_cluster(gpu: str, nodes: int, per_node: int) -> ClusterProfile:
    device = H100_96GB if gpu == "H100-96GB-HBM2e" else DeviceSpec.preset(gpu)
    intra = B200_NVLINK if gpu.startswith("B200") else H100_NVLINK
    key = (gpu, nodes * per_node)
    if key not in _STACK_CLUSTERS:
        _STACK_CLUSTERS[key] = homogeneous_cluster(device, nodes, per_node, intra, H100_NODE_NIC_PER_GPU,
                                                   intra_latency=3e-6, inter_latency=10e-6,
                                                   name=f"{gpu}-{nodes}x{per_node}")
    return _STACK_CLUSTERS[key]


_STACK_CLUSTERS: dict[tuple[str, int], ClusterProfile] = {}


def _stack_key(base: str, r: dict[str, str]) -> str:
    options = []
    if r["compile"] == "1":
        options.append("compile")
    if r["float8"] == "1" or r["precision"] == "fp8":
        # torchtitan's 2025 async-TP runs name their Float8 recipe in the row's assumptions
        options.append("fp8-rowwise" if "float8 rowwise" in r["assumptions"] else "fp8")
    if r["async_tp"] == "1":
        options.append("async-tp")
    return "+".join([base, *sorted(options)])


def fused_loss(r: dict[str, str]) -> bool | None:
    """Whether a run's cross-entropy was fused (``MemoryOptions.fused_loss``) where its framework, not
    the stack's options, decides: True for llm-foundry (MPT's default ``loss_fn`` is
    ``fused_crossentropy``, flash-attn's kernel: llmfoundry/models/mpt/modeling_mpt.py); False for a
    compiled torchtitan run of the December 2024 tables (sections "Table N" of
    benchmarks/llama3_h100_202412_torchtitan.md), whose train.py compiled the blocks only ("TODO:
    compiling loss function causes CUDA errors, turning off for now"; its 2025 runs compile the loss
    too: torchtitan/components/loss.py, ``build_cross_entropy_loss``). None: as the stack says."""
    if r["source"] == "llmfoundry":
        return True
    if r["source"] == "torchtitan" and r["compile"] == "1" and r["section"].startswith("Table"):
        return False
    return None


def as_run(row: Row, options: MemoryOptions) -> MemoryOptions:
    """``options`` (the row's own stack's) with the loss as the run had it (``Row.fused_loss``) and what
    else its recipe set (``Row.recipe_memory``)."""
    options = options if row.fused_loss is None else replace(options, fused_loss=row.fused_loss)
    return replace(options, **dict(row.recipe_memory)) if row.recipe_memory else options  # type: ignore[arg-type]


def row_memory_options(row: Row) -> MemoryOptions:
    """The memory options a row is estimated with: its stack's (with the row's options), as run."""
    from pipette.stacks import get_stack

    return as_run(row, get_stack(row.stack).memory_options)


def _stack_row(name: str, base: str, r: dict[str, str]) -> Row:
    """One expressible row as Pipette specs (bf16 training; fp8 is the stack's option)."""
    seq, gb = int(r["seq"]), int(r["global_batch"])
    model = ModelSpec(name=r["model"], layers=int(r["layers"]), hidden=int(r["hidden"]), heads=int(r["heads"]),
                      kv_heads=int(r["kv_heads"]), ffn_hidden=int(r["ffn"]), vocab=int(r["vocab"]),
                      max_seq=max(int(r["max_seq"]), seq), tied_embeddings=r["tied"] == "1",
                      arch=r["arch"])  # type: ignore[arg-type]
    recompute, schedule = r["recompute"], r["schedule"]
    training = TrainingSpec(global_batch=gb, seq_len=seq, dtype="bf16", optimizer="adamw",
                            recompute=(recompute,), zero_stages=(int(r["zero_stage"]),),  # type: ignore[arg-type]
                            schedules=(schedule,))  # type: ignore[arg-type]
    config = ParallelConfig(tp=int(r["tp"]), pp=int(r["pp"]), dp=int(r["dp"]), mbs=int(r["mbs"]), global_batch=gb,
                            zero_stage=int(r["zero_stage"]), recompute=recompute,  # type: ignore[arg-type]
                            schedule=schedule, virtual_stages=int(r["virtual_stages"]))  # type: ignore[arg-type]
    if config.grad_accum != int(r["grad_accum"]):
        raise ValueError("grad_accum disagrees with global_batch / (dp x mbs)")
    cluster = _stack_cluster(r["gpu"], int(r["nodes"]), int(r["gpus_per_node"]))
    mem = float(r["meas_mem_gib"]) * GiB if r["meas_mem_gib"] else None
    reserved = float(r["meas_mem2_gib"]) * GiB if r.get("meas_mem2_gib") and "reserved" in r.get("mem2_kind", "") \
        else None
    return Row(source=name, group=(r["model"], r["world"], r["seq"], r["precision"]), model=model, training=training,
               config=config, cluster=cluster, ok=True, step_time=float(r["meas_step_s"]),
               tokens_per_s_per_gpu=float(r["tps_per_gpu"]) if r["tps_per_gpu"] else None,
               mfu=float(r["mfu_reported"]) if r["mfu_reported"] else None, peak_memory=mem,
               stack=_stack_key(base, r), memory_kind=r["mem_kind"], fused_loss=fused_loss(r),
               row_id=r["row_id"], reserved_memory=reserved)


def load_stack_set(directory: Path, name: str) -> StackSet:
    """The rows of ``name`` (a key of ``STACK_SETS``): those not expressible (a context- or
    expert-parallel degree) or whose figures disagree are skipped, counted by reason. A row marked
    ``suspect`` is skipped too. Every row's ``assumptions`` were read before writing this loader."""
    base = STACK_SETS[name]
    out = StackSet(name.removesuffix(".csv"), base, [])
    with open(directory / name, newline="") as f:
        for r in csv.DictReader(f):
            if r["expressible"] != "1":
                out.skipped[r["skip_reason"].split(":")[0] or "not expressible"] += 1
                continue
            if r["suspect"]:
                out.skipped[f"suspect: {r['suspect']}"] += 1
                continue
            try:
                out.rows.append(_stack_row(out.name, base, r))
            except (PipetteError, ValueError) as e:
                out.skipped[str(e).split("(")[0].strip()] += 1
    return out


# ---- megatron_bridge_moe_dense.csv: Megatron-Core at scale (NVIDIA's Megatron-Bridge performance summaries) ----
#: the set's GPU names -> Pipette's presets
BRIDGE_GPUS = {"H100-80GB": "H100-80GB", "B200-180GB": "B200-180GB", "GB200": "GB200-186GB", "GB300": "GB300-288GB",
               "B300": "B300-288GB"}
#: the recipe's precision -> the megatron stack's option that prices it (per-tensor current scaling is
#: ``fp8``; blockwise MXFP8 ``mxfp8``; NVFP4 ``nvfp4``)
BRIDGE_RECIPES = {"FP8": "fp8", "FP8-CS": "fp8", "MXFP8": "mxfp8", "FP8-MX": "mxfp8", "NVFP4": "nvfp4", "BF16": "te"}
#: Megatron-Bridge's LoRA (docs/training/peft.md of NVIDIA-NeMo/Megatron-Bridge: ``LoRA(target_modules=
#: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dim=16, alpha=32)``): every linear layer
BRIDGE_LORA_RANK = 16
BRIDGE_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The fine-tuning rows (task ``sft`` and ``lora``) pack SQuAD into each sequence (the perf configs,
#: scripts/performance/configs/llama/llama3_llm_finetune.py: ``packed_sequence=True``; the recipe's dataset,
#: recipes/llama/llama3.py ``_llama3_finetune_common``: ``default_squad_config``), and Megatron-Core
#: attends within each sample (THD). A SQuAD sample is a Wikipedia paragraph, a question and its answer:
#: a few hundred tokens. Not measured here (no dataset on this machine) and not fitted: the rows' predictions
#: move 1.5% between 256 and 1,024 (docs/results.md, "Cross-validated step time per stack")
BRIDGE_SQUAD_DOCUMENT = 256
#: NVLink per GPU and direction: NVLink 5 on B200, B300, GB200 and GB300 (900 GB/s; the NVL72 racks' trays of 4
#: in one 72-GPU domain), NVLink 4 on H100; between nodes 400 Gbit/s per GPU (ConnectX-7: DGX H100 and B200,
#: GB200 NVL72), 800 Gbit/s on the parts built with ConnectX-8 (DGX B300 and GB300 NVL72 data sheets)
BRIDGE_NVLINK = {"H100-80GB": H100_NVLINK, "B200-180GB": 900e9, "GB200": 900e9, "GB300": 900e9, "B300": 900e9}
BRIDGE_NIC = {"GB300": 100e9, "B300": 100e9}


#: Megatron-Bridge's performance runs fuse the cross entropy (scripts/performance/utils/overrides.py,
#: ``_set_common_perf_overrides``: ``cross_entropy_fusion_impl = "te"``, with the providers'
#: ``cross_entropy_loss_fusion = True``): Transformer Engine's kernel writes the logits' gradient in place
#: (``MemoryOptions.fused_loss``)
BRIDGE_FUSED_LOSS = True
#: ... and reduce the Llama models' gradients in bf16: ``set_llama3_common_configs`` and
#: ``set_llama31_common_configs`` (scripts/performance/configs/llama/llama3_llm_pretrain.py,
#: llama31_llm_pretrain.py) set ``mixed_precision.grad_reduce_in_fp32 = False`` and
#: ``ddp.grad_reduce_in_fp32 = False``, so the gradient buffer is bf16, not Megatron-LM's fp32 default
#: (``MemoryOptions.bf16_fp32_grads``). Taken for every Llama row (the SFT and LoRA configs not re-read)
BRIDGE_LLAMA_RECIPE_MEMORY: tuple[tuple[str, object], ...] = (("bf16_fp32_grads", False),)


def _bridge_cluster(gpu: str, nodes: int, per_node: int) -> ClusterProfile:
    key = (f"bridge-{gpu}", nodes * per_node)
    if key not in _STACK_CLUSTERS:
        nvlink = BRIDGE_NVLINK[gpu]
        # an NVL72 rack is one NVLink domain: trays of 4 reach each other at NVLink speed. A run beyond one
        # rack is placed in Slurm segments of the largest divisor of its trays up to 18 (Megatron-Bridge's
        # scripts/performance/utils/executors.py, slurm_executor: "--segment" when 4 GPUs a node and over
        # 18 nodes): 64 trays run as 4 racks of 16, so a 64-GPU group is one domain; beyond it the NICs
        segment = next(n for n in range(18, 0, -1) if nodes % n == 0) if nodes > 18 else nodes
        domain = segment * per_node if gpu.startswith("GB") else per_node
        data = {"name": f"{gpu}-{nodes}x{per_node}", "device": BRIDGE_GPUS[gpu], "nodes": nodes,
                "devices_per_node": per_node, "intra_node": {"bandwidth": nvlink, "latency": 3e-6},
                "inter_node": {"bandwidth": BRIDGE_NIC.get(gpu, H100_NODE_NIC_PER_GPU), "latency": 10e-6}}
        if domain > per_node and nodes * per_node > per_node:
            data["nvlink_domain"] = {"devices": min(domain, nodes * per_node), "bandwidth": nvlink, "latency": 3e-6}
        from pipette.clusterfile import cluster_from_dict

        _STACK_CLUSTERS[key] = cluster_from_dict(data)
    return _STACK_CLUSTERS[key]


def _bridge_row(r: dict[str, str]) -> Row:
    """One dense Megatron-Bridge row as Pipette specs (bf16 training; the recipe is the stack's option)."""
    from pipette.training import LoraSpec

    seq, gb = int(r["seq"]), int(r["global_batch"])
    tp, pp, dp, mbs, vp = (int(r[k]) for k in ("tp", "pp", "dp", "mbs", "vp"))
    model = ModelSpec(name=r["model"].lower(), layers=int(r["layers"]), hidden=int(r["hidden"]), heads=int(r["heads"]),
                      kv_heads=int(r["kv_heads"]), ffn_hidden=int(r["ffn"]), vocab=int(r["vocab"]), max_seq=seq,
                      tied_embeddings=False, arch="llama")
    lora = LoraSpec(BRIDGE_LORA_RANK, 2.0 * BRIDGE_LORA_RANK, BRIDGE_LORA_TARGETS) if r["method"] == "lora" else None
    schedule = "interleaved" if vp > 1 else "1f1b"
    training = TrainingSpec(global_batch=gb, seq_len=seq, dtype="bf16", optimizer="adamw", recompute=("none",),
                            zero_stages=(1,), schedules=(schedule,), method="lora" if lora else "full",
                            lora=lora, document_len=BRIDGE_SQUAD_DOCUMENT if r["task"] in ("sft", "lora") else None)
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=mbs, global_batch=gb, zero_stage=1, recompute="none",
                            schedule=schedule, virtual_stages=vp, cp=int(r["cp"]))
    if r["grad_accum"] and config.grad_accum != int(r["grad_accum"]):
        raise ValueError("grad_accum disagrees with global_batch / (dp x mbs)")
    recipe = BRIDGE_RECIPES[r["precision"]]
    stack = "megatron" + (f"+{recipe}" if recipe else "")
    world = int(r["world"])
    return Row(source="megatron_bridge", group=(r["model"], r["task"], r["gpu"], str(world), r["precision"]),
               model=model, training=training, config=config,
               cluster=_bridge_cluster(r["gpu"], int(r["nodes"]), int(r["gpus_per_node"])), ok=True,
               step_time=float(r["meas_step_s"]), tokens_per_s_per_gpu=float(r["tps_per_gpu"]), stack=stack,
               row_id=r["row_id"], fused_loss=BRIDGE_FUSED_LOSS, recipe_memory=BRIDGE_LLAMA_RECIPE_MEMORY)


def load_megatron_bridge(directory: Path, *, cp: bool = False) -> StackSet:
    """The dense rows of ``megatron_bridge_moe_dense.csv`` Pipette can express: MoE models (no shapes),
    context parallelism (unless ``cp``), Megatron FSDP and partial recomputation are skipped and counted
    by reason; so is a layout Pipette's rules refuse (its message)."""
    out = StackSet("megatron_bridge", "megatron", [])
    with open(directory / "megatron_bridge_moe_dense.csv", newline="") as f:
        for r in csv.DictReader(f):
            if not r["layers"]:
                out.skipped["MoE (no shape in the set)"] += 1
            elif int(r["cp"]) > 1 and not cp:
                out.skipped["context parallel (cp>1)"] += 1
            elif int(r["fsdp"]) > 0:
                out.skipped["Megatron FSDP"] += 1
            elif r["recompute"] not in ("", "none"):
                out.skipped["partial recomputation"] += 1
            else:
                try:
                    out.rows.append(_bridge_row(r))
                except (PipetteError, ValueError) as e:
                    out.skipped[str(e).split("(")[0].strip()] += 1
    return out
