"""``workers.host.local.run_local``: the path the GPU suite and the GPU benchmarks take, run here
on CPU devices, so a fault in it shows without a GPU. It is the product's trial path (the same
kinds and monitor as the Ray executor) with plain processes for ranks: the same outcomes."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipette.contract import rank_env
from workers.host.local import run_local
from workers.host.local_transport import LocalTransport
from workers.host.monitor import StepReport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trials import trial

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_runner_trial_runs_locally_and_streams_its_steps() -> None:
    seen: list[StepReport] = []
    spec = trial(dp=2, zero=1)
    m = run_local(spec, timeout_s=240, on_step=seen.append)
    assert m.status == "ok", f"{m.error}\n{m.extra.get('output_tail')}"
    assert m.extra["backend"] == "deepspeed+engine+zero1"
    assert spec.min_steps <= len(m.step_times) <= spec.max_steps
    assert len(m.peak_memory) == 2 and [s.step for s in seen] == list(range(len(m.losses)))
    assert set(m.extra["phases"]) >= {"imports", "rendezvous", "build", "steps"}


def test_a_local_trial_past_its_memory_cap_ends_oom() -> None:
    m = run_local(trial(dp=2, batch=32, mbs=16, seq=256, memory_cap_bytes=150 * 1024**2), timeout_s=120)
    assert m.status == "oom", (m.status, m.error)
    assert f"rank {m.extra['oom_rank']}" in m.error


def test_a_killed_local_rank_is_named_and_nothing_is_left() -> None:
    pids: list[int] = []

    def kill_rank_1(s: StepReport) -> None:
        if s.step == 1 and not pids:
            pids.extend(s.pids)
            os.kill(s.pids[1], signal.SIGKILL)

    m = run_local(trial(dp=2, min_steps=200, max_steps=200), timeout_s=120, on_step=kill_rank_1)
    assert m.status == "failed", (m.status, m.error)
    assert m.error.startswith("rank 1 (CPU device 1) was killed by SIGKILL")
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_local_gpu_rank_sees_only_its_own_gpu() -> None:
    """What a GPU rank of run_local is given (no GPU needed to check it): its placement's GPU as
    the only visible device, device 0 inside, and no CPU accelerator."""
    transport = LocalTransport([3, 1], "gpu")
    try:
        envs = [rank_env("gpu", r, 2, transport.master(), transport.gpus()[r], transport.local_rank(r))
                for r in range(2)]
    finally:
        transport.close()
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "1"]
    assert all(e["LOCAL_RANK"] == "0" and "DS_ACCELERATOR" not in e for e in envs)


def test_a_tf32_trial_on_cpu_devices_trains_exactly_as_fp32() -> None:
    """TF32 is a GPU tensor-core mode: on CPU devices the runner leaves the matmul precision alone, so
    a ``tf32`` trial computes what the ``fp32`` one does, loss for loss (same seed and batches)."""
    fp32 = trial(dp=1)
    tf32 = replace(fp32, training=replace(fp32.training, dtype="tf32"))
    a, b = run_local(fp32, timeout_s=120), run_local(tf32, timeout_s=120)
    assert (a.status, b.status) == ("ok", "ok"), (a.error, b.error)
    n = min(len(a.losses), len(b.losses))
    assert n >= 3 and a.losses[:n] == b.losses[:n]
