"""A killed DeepSpeed op build must not poison later trials (issue 17, item 9): the build's
``lock`` file that a killed builder leaves behind made every later CPU rank wait until its
trial timed out. Ranks build through ``workers.ops.ensure_ops`` under an flock, which clears it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.host.executor import run_trial
from workers.rank.train import build_environment
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_lock_left_by_a_killed_build_does_not_stall_the_next_trial() -> None:
    cache = Path(build_environment()["TORCH_EXTENSIONS_DIR"])  # the ranks' own extensions folder
    lock = cache / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")  # what a build killed mid-way leaves
    old = time.time() - 3600
    os.utime(lock, (old, old))
    spec = TrialSpec(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=4, seq_len=32, dtype="fp32"),
                     ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=4), min_steps=2, max_steps=2)
    start = time.monotonic()
    m = run_trial(spec, timeout_s=120)
    assert m.status == "ok", m.error
    assert time.monotonic() - start < 100
    assert not lock.exists()
