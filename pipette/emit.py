"""Renderers: what a user launches for a candidate.

* ``ds_config.json``: the DeepSpeed config (batch sizes, precision, ZeRO, AutoTP,
  activation checkpointing, optimizer); keys are DeepSpeed's own
  (deepspeed.runtime.config, DeepSpeed 0.19).
* ``hostfile``: DeepSpeed/MPI hostfile, one line per node, ``slots`` = devices used there.
* ``rank_map.json``: rank -> (node, host, local device) and its (pp, dp, tp) coordinates.
  Launchers hand out ranks node by node; the Pipette entry point re-numbers each process
  from this map (``PIPETTE_RANK_MAP``), so any placement runs as planned.
* ``candidate.json``: the whole candidate (degrees, schedule, recomputation, placement)
  plus model and recipe, which the entry point reads to build the same job.
* ``launch.sh``: the launch command.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.memory import trainable_params
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

#: The module every rank runs (the workers' trial runner as a launchable job).
ENTRY_MODULE = "workers.train"

# DeepSpeed's own defaults for these buckets (deepspeed/runtime/zero/config.py).
_BUCKET_ELEMENTS = 500_000_000


def deepspeed_config(
    training: TrainingSpec, config: ParallelConfig, lr: float = 1e-4, model: ModelSpec | None = None
) -> dict[str, Any]:
    """The DeepSpeed config of ``config``; with ``model``, buckets are sized to what trains.

    DeepSpeed allocates its ZeRO gradient buckets at full size whatever the model (two
    ``reduce_bucket_size`` buffers under ``overlap_comm``: ~4 GB of fp32 for the defaults,
    seen on tiny-model trials), so they are capped at the trainable parameter count.
    """
    bucket = _BUCKET_ELEMENTS
    if model is not None:
        bucket = max(1, min(_BUCKET_ELEMENTS, trainable_params(model, training)))
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage >= 1:
        zero |= {
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        }
    if config.zero_stage == 3:
        zero |= {"stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 100_000}
    ds: dict[str, Any] = {
        "train_batch_size": config.global_batch,
        "train_micro_batch_size_per_gpu": config.mbs,
        "gradient_accumulation_steps": config.grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW" if training.optimizer in ("adamw", "adam") else "SGD",
            # torch's Adam avoids DeepSpeed's JIT-built CPU/fused Adam kernels.
            "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}
            if training.optimizer != "sgd" else {"lr": lr},
        },
    }
    if training.dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    elif training.dtype == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if config.tp > 1:
        ds["tensor_parallel"] = {"autotp_size": config.tp}
    if config.recompute != "none":
        ds["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return ds


def rank_map(config: ParallelConfig, cluster: ClusterProfile) -> list[dict[str, Any]]:
    out = []
    for rank, device in enumerate(config.devices()):
        d = cluster.devices[device]
        node = cluster.nodes[d.node]
        pp, dp, tp = config.coords(rank)
        out.append({
            "rank": rank, "device": device, "node": d.node, "host": node.address or node.name,
            "local_device": d.local_index, "pp": pp, "dp": dp, "tp": tp,
        })
    return out


def hostfile(config: ParallelConfig, cluster: ClusterProfile) -> str:
    """The nodes the candidate uses, each with its device count: DeepSpeed's slots are the
    device indices ``0..slots-1`` that ``--include`` picks from (deepspeed/launcher/runner.py)."""
    used = sorted({cluster.devices[d].node for d in config.devices()})
    lines = []
    for node in used:
        n = cluster.nodes[node]
        lines.append(f"{n.address or n.name} slots={len(cluster.devices_on(node))}")
    return "\n".join(lines) + "\n"


def launch_command(config: ParallelConfig, cluster: ClusterProfile, out_dir: str = ".") -> str:
    """The ``deepspeed`` launcher line, run from ``out_dir``'s parent or with absolute paths: over
    ssh (pdsh) from the first node when the candidate spans nodes, locally when it uses one.
    The rendezvous port is ``$MASTER_PORT`` when set, else DeepSpeed's default 29500, so two
    launches on one host can be given different ports (``MASTER_PORT=29600 ./launch.sh``)."""
    nodes = {cluster.devices[d].node for d in config.devices()}
    include = ",".join(
        f"{cluster.nodes[n].address or cluster.nodes[n].name}:"
        + ",".join(str(cluster.devices[d].local_index) for d in config.devices() if cluster.devices[d].node == n)
        for n in sorted(nodes)
    )
    q = shlex.quote
    parts = [
        f"PIPETTE_RANK_MAP={q(out_dir + '/rank_map.json')}",
        "deepspeed",
        f"--hostfile {q(out_dir + '/hostfile')}",
        '--master_port "${MASTER_PORT:-29500}"',
    ]
    if len(nodes) == 1:
        # One node: start the ranks here. With a hostfile the launcher otherwise checks ssh to
        # the host and asks it for its address over ssh (deepspeed/launcher/runner.py).
        parts.append("--no_ssh --node_rank 0 --master_addr 127.0.0.1")
    parts += [
        f"--include {q(include)}",
        f"--module {ENTRY_MODULE}",
        f"--deepspeed_config {q(out_dir + '/ds_config.json')}",
        f"--candidate {q(out_dir + '/candidate.json')}",
    ]
    return " ".join(parts)


def write_launch_files(
    out_dir: str | Path,
    model: ModelSpec,
    training: TrainingSpec,
    config: ParallelConfig,
    cluster: ClusterProfile,
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write every launch file into ``out_dir``; returns them by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "ds_config.json": json.dumps(deepspeed_config(training, config, model=model), indent=2) + "\n",
        "hostfile": hostfile(config, cluster),
        "rank_map.json": json.dumps(rank_map(config, cluster), indent=2) + "\n",
        "candidate.json": json.dumps(
            {"model": model.to_dict(), "training": training.to_dict(), "config": config.to_dict(),
             **(extra or {})},
            indent=2,
        ) + "\n",
        "launch.sh": "#!/usr/bin/env bash\nset -euo pipefail\ncd \"$(dirname \"$0\")\"\n"
        + launch_command(config, cluster, out_dir=".") + "\n",
    }
    written = {}
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        written[name] = path
    written["launch.sh"].chmod(0o755)
    return written
