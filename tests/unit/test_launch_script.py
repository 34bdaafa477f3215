"""``launch.sh`` finds a Python that has DeepSpeed and Pipette's workers, or says in one line
how to give it one; it sets what the trial's ranks had. (Run for real, on CPU devices in
tests/integration/test_emitted_launch.py and on a GPU in tests/gpu/test_gpu_launch.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.contract import RANK_ENV
from pipette.emit import write_launch_files
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp: Path, cluster: str = "cpu-4.yaml") -> Path:
    files = write_launch_files(tmp, ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=4, seq_len=32),
                               ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=4),
                               load_cluster(ROOT / "examples" / "clusters" / cluster))
    return files["launch.sh"]


def test_without_a_usable_python_it_says_how_to_give_one(tmp_path: Path) -> None:
    script = _write(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "PIPETTE_PYTHON": "/bin/false", "HOME": str(tmp_path)}
    done = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "PIPETTE_PYTHON=/path/to/.venv/bin/python ./launch.sh" in lines[0], done.stderr
    assert "tried /bin/false" in lines[0]


def test_it_sets_the_trials_rank_environment(tmp_path: Path) -> None:
    text = _write(tmp_path).read_text()
    for key, value in RANK_ENV.items():
        assert f'{key}="${{{key}:-{value}}}"' in text  # the user's own setting wins
    assert 'DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"' in text  # CPU devices
    gpu = _write(tmp_path / "gpu", "a100-2x8.yaml").read_text()
    assert "DS_ACCELERATOR" not in gpu and "--rank_map ./rank_map.json" in gpu


def test_it_is_bash_that_parses(tmp_path: Path) -> None:
    script = _write(tmp_path)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert os.access(script, os.X_OK)


def test_every_launch_uses_the_trials_op_build_cache_and_tools(tmp_path: Path) -> None:
    """DeepSpeed JIT-builds its CPU op on first use: a launch with another cache (or another
    ninja) than the trials' rebuilt it (162 s against 45 s, issue 32, item 1)."""
    from pipette.emit_script import write_script_launch_files
    from pipette.script import ScriptSpec
    from workers.rank.train import build_environment

    env_bin = tmp_path / "env" / "bin"
    env_bin.mkdir(parents=True)
    seen = tmp_path / "seen"
    fake = env_bin / "python"  # has everything (-c checks pass); as a launcher, says what it was given
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\n'
                    '[ "$2" = workers.host.launch_output ] && exec cat >/dev/null\n'
                    f'echo "$TORCH_EXTENSIONS_DIR|$PATH" >> {seen}\n')
    fake.chmod(0o755)
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    config = ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=4)
    training = TrainingSpec(global_batch=4, seq_len=32)
    scripts = [_write(tmp_path / "runner")]
    script = ScriptSpec(argv=("python", "train.py"), kind="deepspeed", workdir=str(tmp_path))
    files = write_script_launch_files(tmp_path / "script", ModelSpec.preset("tiny-llama"), training, config,
                                      cluster, script)
    scripts += [files[n] for n in ("launch-deepspeed.sh", "launch-torchrun.sh", "launch-accelerate.sh")]
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)), "PIPETTE_PYTHON": str(fake)}
    if os.environ.get("XDG_CACHE_HOME"):
        env["XDG_CACHE_HOME"] = os.environ["XDG_CACHE_HOME"]
    for path in scripts:
        done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, (path.name, done.stderr)
    lines = seen.read_text().splitlines()
    assert len(lines) == 4
    cache = build_environment()["TORCH_EXTENSIONS_DIR"]  # the trials' ranks' cache
    for line in lines:
        got, path_var = line.split("|")
        assert got == cache
        assert path_var.split(":")[0] == str(env_bin)  # the environment's ninja first
