"""Every multi-node launch file Pipette writes runs as printed, and the launcher it starts accepts
what it is given (issue 43, item 14): each printed per-node command is run in bash with a stand-in
Python that records the launcher's arguments, which then go through the real launcher's own parser
(DeepSpeed's ``parse_args``/``fetch_hostfile``/``parse_inclusion_exclusion``, torchrun's
``get_args_parser``/``config_from_args``, Accelerate's ``launch_command_parser`` and
``_validate_launch_command`` with the emitted config file). No process group starts: seconds.
The DeepSpeed runner's 2-node ``launch.sh`` also runs for real in
tests/integration/test_emitted_launch.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.emit_script import per_node_launch_lines, write_script_launch_files
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
A100 = load_cluster(ROOT / "examples" / "clusters" / "a100-2x8.yaml")
HOSTS = ["node0", "node1"]
PER_NODE = re.compile(r"^  on (\S+): (.+)$")

#: A stand-in Python: passes launch.sh's checks (``-c``), reads the launch's output as the filter
#: launch.sh pipes it through, and as a launcher records its arguments and the devices it was shown.
FAKE = """import json, os, sys
if sys.argv[1] == "-c":
    sys.exit(0)
if sys.argv[1:3] == ["-m", "workers.host.launch_output"]:  # what launch.sh shows of the launch: not a launcher
    sys.stdin.read()
    sys.exit(0)
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(),
                        "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "python"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\n{FAKE}")
    path.chmod(0o755)
    return path


def run_printed(lines: list[str], hosts: list[str], fake: Path, cwd: Path) -> list[tuple[str, dict[str, Any]]]:
    """Run each printed ``on HOST: COMMAND`` line as a user does on that host; (host, what the
    launcher was given) per line."""
    found = [m.groups() for m in map(PER_NODE.match, lines) if m]
    assert [h for h, _ in found] == hosts, lines
    record = cwd / "record.jsonl"
    out = []
    for host, command in found:
        record.unlink(missing_ok=True)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PIPETTE_PYTHON": str(fake), "RECORD": str(record)}
        done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, (command, done.stderr)
        calls = [json.loads(line) for line in record.read_text().splitlines()]
        assert len(calls) == 1, calls
        out.append((host, calls[0]))
    return out


def check_deepspeed(argv: list[str], cwd: str, node_rank: int, devices: dict[str, list[int]]) -> None:
    """DeepSpeed's runner reads the arguments, the hostfile and ``--include`` as its ``main`` does, and
    starts node ``node_rank``'s ranks on it alone (``--no_ssh``), the first host the rendezvous."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_args, parse_inclusion_exclusion

    assert argv[:2] == ["-m", "deepspeed.launcher.runner"]
    args = parse_args(argv[2:])
    pool = fetch_hostfile(os.path.join(cwd, args.hostfile))
    active = parse_inclusion_exclusion(pool, args.include, args.exclude)
    assert dict(active) == {h: sorted(d) for h, d in devices.items()}
    assert list(active) == list(devices)  # the launcher's node order: NODE_RANK i is the i-th host
    assert args.no_ssh and args.node_rank == node_rank and args.master_addr == next(iter(devices))


def check_torchrun(argv: list[str], node_rank: int, nproc: int, master: str) -> None:
    from torch.distributed.run import config_from_args, get_args_parser

    assert argv[:2] == ["-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[2:])
    config, _, _ = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, nproc)
    assert int(args.node_rank) == node_rank and args.master_addr == master


def check_accelerate(argv: list[str], node_rank: int, world: int, master: str) -> None:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    assert argv[:2] == ["-m", "accelerate.commands.launch"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv[2:]))
    assert (args.num_machines, args.machine_rank, args.num_processes) == (2, node_rank, world)
    assert args.main_process_ip == master


@pytest.mark.parametrize("stack", ["pipette", "fsdp"])
def test_plans_two_node_launch_runs_on_each_host_as_printed(tmp_path: Path, fake_python: Path, stack: str) -> None:
    """The issue's command: `pipette plan` on two A100 nodes. Before, DeepSpeed's runner refused its
    ``--include`` (hosts joined with ``,``: ``ValueError: too many values to unpack``), and an fsdp plan
    printed one ``./launch.sh`` that stopped with "set NODE_RANK"."""
    out = tmp_path / "plan-out"
    done = subprocess.run([sys.executable, "-m", "cli", "plan", "--model", "llama2-7b", "--cluster",
                           str(ROOT / "examples" / "clusters" / "a100-2x8.yaml"), "--recipe",
                           str(ROOT / "examples" / "recipes" / "llama2-7b-lora.yaml"), "--stack", stack,
                           "--out", "plan-out"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("launch:"))
    assert "on each of its 2 nodes" in lines[at] and "node0 hosts the rendezvous" in lines[at]
    ranks = json.loads((out / "rank_map.json").read_text())
    devices = {h: [r["local_device"] for r in ranks if r["host"] == h] for h in HOSTS}
    for i, (host, call) in enumerate(run_printed(lines[at + 1:], HOSTS, fake_python, tmp_path)):
        assert call["cwd"] == str(out)
        if stack == "pipette":
            check_deepspeed(call["argv"], call["cwd"], i, devices)
        else:
            check_torchrun(call["argv"], i, len(devices[host]), "node0")
            assert sorted(map(int, call["visible"].split(","))) == sorted(devices[host])
    # without NODE_RANK: one line that names each host's index
    alone = subprocess.run(["bash", str(out / "launch.sh")], env={"PATH": "/usr/bin:/bin",
                           "PIPETTE_PYTHON": str(fake_python)}, capture_output=True, text=True, timeout=30)
    assert alone.returncode != 0 and "0=node0, 1=node1" in alone.stderr.strip().splitlines()[-1]


SCRIPTS = {
    "deepspeed": ScriptSpec(argv=("python", "train.py"), kind="deepspeed"),
    "hf-trainer": ScriptSpec(argv=("python", "train.py"), kind="hf-trainer"),
    "hf-trainer-fsdp": ScriptSpec(argv=("python", "train.py"), kind="hf-trainer", fsdp=True),
    "accelerate-fsdp": ScriptSpec(argv=("python", "train.py"), kind="accelerate-fsdp"),
    "torchtitan": ScriptSpec(argv=("python", "train.py"), kind="torchtitan"),
}


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_a_scripts_two_node_launch_files_run_on_each_host_as_printed(tmp_path: Path, fake_python: Path,
                                                                     kind: str) -> None:
    """Each launch file of a user's script on two nodes, node 1 first in the ranks' order: what
    ``tune`` prints for it, run per host, is what the launcher's own parser accepts."""
    config = ParallelConfig(tp=1, pp=1, dp=16, mbs=1, global_batch=32, zero_stage=3,
                            placement=(*range(8, 16), *range(8)))
    training = TrainingSpec(global_batch=32, seq_len=128, dtype="bf16")
    script = SCRIPTS[kind]
    script = ScriptSpec(argv=script.argv, kind=script.kind, fsdp=script.fsdp, workdir=str(tmp_path))
    out = tmp_path / "best"
    files = write_script_launch_files(out, ModelSpec.preset("tiny-llama"), training, config, A100, script)
    hosts = ["node1", "node0"]  # the ranks' order: node 1 holds ranks 0-7
    launches = sorted(n for n in files if n.startswith("launch-"))
    assert launches
    for name in launches:
        printed = per_node_launch_lines(str(out), config, A100, name)
        assert printed[0].startswith("launch: on each of its 2 nodes") and "node1 hosts" in printed[0]
        for i, (_, call) in enumerate(run_printed(printed, hosts, fake_python, tmp_path)):
            if name == "launch-deepspeed.sh":
                check_deepspeed(call["argv"], call["cwd"], i, {h: list(range(8)) for h in hosts})
            elif name == "launch-torchrun.sh":
                check_torchrun(call["argv"], i, 8, hosts[0])
            else:
                check_accelerate(call["argv"], i, 16, hosts[0])
