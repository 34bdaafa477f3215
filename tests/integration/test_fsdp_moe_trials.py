"""An expert-parallel candidate as a kind of trial: the tiny MoE (``tiny-moe``: 8 experts, top-2)
with ep=2 x dp=2 on the fsdp stack runs through the product's path (Ray transport, the monitor,
``RunnerTrial`` with ``workers.rank.fsdp``), is measured and recorded as every trial is (a
``TrialRecord`` that reads back), and trains as its ep=1 trial does; its ``launch.sh`` runs as
printed and computes the trial's losses; an MoE candidate the runner cannot split is refused before
any rank starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.contract import EVENT_PREFIX
from pipette.emit import write_launch_files
from pipette.errors import InfeasibleError
from pipette.model import ModelSpec
from pipette.plan import Planned, make_plan
from pipette.training import TrainingSpec
from pipette.trials import TrialRecord
from workers.host.executor import run_trial
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MOE = ModelSpec.preset("tiny-moe")
TRAINING = TrainingSpec(global_batch=8, seq_len=32, dtype="fp32")


def _planned(dp: int, ep: int) -> Planned:
    """The fsdp stack's planned candidate of tiny-moe on the 4-CPU cluster file with these degrees."""
    cluster = load_cluster(Path(__file__).resolve().parents[2] / "examples" / "clusters" / "cpu-4.yaml")
    plan = make_plan(MOE, TRAINING, cluster, stack="fsdp")
    return next(p for p in plan.ranked if (p.config.pp, p.config.dp, p.config.ep, p.config.zero_stage) == (1, dp, ep, 3)
                and p.config.recompute == "none")


def _spec(config: ParallelConfig) -> TrialSpec:
    return TrialSpec(MOE, TRAINING, config, warmup_steps=1, min_steps=2, max_steps=2, stack="fsdp")


def test_an_expert_parallel_trial_runs_is_recorded_and_trains_as_ep_1() -> None:
    planned = _planned(4, 2)
    m2 = run_trial(_spec(planned.config), timeout_s=300)
    assert m2.status == "ok", f"{m2.error}\n{m2.extra.get('output_tail')}"
    assert m2.extra["backend"].startswith("fsdp2-full-shard+moe-ep2"), m2.extra["backend"]
    assert len(m2.peak_memory) == 4 and len(m2.step_times) == 2 and len(m2.losses) == 3
    # recorded as the tuner records a trial (pipette.search_step), and read back whole
    record = TrialRecord(0, planned.config, m2, planned.perf, planned.memory, planned.perf.step_time, stack="fsdp")
    back = TrialRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert back.config.ep == 2 and back.label == record.label and "-ep2-" in back.label
    assert back.measurement.losses == m2.losses and back.stack == "fsdp"
    # the same candidate at ep=1: the same model, tokens and steps (expert parallelism moves tokens)
    m1 = run_trial(_spec(replace(planned.config, ep=1)), timeout_s=300)
    assert m1.status == "ok", f"{m1.error}\n{m1.extra.get('output_tail')}"
    assert m1.extra["trainable_params"] == m2.extra["trainable_params"]
    assert m2.losses == pytest.approx(m1.losses, abs=1e-4)


def test_the_expert_parallel_picks_launch_runs_as_printed_and_computes_its_trials_losses(tmp_path: Path) -> None:
    """``launch.sh`` of an ep=2 candidate (Pipette's runner under ``torchrun``) trains as its trial."""
    planned = _planned(4, 2)
    spec = _spec(planned.config)
    options = {k: v for k, v in spec.runner_options().items() if k != "device_kind"}
    cluster = load_cluster(Path(__file__).resolve().parents[2] / "examples" / "clusters" / "cpu-4.yaml")
    files = write_launch_files(tmp_path, MOE, TRAINING, planned.config, cluster, extra={"trial": options}, stack="fsdp")
    assert sorted(files) == ["candidate.json", "hostfile", "launch.sh", "rank_map.json"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS")} | {"MASTER_PORT": str(port)}
    done = subprocess.run(["bash", "-c", f"cd {tmp_path} && ./launch.sh"], env=env, capture_output=True, text=True,
                          timeout=400)
    log = (tmp_path / "launch.log").read_text()
    assert done.returncode == 0, log[-3000:]
    events = [json.loads(line[len(EVENT_PREFIX):]) for line in log.splitlines() if line.startswith(EVENT_PREFIX)]
    finished = [e for e in events if e["event"] == "done"]
    assert len(finished) == 4 and all(e["backend"].startswith("fsdp2-full-shard+moe-ep2") for e in finished)
    trial = run_trial(spec, timeout_s=300)
    assert trial.status == "ok", f"{trial.error}\n{trial.extra.get('output_tail')}"
    assert finished[0]["losses"] == pytest.approx(trial.losses, abs=1e-4)


def test_an_moe_candidate_the_runner_cannot_split_is_refused_before_any_rank() -> None:
    config = ParallelConfig(tp=2, pp=1, dp=2, mbs=1, global_batch=8, zero_stage=3)
    with pytest.raises(InfeasibleError) as e:
        run_trial(_spec(config), timeout_s=60)
    assert "not tensor-parallel" in str(e.value)
