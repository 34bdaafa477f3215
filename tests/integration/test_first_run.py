"""A fresh environment's first trials (issue 32, item 1): DeepSpeed's CPU op is built once per
node before the first trial of either kind, outside any trial's timeout, with a line saying so
and how long; a killed rank takes its build's compilers with it; a live build is waited for,
never started beside; a trial caught in the build says so and names the fix.

"Fresh" without touching the shared environment: the ranks' ``TORCH_EXTENSIONS_DIR`` points at
an empty folder, so the op really is compiled (1-4 min on the 2-core machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipette.clusterfile import load_cluster
from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from workers.host.executor import run_trial
from workers.host.runner import RayTrialRunner
from workers.ops import CPU_OPS, live_builders, remove_stale_locks
from workers.spec import TrialSpec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OP = CPU_OPS[0]

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_a_killed_rank_takes_the_process_groups_it_started_with_it(tmp_path: Path) -> None:
    """ninja starts each compiler in a process group of its own: a killpg of the rank missed
    them, and they ran on (PPID 1) beside the next trial's build."""
    import ray

    from workers.host.rank_process import RankProcess

    pidfile = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '300'], process_group=0); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    actor = RankProcess.remote()  # type: ignore[attr-defined]
    try:
        ray.get(actor.start.remote({}, [sys.executable, "-c", code], {}), timeout=60)
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "the rank did not start its child"
            time.sleep(0.1)
        grandchild = int(pidfile.read_text())
        assert os.getpgid(grandchild) == grandchild  # its own group, as ninja's compilers
        ray.get(actor.kill.remote(), timeout=30)
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(grandchild), "the rank's child in its own process group outlived the kill"
    finally:
        ray.kill(actor)


@pytest.mark.timeout(60)
def test_a_live_build_is_waited_for_and_its_lock_kept_until_it_ends(tmp_path: Path) -> None:
    folder = tmp_path / OP
    folder.mkdir()
    lock = folder / "lock"
    # PyTorch's FileBaton: the builder creates the lock, holds it open, removes it when done
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import os, time; fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); "
                               f"time.sleep(3); os.close(fd); os.remove({str(lock)!r})"])
    while not lock.exists():
        time.sleep(0.05)
    start = time.monotonic()
    removed = remove_stale_locks(tmp_path)
    assert time.monotonic() - start >= 2.0, "a live builder's lock was removed beside it"
    assert removed == [] and holder.wait(timeout=10) == 0
    # a lock whose builder is gone, with its compiler still running in the folder (orphaned)
    lock.write_text("")
    compiler = subprocess.Popen(["sleep", "2"], cwd=folder)
    assert live_builders(folder) == [compiler.pid]
    start = time.monotonic()
    assert remove_stale_locks(tmp_path) == [str(lock)]
    assert time.monotonic() - start >= 1.0 and compiler.poll() is not None


def _tiny(config: ParallelConfig) -> TrialSpec:
    return TrialSpec(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=4, seq_len=32, dtype="fp32"), config,
                     warmup_steps=1, min_steps=2, max_steps=2)


@pytest.mark.timeout(900)
def test_a_fresh_environment_loses_no_trial_to_the_op_build(tmp_path: Path) -> None:
    cache = tmp_path / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(cache)}
    config = ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=4)
    # Without the build ahead, a trial is caught in it: it says where, and the fix; the build's
    # compilers (process groups of their own) are gone with its ranks.
    caught = run_trial(_tiny(config), timeout_s=20, env=env)
    assert caught.status == "timeout", caught.error
    assert caught.extra["phase"] == "ops"
    assert caught.error == ("timed out after 20 s in its op build (DeepSpeed's CPU op) before its first step: "
                            "give it more time with --trial-timeout 40")
    assert "#" not in caught.error
    time.sleep(1)
    assert live_builders(cache / OP) == [], "the killed trial's compilers run on"

    # The first trial of a job, a script's: the op is built once before it, outside its timeout
    # (20 s here, less than the build takes), said in two lines; then a trial of the runner.
    notes: list[str] = []
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    training = TrainingSpec(global_batch=4, seq_len=32, dtype="fp32")
    script = ScriptSpec(argv=("python", "ds_tiny.py"), kind="deepspeed", workdir=str(HERE / "scripts"))
    scripted = RayTrialRunner(ModelSpec.preset("tiny-llama"), training, cluster, timeout_s=60, warmup_steps=1,
                              min_steps=2, max_steps=2, env=env, script=script, on_note=notes.append)
    m = scripted(config, lambda p: False)
    assert m.status == "ok", m.error
    assert len(notes) == 2, notes
    assert notes[0].startswith("building DeepSpeed's CPU communication op on ") and "outside its timeout" in notes[0]
    assert notes[1].startswith("built DeepSpeed's CPU communication op in ") and str(cache) in notes[1]
    assert (cache / OP / f"{OP}.so").exists()
    runner = RayTrialRunner(ModelSpec.preset("tiny-llama"), training, cluster, timeout_s=60, warmup_steps=1,
                            min_steps=2, max_steps=2, env=env, on_note=notes.append)
    phases: list[str] = []
    runner.on_phase = lambda phase, elapsed: phases.append(phase)
    m = runner(config, lambda p: False)
    assert m.status == "ok", m.error
    assert len(notes) == 2, notes  # built already: nothing more to say
    assert m.extra["phases"]["ops"] < 20  # loaded, not built
    assert phases[0] == "start" and "steps" in phases
