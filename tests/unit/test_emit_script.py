"""The launch files of a user's script (``pipette.emit_script``), and the environment and
working directory its ranks get (``workers.host.script_env``, ``workers.host.workdir``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.emit_script import accelerate_config, launch_torchrun, node_blocks, write_script_launch_files
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.host.script_env import script_environment, script_path, with_hook
from workers.host.workdir import pack, unpack

ROOT = Path(__file__).resolve().parents[2]
A100 = load_cluster(ROOT / "examples" / "clusters" / "a100-2x8.yaml")
TRAINING = TrainingSpec(global_batch=64, seq_len=512, dtype="bf16", method="lora", lora=LoraSpec(rank=8, alpha=16))
HF = ScriptSpec(argv=("python", "train.py", "--output_dir", "out dir"), kind="hf-trainer", workdir="/src/proj")


def _config(placement: tuple[int, ...] | None = None, world: int = 16) -> ParallelConfig:
    return ParallelConfig(tp=1, pp=1, dp=world, mbs=2, global_batch=64, zero_stage=3, recompute="full",
                          placement=placement)


def test_node_blocks_follow_the_ranks_order() -> None:
    placement = (*tuple(range(8, 16)), 3, 2, 1, 0, 4, 5, 6, 7)
    assert node_blocks(_config(placement), A100) == [(1, list(range(8))), (0, [3, 2, 1, 0, 4, 5, 6, 7])]


def test_the_launch_files_of_a_two_node_candidate(tmp_path: Path) -> None:
    placement = tuple(range(8, 16)) + tuple(range(8))
    files = write_script_launch_files(tmp_path, ModelSpec.preset("llama2-7b"), TRAINING, _config(placement), A100, HF)
    assert sorted(files) == ["accelerate_config.yaml", "candidate.json", "ds_config.json", "hostfile",
                             "launch-accelerate.sh", "launch-deepspeed.sh", "launch-torchrun.sh", "rank_map.json"]
    # the hostfile lists the nodes in the ranks' order: node 1 holds ranks 0-7
    hosts = (tmp_path / "hostfile").read_text().splitlines()
    assert [h.split()[0] for h in hosts] == [A100.nodes[1].address or A100.nodes[1].name,
                                             A100.nodes[0].address or A100.nodes[0].name]
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": True} and "optimizer" not in ds
    torchrun = (tmp_path / "launch-torchrun.sh").read_text()
    assert "--nnodes 2 --nproc_per_node" in torchrun and 'NODE_RANK="${NODE_RANK:?' in torchrun
    assert "train.py --output_dir 'out dir' --deepspeed \"$HERE/ds_config.json\" --per_device_train_batch_size 2 " \
           "--gradient_accumulation_steps 2 --max_steps 50 --gradient_checkpointing --bf16" in torchrun
    assert "cd /src/proj" in torchrun
    for name in ("launch-torchrun.sh", "launch-deepspeed.sh", "launch-accelerate.sh"):
        path = tmp_path / name
        assert path.stat().st_mode & stat.S_IXUSR
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, name
    accel = (tmp_path / "accelerate_config.yaml").read_text()
    assert "num_machines: 2" in accel and "num_processes: 16" in accel and "zero3_init_flag: true" in accel


def test_a_launch_without_a_python_that_has_the_launcher_says_what_to_set(tmp_path: Path) -> None:
    script = ScriptSpec(argv=HF.argv, kind="hf-trainer", workdir=str(tmp_path))
    path = tmp_path / "launch-torchrun.sh"
    path.write_text(launch_torchrun(_config(world=8), A100, TRAINING, script, python="/nonexistent/python"))
    # python3 on this PATH is the system's, without torch
    done = subprocess.run(["/bin/bash", str(path)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
                          cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "launch-torchrun.sh: no Python here has torch; set PIPETTE_PYTHON to the python of the environment your "
        f"training runs in, e.g. PIPETTE_PYTHON=/path/to/.venv/bin/python {path}"]


def test_one_node_accelerate_config_is_local() -> None:
    text = accelerate_config(_config(world=8), A100)
    assert "main_process_ip: 127.0.0.1" in text and "num_machines: 1" in text and "use_cpu: false" in text


def test_a_scripts_environment_keeps_the_stack_and_drops_secrets() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/root", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0",
           "HF_HOME": "/cache/hf", "HF_TOKEN": "x", "PIPETTE_DATABASE_URL": "postgresql://u:p@h/db",
           "PIPETTE_METRICS_TOKEN": "m", "AWS_SECRET_ACCESS_KEY": "s", "RAY_ADDRESS": "h:1", "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": "/t", "MY_API_KEY": "k", "LC_ALL": "C"}
    assert sorted(script_environment(env)) == ["CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "HF_HOME", "HOME", "LC_ALL",
                                               "NCCL_DEBUG", "PATH", "TORCH_EXTENSIONS_DIR"]
    assert script_path("/usr/bin:/bin").split(os.pathsep)[1:] == ["/usr/bin", "/bin"]
    assert with_hook("/a").split(os.pathsep)[1:] == ["/a"] and with_hook(None).endswith("script_hook")


def test_a_working_directory_travels_whole_and_keeps_its_modes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "train.sh").chmod(0o755)
    (src / "pkg" / "data.txt").write_text("x")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "m.pyc").write_bytes(b"\0")
    data = pack(src)
    assert sorted(zipfile.ZipFile(__import__("io").BytesIO(data)).namelist()) == ["pkg/data.txt", "train.sh"]
    out = Path(unpack(data, tmp_path / "dst"))
    assert (out / "pkg" / "data.txt").read_text() == "x"
    assert os.access(out / "train.sh", os.X_OK)
    with pytest.raises(SpecError, match="is not a folder"):
        pack(tmp_path / "missing")
