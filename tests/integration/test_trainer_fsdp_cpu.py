"""The HF Trainer LoRA example under the fsdp stack runs its trials on CPU devices (issue 43, item
27: on CPU the Trainer needs Accelerate's state set up first and ``use_configured_state``; without
it the example stopped before its first step, or each rank trained alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from workers.host.executor import run_trial
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPTS = Path(__file__).resolve().parents[2] / "examples" / "scripts"


@pytest.mark.parametrize("zero_stage", [3, 0], ids=["full-shard", "ddp"])
def test_the_trainer_example_trains_each_fsdp_candidate_on_cpu(tmp_path: Path, zero_stage: int) -> None:
    model = ModelSpec.from_hf_config(json.loads((SCRIPTS / "tiny-llama" / "config.json").read_text()))
    script = ScriptSpec(argv=("python", "hf_trainer_lora.py", "--output_dir", str(tmp_path), "--report_to", "none",
                              "--save_strategy", "no", "--seq_len", "64"),
                        kind="hf-trainer", workdir=str(SCRIPTS), fsdp=True)
    config = ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=8, zero_stage=zero_stage, recompute="full")
    trial = TrialSpec(model, TrainingSpec(global_batch=8, seq_len=64, dtype="fp32"), config, warmup_steps=1,
                      min_steps=2, max_steps=2, script=script)
    m = run_trial(trial, timeout_s=400)
    assert m.status == "ok", m.error  # sharding, batch and recomputation checked against the candidate's
    assert m.extra["timing_source"] == "reporter" and len(m.step_times) == 2
