"""Load the measured calibration sets of ``../shared/data/calibration/`` as Pipette specs.

Shared by the accuracy, memory and tuner-replay benchmarks. The data are reference data,
never copied into the project; ``calibration_dir()`` returns None when the folder is
absent, and the benchmarks skip cleanly then.

What each set is (from its README):
* vTrain: GPT on one node of A100 (2/4/8 GPUs), seq 1024, 16 heads, full recomputation,
  1F1B, fp16, Megatron-DeepSpeed (Bang et al. 2024).
* Ultra-Scale: Llama 3.2-1B / 3.2-3B / 3.1-8B shapes on 1-64 nodes of 8x H100 80GB,
  seq 4096, global batch 256, ZeRO 0/1, nanotron (HF Ultra-Scale Playbook, 2025).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

from pipette.cluster import ClusterProfile
from pipette.clusterfile import homogeneous_cluster
from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

# Link figures of the machines the sets were measured on (vendor data sheets), per GPU
# and per direction: DGX A100 NVLink3 300 GB/s; H100 SXM NVLink4 450 GB/s; the
# playbook's cluster (AWS p5) has 3200 Gbit/s of EFA per node of 8 GPUs = 50 GB/s per GPU.
A100_NVLINK = 300e9
H100_NVLINK = 450e9
H100_NODE_NIC_PER_GPU = 50e9

ULTRASCALE_MODELS = {"1B": "llama3.2-1b", "3B": "llama3.2-3b", "8B": "llama3.1-8b"}


def calibration_dir() -> Path | None:
    """``$PIPETTE_CALIBRATION_DIR`` or ``../shared/data/calibration`` next to the repo."""
    env = os.environ.get("PIPETTE_CALIBRATION_DIR")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parents[2]
    candidates.append(repo.parent / "shared" / "data" / "calibration")
    for c in candidates:
        if c.is_dir():
            return c
    return None


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
