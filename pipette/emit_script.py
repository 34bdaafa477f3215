"""Renderers for the user's own script: what their stack launches for the best candidate.

* ``ds_config.json``: the candidate's DeepSpeed config over the user's own
  (``pipette.script.script_ds_config``): valid for HF Trainer's ``--deepspeed``, for
  ``deepspeed.initialize(config=...)`` and for Accelerate's DeepSpeed plugin.
* ``accelerate_config.yaml``: an Accelerate config (``distributed_type: DEEPSPEED``) pointing
  at that DeepSpeed config.
* ``hostfile``: the nodes in the order the candidate's ranks use them.
* ``launch-deepspeed.sh``, ``launch-torchrun.sh``, ``launch-accelerate.sh``: the user's script
  under each launcher, with the knobs the trial used. Each finds a Python that has the launcher
  (``$PIPETTE_PYTHON``, the one that wrote it, ``python3``) or says in one line what to set; a
  multi-node launch runs on every node with ``NODE_RANK`` set (``per_node_launch_lines`` says
  what to run on which host). The candidate's placement is realised by the order of the
  devices each node exposes (``CUDA_VISIBLE_DEVICES`` / ``--include``): launchers number a
  script's ranks node by node, which is why a script's search keeps only placements that do.

An FSDP script (``ScriptSpec.fsdp``) gets its own stack's files instead (``pipette.script_fsdp``):
``accelerate_config.yaml`` with ``distributed_type: FSDP`` and ``launch-accelerate.sh``
(``accelerate-fsdp``); ``fsdp_config.json`` and ``launch-torchrun.sh`` (the HF Trainer's
``--fsdp``); ``launch-torchrun.sh`` with the candidate as torchtitan's own flags (torchtitan 0.3:
``--module``/``--config`` from the user, ``--parallelism.*``/``--training.*`` and the
``activation-checkpoint:`` subcommand from Pipette). No DeepSpeed config.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.contract import RANK_ENV
from pipette.emit import (
    PYTHON_VAR,
    build_tool_lines,
    deepspeed_config,
    launch_how,
    node_rank_lines,
    per_node_commands,
    python_finder,
    rank_map,
)
from pipette.emit import host_name as _host
from pipette.emit import node_selection as _node_selection
from pipette.emit_frameworks import tf32_note
from pipette.model import ModelSpec
from pipette.script import ScriptSpec, script_ds_config, sharded
from pipette.script_fsdp import (
    TRAINER_FSDP_CONFIG,
    accelerate_fsdp_yaml,
    fsdp_script_args,
    trainer_fsdp_config,
)
from pipette.training import TrainingSpec

#: Steps the launches run when the script has a steps knob (the user edits it for a real run).
LAUNCH_STEPS = 50


def node_blocks(config: ParallelConfig, cluster: ClusterProfile) -> list[tuple[int, list[int]]]:
    """(node, its local device indices in rank order) for each node, in the ranks' order."""
    out: list[tuple[int, list[int]]] = []
    for device in config.devices():
        d = cluster.devices[device]
        if not out or out[-1][0] != d.node:
            out.append((d.node, []))
        out[-1][1].append(d.local_index)
    return out


def accelerate_config(config: ParallelConfig, cluster: ClusterProfile) -> str:
    """Accelerate's YAML (``accelerate launch --config_file``) for the candidate."""
    blocks = node_blocks(config, cluster)
    lines = [
        "# Pipette: Accelerate with DeepSpeed for " + config.label,
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: DEEPSPEED",
        "deepspeed_config:",
        "  deepspeed_config_file: ds_config.json",
        f"  zero3_init_flag: {'true' if config.zero_stage == 3 else 'false'}",
        f"num_machines: {len(blocks)}",
        f"num_processes: {config.world}",
        "machine_rank: 0",
        f"main_process_ip: {_host(cluster, blocks[0][0]) if len(blocks) > 1 else '127.0.0.1'}",
        "main_process_port: 29500",
        "rdzv_backend: static",
        "same_network: true",
        f"use_cpu: {'true' if cluster.device_spec.kind == 'cpu' else 'false'}",
        "",
    ]
    return "\n".join(lines)


def _finder(modules: tuple[str, ...], launcher: str, python: str | None) -> list[str]:
    check = "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in " + repr(list(modules)) + "))"
    tries = [t for t in (python or sys.executable, "python3") if t]
    return [
        f"# The Python that has {launcher}: ${PYTHON_VAR}, else the one that wrote this file, else python3.",
        *python_finder(check, tries, f"${{0##*/}}: no Python here has {', '.join(modules)}; set {PYTHON_VAR} to the "
                       f"python of the environment your training runs in, e.g. "
                       f"{PYTHON_VAR}=/path/to/.venv/bin/python $0"),
    ]


def _fsdp_config_file(script: ScriptSpec, config: ParallelConfig) -> str | None:
    """The file an FSDP script's ``fsdp_config`` knob names (None: none for this candidate)."""
    if not script.fsdp or script.kind == "torchtitan":  # torchtitan: all on its command line
        return None
    return TRAINER_FSDP_CONFIG if sharded(config) else None


def _script_part(script: ScriptSpec, training: TrainingSpec, config: ParallelConfig, no_python: str,
                 device_kind: str, model: ModelSpec | None = None) -> str:
    """The program and its arguments after the launcher's own flags (the files beside the
    launch as ``"$HERE/NAME"``; torchtitan's settings as its flags, which need ``model``)."""
    q = shlex.quote
    named = _fsdp_config_file(script, config)
    argv = script.command(training, config, "$HERE/ds_config.json", steps=LAUNCH_STEPS,
                          fsdp_config_path=f"$HERE/{named}" if named else None, device_kind=device_kind)
    if model is not None:
        argv += fsdp_script_args(training, config, model, script)
    args = argv[2:] if script.is_python else argv[1:]
    head = [] if script.is_python else [no_python]
    return " ".join([*head, q(script.program)] + [f'"{a}"' if _beside(a) else q(a) for a in args])


def _beside(word: str) -> bool:
    """A file Pipette wrote beside the launch (``$HERE/NAME``, NAME a plain file name)."""
    name = word.removeprefix("$HERE/")
    return word.startswith("$HERE/") and name.replace(".", "").replace("_", "").replace("-", "").isalnum()


def _tf32_note(script: ScriptSpec, training: TrainingSpec, cluster: ClusterProfile) -> list[str]:
    """A ``tf32`` job whose script Pipette cannot switch TF32 on for (no ``tf32`` knob): the lines
    saying the script must, since the candidate was priced with TF32 matmuls."""
    if cluster.device_spec.kind != "gpu" or script.sets_tf32():
        return []
    return tf32_note(training)


def _header(config: ParallelConfig, cluster: ClusterProfile, script: ScriptSpec, launcher: str,
            training: TrainingSpec) -> list[str]:
    env = dict(RANK_ENV)
    if cluster.device_spec.kind == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    exports = " ".join(f'{k}="${{{k}:-{v}}}"' for k, v in env.items())
    workdir = script.workdir or "."
    return [
        "#!/usr/bin/env bash",
        f"# Pipette: your script under {launcher}, as {config.label} on {cluster.world} x "
        f"{cluster.device_spec.name} ({cluster.name}).",
        *_tf32_note(script, training, cluster),
        "set -euo pipefail",
        'case "$0" in */*) HERE="$(cd "${0%/*}" && pwd)" ;; *) HERE="$(pwd)" ;; esac  # this folder',
        f"cd {shlex.quote(workdir)}  # where the script's relative paths point (its trials ran here)",
        f"export {exports}",
    ]


def launch_torchrun(config: ParallelConfig, cluster: ClusterProfile, training: TrainingSpec,
                    script: ScriptSpec, python: str | None = None, model: ModelSpec | None = None) -> str:
    blocks = node_blocks(config, cluster)
    lines = _header(config, cluster, script, "torchrun", training) + _finder(("torch",), "torch", python)
    lines += build_tool_lines()
    lines += _node_selection(blocks, cluster)
    lines.append(
        f'"${PYTHON_VAR}" -m torch.distributed.run --nnodes {len(blocks)} --nproc_per_node "$NPROC" '
        f'--node_rank "$NODE_RANK" --master_addr {shlex.quote(_master(blocks, cluster))} '
        '--master_port "${MASTER_PORT:-29500}" '
        + _script_part(script, training, config, "--no-python", cluster.device_spec.kind, model))
    return "\n".join(lines) + "\n"


def launch_accelerate(config: ParallelConfig, cluster: ClusterProfile, training: TrainingSpec,
                      script: ScriptSpec, python: str | None = None) -> str:
    blocks = node_blocks(config, cluster)
    lines = _header(config, cluster, script, "accelerate launch", training)
    if script.fsdp:
        lines += _finder(("accelerate",), "accelerate", python)
    else:
        lines += _finder(("accelerate", "deepspeed"), "accelerate and deepspeed", python)
    lines += build_tool_lines()
    lines += _node_selection(blocks, cluster)
    lines.append(
        f'"${PYTHON_VAR}" -m accelerate.commands.launch --config_file "$HERE/accelerate_config.yaml" '
        f'--num_machines {len(blocks)} --num_processes {config.world} --machine_rank "$NODE_RANK" '
        f'--main_process_ip {shlex.quote(_master(blocks, cluster))} --main_process_port "${{MASTER_PORT:-29500}}" '
        + _script_part(script, training, config, "--no_python", cluster.device_spec.kind))
    return "\n".join(lines) + "\n"


def launch_deepspeed(config: ParallelConfig, cluster: ClusterProfile, training: TrainingSpec,
                     script: ScriptSpec, python: str | None = None) -> str:
    blocks = node_blocks(config, cluster)
    include = "@".join(f"{_host(cluster, n)}:{','.join(map(str, ds))}" for n, ds in blocks)
    lines = _header(config, cluster, script, "the deepspeed launcher", training)
    lines += _finder(("deepspeed",), "deepspeed", python)
    lines += build_tool_lines()
    if len(blocks) > 1:
        lines += node_rank_lines([_host(cluster, n) for n, _ in blocks])
    # --no_ssh: each node starts its own ranks, as torchrun's and Accelerate's launches do; else the
    # launcher asks the first host for its address over ssh and starts the nodes with pdsh
    # (deepspeed/launcher/runner.py).
    node = "0" if len(blocks) == 1 else '"$NODE_RANK"'
    parts = [f'"${PYTHON_VAR}" -m deepspeed.launcher.runner', '--hostfile "$HERE/hostfile"',
             '--master_port "${MASTER_PORT:-29500}"',
             f"--no_ssh --node_rank {node} --master_addr {shlex.quote(_master(blocks, cluster))}"]
    parts += [f"--include {shlex.quote(include)}",
              _script_part(script, training, config, "--no_python", cluster.device_spec.kind)]
    lines.append(" ".join(parts))
    return "\n".join(lines) + "\n"


def per_node_launch_lines(out_dir: str, config: ParallelConfig, cluster: ClusterProfile, name: str) -> list[str]:
    """Across nodes, how the launch file ``name`` runs, as ``tune`` prints it: on each host with its
    ``NODE_RANK`` (``launch_how``); nothing for a one-node launch, which runs as it is."""
    hosts = [_host(cluster, n) for n, _ in node_blocks(config, cluster)]
    if len(hosts) == 1:
        return []
    path = shlex.quote(f"{out_dir}/{name}")
    return launch_how(hosts, per_node_commands(hosts, f"NODE_RANK={{rank}} {path}"), out_dir)


def _master(blocks: list[tuple[int, list[int]]], cluster: ClusterProfile) -> str:
    return _host(cluster, blocks[0][0]) if len(blocks) > 1 else "127.0.0.1"


def write_script_launch_files(
    out_dir: str | Path,
    model: ModelSpec,
    training: TrainingSpec,
    config: ParallelConfig,
    cluster: ClusterProfile,
    script: ScriptSpec,
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write the launch files of the user's script into ``out_dir``; returns them by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if script.fsdp:
        return _write(out, fsdp_script_files(model, training, config, cluster, script, extra))
    blocks = node_blocks(config, cluster)
    ds = script_ds_config(deepspeed_config(training, config, model=model), script)
    files = {
        "ds_config.json": json.dumps(ds, indent=2) + "\n",
        "accelerate_config.yaml": accelerate_config(config, cluster),
        "hostfile": "".join(f"{_host(cluster, n)} slots={len(cluster.devices_on(n))}\n" for n, _ in blocks),
        "rank_map.json": json.dumps(rank_map(config, cluster), indent=2) + "\n",
        "candidate.json": _candidate(model, training, config, script, extra),
        "launch-deepspeed.sh": launch_deepspeed(config, cluster, training, script),
        "launch-torchrun.sh": launch_torchrun(config, cluster, training, script),
        "launch-accelerate.sh": launch_accelerate(config, cluster, training, script),
    }
    return _write(out, files)


def _candidate(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, script: ScriptSpec,
               extra: dict[str, Any] | None) -> str:
    return json.dumps({"model": model.to_dict(), "training": training.to_dict(), "config": config.to_dict(),
                       "script": script.to_dict(), **(extra or {})}, indent=2) + "\n"


def fsdp_script_files(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, cluster: ClusterProfile,
                      script: ScriptSpec, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """An FSDP script's launch files by name (see the module docstring)."""
    blocks = node_blocks(config, cluster)
    files = {
        "rank_map.json": json.dumps(rank_map(config, cluster), indent=2) + "\n",
        "candidate.json": _candidate(model, training, config, script, extra),
    }
    if script.kind == "accelerate-fsdp":
        main_ip = _host(cluster, blocks[0][0]) if len(blocks) > 1 else "127.0.0.1"
        files["accelerate_config.yaml"] = accelerate_fsdp_yaml(training, config, model, machines=len(blocks),
                                                               main_ip=main_ip,
                                                               use_cpu=cluster.device_spec.kind == "cpu")
        files["launch-accelerate.sh"] = launch_accelerate(config, cluster, training, script)
        return files
    if script.kind != "torchtitan" and sharded(config):
        files[TRAINER_FSDP_CONFIG] = json.dumps(trainer_fsdp_config(training, config, model), indent=2) + "\n"
    files["launch-torchrun.sh"] = launch_torchrun(config, cluster, training, script, model=model)
    return files


def _write(out: Path, files: dict[str, str]) -> dict[str, Path]:
    written = {}
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
        written[name] = path
    return written
