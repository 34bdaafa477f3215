"""A job builds only the ops its stack uses (issue 43, item 28: an FSDP-only job built
DeepSpeed's CPU op for 147 s before its first trial)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipette.clusterfile import load_cluster
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from workers.host.runner import RayTrialRunner

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _runner(cache: Path, script: ScriptSpec | None, stack: str = "pipette") -> RayTrialRunner:
    return RayTrialRunner(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=8, seq_len=32, dtype="fp32"),
                          load_cluster(str(ROOT / "examples/clusters/cpu-4.yaml")), script=script, stack=stack,
                          env={"TORCH_EXTENSIONS_DIR": str(cache)})


def test_an_fsdp_job_builds_no_deepspeed_op_and_a_deepspeed_one_does(tmp_path: Path) -> None:
    scripts = ROOT / "examples" / "scripts"
    fsdp_script = ScriptSpec(argv=("python", "accelerate_fsdp.py"), kind="accelerate-fsdp", workdir=str(scripts))
    cache = tmp_path / "extensions"
    for runner in (_runner(cache, fsdp_script), _runner(cache, None, stack="fsdp")):
        started = time.monotonic()
        runner.prepare()  # the real preparation: with nothing to build it returns at once
        assert time.monotonic() - started < 5
        assert not cache.exists() or not any(cache.iterdir()), sorted(cache.iterdir())
        assert not runner.needs_deepspeed_op()
    ds_script = ScriptSpec(argv=("python", "deepspeed_loop.py"), kind="deepspeed", workdir=str(scripts))
    assert _runner(cache, ds_script).needs_deepspeed_op()
    assert _runner(cache, None).needs_deepspeed_op()
