"""Launch files point DeepSpeed at the op cache the trials built into (issue 43, item 32: they
pinned the environment's default cache, though the trials had built into TORCH_EXTENSIONS_DIR)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.emit_script import write_script_launch_files
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from workers.host.script_trial import script_launch
from workers.spec import TrialSpec

ROOT = Path(__file__).resolve().parents[2]


def test_the_launch_files_use_the_cache_the_trials_built_into(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "my ops"  # set when tuning: the trials build there
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    training = TrainingSpec(global_batch=8, seq_len=32, dtype="fp32")
    config = ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=8, zero_stage=1)
    script = ScriptSpec(argv=("python", "train.py"), kind="deepspeed", workdir=str(tmp_path))
    model = ModelSpec.preset("tiny-llama")
    trials_cache = script_launch(TrialSpec(model, training, config, script=script))[2]["TORCH_EXTENSIONS_DIR"]
    assert trials_cache == str(cache)
    files = write_script_launch_files(tmp_path / "out", model, training, config,
                                      load_cluster(str(ROOT / "examples/clusters/cpu-4.yaml")), script)
    for name in ("launch-deepspeed.sh", "launch-torchrun.sh", "launch-accelerate.sh"):
        assert f'export TORCH_EXTENSIONS_DIR="${{TORCH_EXTENSIONS_DIR:-{cache}}}"' in files[name].read_text(), name
