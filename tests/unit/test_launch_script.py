"""``launch.sh`` finds a Python that has DeepSpeed and Pipette's workers, or says in one line
how to give it one; it sets what the trial's ranks had. (Run for real, on CPU devices in
tests/integration/test_emitted_launch.py and on a GPU in tests/gpu/test_gpu_launch.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.emit import RANK_ENV, write_launch_files
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
