"""Renderers: what a user launches for a candidate.

* ``ds_config.json``: the DeepSpeed config (batch sizes, precision, ZeRO, AutoTP,
  activation checkpointing, optimizer); keys are DeepSpeed's own
  (deepspeed.runtime.config, DeepSpeed 0.19).
* ``hostfile``: DeepSpeed/MPI hostfile, one line per node, ``slots`` = devices used there.
* ``rank_map.json``: rank -> (node, host, local device) and its (pp, dp, tp) coordinates.
  Launchers hand out ranks node by node; the Pipette entry point re-numbers each process
  from this map (``--rank_map``), so any placement runs as planned.
* ``candidate.json``: the whole candidate (degrees, schedule, recomputation, placement)
  plus model and recipe, which the entry point reads to build the same job.
* ``launch.sh``: the launch command, with the Python to run it and the trial's rank environment:
  the DeepSpeed launcher for Pipette's DeepSpeed runner, ``torchrun`` for its PyTorch-native one
  (the ``fsdp`` stack: ``workers.rank.fsdp``, no ``ds_config.json``).
* ``megatron_args.txt`` / ``nanotron.yaml``: the part of a Megatron-LM or nanotron job the
  candidate decides, in that framework's words (``pipette.emit_frameworks``).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.contract import FSDP_ENTRY, RANK_ENV, TRAIN_ENTRY, build_environment
from pipette.emit_frameworks import MEGATRON_ARGS, NANOTRON_CONFIG, flex_backend, megatron_args_file, nanotron_config
from pipette.memory import trainable_params
from pipette.model import ModelSpec
from pipette.stacks import Stack, get_stack
from pipette.training import TrainingSpec

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
    if config.ep > 1:
        # DeepSpeed's AutoEP (deepspeed/module_inject/auto_ep_config.py, parse_autoep_config): the Hugging Face
        # model's MoE blocks replaced at deepspeed.initialize, ep consecutive ranks a group, the experts whole
        ds["expert_parallel"] = {"enabled": True, "autoep_size": config.ep}
    if config.recompute != "none":
        ds["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return ds


def rank_map(config: ParallelConfig, cluster: ClusterProfile) -> list[dict[str, Any]]:
    out = []
    layout = config.layout
    for rank, device in enumerate(config.devices()):
        d = cluster.devices[device]
        node = cluster.nodes[d.node]
        at = layout.coords(rank)
        out.append({
            "rank": rank, "device": device, "node": d.node, "host": node.address or node.name,
            "local_device": d.local_index, "pp": at["pp"], "dp": at["dp"], "tp": at["tp"],
            # cp only where the candidate has it: every rank map of today is unchanged
            **({"cp": at["cp"]} if "cp" in at else {}),
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


def host_name(cluster: ClusterProfile, node: int) -> str:
    n = cluster.nodes[node]
    return n.address or n.name


def node_rank_lines(hosts: list[str]) -> list[str]:
    """A multi-node launch's lines that take this node's index from ``$NODE_RANK`` (``hosts`` in the
    launcher's node order), or stop with one line naming the index of each host."""
    named = ", ".join(f"{i}={h}" for i, h in enumerate(hosts))
    return [
        f"# Run this on every node with NODE_RANK set: {named}.",
        'NODE_RANK="${NODE_RANK:?set NODE_RANK to the index of this node: ' + named + '}"',
        f'case "$NODE_RANK" in {"|".join(map(str, range(len(hosts))))}) ;; '
        f'*) echo "NODE_RANK must be one of {named}" >&2; exit 1 ;; esac',
    ]


def node_selection(blocks: list[tuple[int, list[int]]], cluster: ClusterProfile) -> list[str]:
    """``NODE_RANK`` (0 on the first node; set it on the others), the devices this node exposes
    in rank order, and its process count."""
    if len(blocks) == 1:
        return ['NODE_RANK="${NODE_RANK:-0}"', f"NPROC={len(blocks[0][1])}", *visible_devices(blocks[0][1], cluster)]
    cases = []
    for i, (node, devices) in enumerate(blocks):
        visible = f" CUDA_VISIBLE_DEVICES={','.join(map(str, devices))};" if cluster.device_spec.kind == "gpu" else ""
        cases.append(f"    {i}) NPROC={len(devices)};{visible} ;;  # {host_name(cluster, node)}")
    return [
        *node_rank_lines([host_name(cluster, n) for n, _ in blocks]),
        'case "$NODE_RANK" in',
        *cases,
        "esac",
        *(["export CUDA_VISIBLE_DEVICES"] if cluster.device_spec.kind == "gpu" else []),
    ]


def per_node_commands(hosts: list[str], command: str) -> list[str]:
    """What a user runs for a launch over ``hosts`` (in the launcher's node order): ``command`` (a
    ``{rank}`` in it takes each node's ``NODE_RANK``) on each host, named; one line for one node."""
    if len(hosts) == 1:
        return [command.format(rank=0)]
    return [f"on {h}: {command.format(rank=i)}" for i, h in enumerate(hosts)]


def launch_how(hosts: list[str], commands: list[str], folder: str) -> list[str]:
    """The ``launch:`` lines ``plan`` and ``tune`` print: the one command, or across nodes one per
    node (``per_node_commands``), each run on its host from a copy of ``folder`` there."""
    if len(hosts) == 1:
        return [f"launch: {commands[0]}"]
    return [f"launch: on each of its {len(hosts)} nodes, from a copy of {folder}/ there; {hosts[0]} hosts the "
            "rendezvous (port $MASTER_PORT, default 29500):", *(f"  {c}" for c in commands)]


def launch_sh_lines(out_dir: str, config: ParallelConfig, cluster: ClusterProfile) -> list[str]:
    """How ``launch.sh`` in ``out_dir`` is run, as ``plan`` and ``tune`` print it: ``(cd out_dir &&
    ./launch.sh)``, or across nodes that with each node's ``NODE_RANK`` on its host."""
    hosts = [host_name(cluster, n) for n, _ in runner_nodes(config, cluster)]
    rank = "" if len(hosts) == 1 else "NODE_RANK={rank} "
    return launch_how(hosts, per_node_commands(hosts, f"(cd {shlex.quote(out_dir)} && {rank}./launch.sh)"), out_dir)


def visible_devices(devices: list[int], cluster: ClusterProfile) -> list[str]:
    """On a GPU node, the line that shows a one-node launch's ranks ``devices`` in rank order
    (unless ``CUDA_VISIBLE_DEVICES`` is set already); nothing on CPU devices."""
    if cluster.device_spec.kind != "gpu":
        return []
    return [f'export CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES:-{",".join(map(str, devices))}}}"']


#: How ``launch.sh`` finds its Python: ``$PIPETTE_PYTHON`` holds the interpreter.
PYTHON_VAR = "PIPETTE_PYTHON"


def build_tool_lines() -> list[str]:
    """Shell lines (after ``$PIPETTE_PYTHON`` is found) that give a launch's ranks the op-build
    cache and tools the trials' ranks had: the cache their op was built into, and the
    environment's ``bin`` (its ninja) first on PATH; else a launch rebuilt the op on first use
    (162 s against the trials' 45 s, issue 32). The cache is the trials' own
    (``build_environment``: a ``TORCH_EXTENSIONS_DIR`` set when tuning, else the environment's
    default): the default alone sent a launch to rebuild what the trials had built elsewhere."""
    cache = re.sub(r'(["$`\\])', r"\\\1", build_environment()["TORCH_EXTENSIONS_DIR"])
    return [
        "# DeepSpeed's JIT-built ops: the cache the trials built them into, with the same ninja.",
        f'export TORCH_EXTENSIONS_DIR="${{TORCH_EXTENSIONS_DIR:-{cache}}}"',
        f'PATH="$(dirname "$(command -v "${PYTHON_VAR}")"):$PATH"; export PATH',
    ]

_HAS_STACK = ('import importlib.util as u, sys;'
    ' sys.exit(not (u.find_spec("deepspeed") and u.find_spec("workers.rank.train")))')


def python_finder(check_code: str, tries: list[str], missing: str) -> list[str]:
    """Shell lines that set ``$PIPETTE_PYTHON`` to the first of ``tries`` where ``check_code``
    exits 0 (unless it is set already), or say ``missing`` and exit 1."""
    check = shlex.quote(check_code)
    return [
        f'if [ -z "${{{PYTHON_VAR}:-}}" ]; then',
        f"    for candidate in {' '.join(shlex.quote(t) for t in tries)}; do",
        f'        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c {check} 2>/dev/null; then',
        f'            {PYTHON_VAR}="$candidate"; break',
        "        fi",
        "    done",
        "fi",
        f'if [ -z "${{{PYTHON_VAR}:-}}" ] || ! "${PYTHON_VAR}" -c {check} 2>/dev/null; then',
        f'    echo "{missing}" >&2',
        "    exit 1",
        "fi",
    ]


def launch_command(config: ParallelConfig, cluster: ClusterProfile, out_dir: str = ".") -> str:
    """The DeepSpeed launcher line, run from ``out_dir``'s parent or with absolute paths. It starts
    this node's ranks itself (``--no_ssh``): on one node as node 0; across nodes on every node with
    ``$NODE_RANK`` set (``node_rank_lines``), the first node the rendezvous host, so no pdsh or ssh
    between the nodes is needed.

    The launcher runs as a module of ``$PIPETTE_PYTHON`` (``python3`` when unset, as in an
    activated environment), so no ``deepspeed`` script needs to be on PATH; ``launch.sh``
    finds that Python first. The rank map is an argument of the entry point. The rendezvous port is
    ``$MASTER_PORT`` when set, else DeepSpeed's default 29500, so two launches on one host can
    be given different ports (``MASTER_PORT=29600 ./launch.sh``). ``--include`` names hosts as
    ``NAME:SLOT,SLOT@NAME:SLOT`` (``parse_node_config_list`` of deepspeed/launcher/runner.py)."""
    blocks = runner_nodes(config, cluster)
    include = "@".join(f"{host_name(cluster, n)}:{','.join(map(str, devices))}" for n, devices in blocks)
    q = shlex.quote
    one = len(blocks) == 1
    master, node = ("127.0.0.1", "0") if one else (host_name(cluster, blocks[0][0]), '"$NODE_RANK"')
    parts = [
        f'"${{{PYTHON_VAR}:-python3}}" -m deepspeed.launcher.runner',
        f"--hostfile {q(out_dir + '/hostfile')}",
        '--master_port "${MASTER_PORT:-29500}"',
        # Without --no_ssh the launcher checks ssh to the first host and asks it for its address
        # over ssh, then starts the other nodes with pdsh (deepspeed/launcher/runner.py).
        f"--no_ssh --node_rank {node} --master_addr {q(master)}",
        f"--include {q(include)}",
        f"--module {TRAIN_ENTRY}",
        f"--deepspeed_config {q(out_dir + '/ds_config.json')}",
        f"--candidate {q(out_dir + '/candidate.json')}",
        f"--rank_map {q(out_dir + '/rank_map.json')}",
    ]
    return " ".join(parts)


_HAS_FSDP_RUNNER = ('import importlib.util as u, sys;'
    ' sys.exit(not (u.find_spec("torch") and u.find_spec("workers.rank.fsdp")))')


def runner_nodes(config: ParallelConfig, cluster: ClusterProfile) -> list[tuple[int, list[int]]]:
    """(node, its local device indices in rank order) for each node the candidate uses, nodes in
    ascending order: the order ``workers.rank.train.pipette_rank`` reads a launcher's node rank in."""
    here: dict[int, list[int]] = {}
    for device in config.devices():
        d = cluster.devices[device]
        here.setdefault(d.node, []).append(d.local_index)
    return sorted(here.items())


def native_command(config: ParallelConfig, cluster: ClusterProfile) -> str:
    """The ``torchrun`` (``torch.distributed.run``) line that starts Pipette's PyTorch-native runner
    (the ``fsdp`` stack) on a node, run from the launch files' folder: on one node with its process
    count written in; on several with ``$NPROC`` and ``$NODE_RANK`` (``native_lines`` sets them).
    ``rank_map.json`` renumbers each process to its rank in the candidate's placement."""
    blocks = runner_nodes(config, cluster)
    one = len(blocks) == 1
    master = "127.0.0.1" if one else host_name(cluster, blocks[0][0])
    nproc, node = (str(len(blocks[0][1])), "0") if one else ('"$NPROC"', '"$NODE_RANK"')
    return (f'"${{{PYTHON_VAR}:-python3}}" -m torch.distributed.run --nnodes {len(blocks)} --nproc_per_node {nproc} '
            f'--node_rank {node} --master_addr {shlex.quote(master)} --master_port "${{MASTER_PORT:-29500}}" '
            f"-m {FSDP_ENTRY} --candidate candidate.json --rank_map rank_map.json")


def native_lines(config: ParallelConfig, cluster: ClusterProfile) -> list[str]:
    """``launch.sh``'s lines for the native runner: which node this is and the devices it shows
    the ranks (``node_selection``; on one node only the devices), then ``native_command``."""
    blocks = runner_nodes(config, cluster)
    selection = visible_devices(blocks[0][1], cluster) if len(blocks) == 1 else node_selection(blocks, cluster)
    return [*selection, native_command(config, cluster)]


def deepspeed_node_lines(config: ParallelConfig, cluster: ClusterProfile) -> list[str]:
    """Across nodes, the lines that take this node's ``NODE_RANK`` for ``launch_command``; none on one."""
    blocks = runner_nodes(config, cluster)
    return [] if len(blocks) == 1 else node_rank_lines([host_name(cluster, n) for n, _ in blocks])


def stack_launch_command(config: ParallelConfig, cluster: ClusterProfile, stack: str | Stack | None = None,
                         out_dir: str = ".") -> str | None:
    """The command that launches ``config`` on ``stack``: the DeepSpeed launcher line of Pipette's
    DeepSpeed runner, the ``torchrun`` line of its native one (a stack with ``native_rules``: fsdp);
    on several nodes, ``launch.sh`` with each node's ``NODE_RANK``, host by host; or None where
    Pipette writes no launcher (megatron, a stack's option the runner does not run)."""
    chosen = get_stack(stack)
    if "launch.sh" not in chosen.launch_files:
        return None
    blocks = runner_nodes(config, cluster)
    if len(blocks) > 1:
        return "; ".join(per_node_commands([host_name(cluster, n) for n, _ in blocks], "NODE_RANK={rank} ./launch.sh"))
    return native_command(config, cluster) if chosen.native_rules else launch_command(config, cluster, out_dir)


#: What a launch's log is called: ``launch.log``, across nodes ``launch-node<N>.log`` (a shared folder holds them all).
LOG_NAME = 'launch${NODE_RANK:+-node$NODE_RANK}.log'


def shown_output(command: str) -> list[str]:
    """``command`` with its output (stdout and stderr) through ``workers.host.launch_output``: all of it
    into the log, what a person reads on the terminal, and a closing line of step time and tokens/s."""
    return [
        "# Every line of the output goes to the log; the terminal gets the ranks' phases and steps, warnings,",
        "# errors, and at the end the step time and tokens/s (workers/host/launch_output.py).",
        f'LOG="{LOG_NAME}"',
        f'{command} 2>&1 | "${PYTHON_VAR}" -m workers.host.launch_output --candidate candidate.json --log "$LOG"',
    ]


def file_header(config: ParallelConfig, cluster: ClusterProfile, stack: Stack) -> str:
    """The first line of every emitted text file: the candidate, where it runs, its stack."""
    return (f"Pipette: {config.label} on {cluster.world} x {cluster.device_spec.name} ({cluster.name}), "
            f"stack {stack.key}.")


def launch_script(config: ParallelConfig, cluster: ClusterProfile, python: str | None = None,
                  stack: Stack | None = None) -> str:
    """``launch.sh``: finds a Python that has the runner (``$PIPETTE_PYTHON``, else ``python``
    (by default the interpreter writing the file), else ``python3`` on PATH), or says in one
    line how to give one; sets what the trial's ranks had (``RANK_ENV``; ``DS_ACCELERATOR=cpu``
    on CPU devices); then runs ``launch_command`` (the DeepSpeed runner) or ``native_lines``
    (the ``fsdp`` stack: Pipette's PyTorch-native runner under ``torchrun``, as its trials ran)."""
    chosen = get_stack(stack)
    native = chosen.native_rules  # the stack Pipette's PyTorch-native runner runs (fsdp)
    tries = [p for p in (python or sys.executable, "python3") if p]
    env = dict(RANK_ENV)
    if cluster.device_spec.kind == "cpu" and not native:
        env["DS_ACCELERATOR"] = "cpu"
    exports = " ".join(f'{k}="${{{k}:-{v}}}"' for k, v in env.items())
    what = "torch and Pipette's workers" if native else "DeepSpeed and Pipette's workers"
    found = python_finder(_HAS_FSDP_RUNNER if native else _HAS_STACK, tries,
                          f"launch.sh: no Python here has {what} (tried ${{{PYTHON_VAR}:-{' '.join(tries)}}}); "
                          f"set {PYTHON_VAR} to the python of the environment Pipette is installed in, "
                          f"e.g. {PYTHON_VAR}=/path/to/.venv/bin/python ./launch.sh")
    run = native_lines(config, cluster) if native else [*build_tool_lines(), *deepspeed_node_lines(config, cluster),
                                                        launch_command(config, cluster, ".")]
    run[-1:] = shown_output(run[-1])
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# {file_header(config, cluster, chosen)}",
        "# Run as ./launch.sh from anywhere; MASTER_PORT=N ./launch.sh picks another rendezvous port.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f"# The Python with {what}: ${PYTHON_VAR}, else the one that wrote",
        "# this file, else python3 on PATH.",
        *found,
        "# What each trial rank ran with, so the launch runs at the trial's speed.",
        f"export {PYTHON_VAR} {exports}",
        *run,
        "",
    ])


def write_launch_files(
    out_dir: str | Path,
    model: ModelSpec,
    training: TrainingSpec,
    config: ParallelConfig,
    cluster: ClusterProfile,
    extra: dict[str, Any] | None = None,
    stack: str | Stack | None = None,
) -> dict[str, Path]:
    """Write the launch files of ``stack`` (default Pipette's runner: ``Stack.launch_files``)
    into ``out_dir``; returns them by name. ``candidate.json`` names the stack it was planned for."""
    chosen = get_stack(stack)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = file_header(config, cluster, chosen)
    files = {
        "ds_config.json": lambda: json.dumps(deepspeed_config(training, config, model=model), indent=2) + "\n",
        "hostfile": lambda: hostfile(config, cluster),
        "rank_map.json": lambda: json.dumps(rank_map(config, cluster), indent=2) + "\n",
        "candidate.json": lambda: json.dumps(
            {"model": model.to_dict(), "training": training.to_dict(), "config": config.to_dict(),
             "stack": chosen.to_dict(), **(extra or {})},
            indent=2,
        ) + "\n",
        "launch.sh": lambda: launch_script(config, cluster, stack=chosen),
        MEGATRON_ARGS: lambda: megatron_args_file(training, config, model.layers, header, chosen.options,
                                                  "fp8" in cluster.device_spec.peak_flops,
                                                  "fp4" in cluster.device_spec.peak_flops, model.moe,
                                                  flex_backend(np.bincount(cluster.link_domain_of).tolist(),
                                                               np.bincount(cluster.node_of).tolist())),
        NANOTRON_CONFIG: lambda: nanotron_config(training, config, header),
    }
    written = {}
    for name in chosen.launch_files:
        text = files[name]()
        path = out / name
        path.write_text(text)
        written[name] = path
    if "launch.sh" in written:
        written["launch.sh"].chmod(0o755)
    return written
