"""``pipette tune`` for real: the CLI on a real Ray, real DeepSpeed trials of tiny-llama with
LoRA on CPU devices (gloo), a small budget so CI can afford it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from pipette.trials import JsonlTrialStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


TAG = f"test-tune-{uuid.uuid4().hex[:8]}"
#: the module's first tune: its output, and the folder its home and files are in
FirstTune = tuple[subprocess.CompletedProcess[str], Path]


def _env() -> dict[str, str]:
    import ray

    # Join the session's Ray instead of starting a second one on this small machine.
    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1",
            "PIPETTE_RANK_TAG": TAG}


def _tune(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cli", "tune", "--devices", "2", "--steps", "3",
            "--home", str(tmp / "home"), "--out", str(tmp / "best"), *extra]


@pytest.fixture(scope="module")
def first_tune(tmp_path_factory: pytest.TempPathFactory) -> FirstTune:
    """The module's first tune, on a fresh home: it measures the machine (its profile is what the
    later tunes here start from, as a user's next tune on this machine does) and runs 2 trials."""
    tmp = tmp_path_factory.mktemp("first")
    done = subprocess.run(_tune(tmp, "--max-trials", "2", "--json"), capture_output=True, text=True,
                          env=_env(), timeout=850)
    return done, tmp


def _with_its_profile(first_tune: FirstTune, tmp: Path) -> None:
    """Give ``tmp``'s home the profile the first tune measured: these tunes reuse it ("reusing
    the profile measured 0 min ago") instead of measuring the machine again each."""
    profiles = first_tune[1] / "home" / "profiles"
    assert list(profiles.glob("*.json")), first_tune[0].stderr[-3000:]
    shutil.copytree(profiles, tmp / "home" / "profiles")


def _no_rank_left() -> bool:
    """No process carries this test's rank tag (the CLI hands it to every rank it starts)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"PIPETTE_RANK_TAG={TAG}".encode() in environ.read_bytes():
                return False
        except OSError:
            continue  # gone, or not ours to read
    return True


def test_tune_runs_real_trials_and_writes_the_best(first_tune: FirstTune) -> None:
    done, tmp_path = first_tune
    assert "measuring the local cluster" in done.stderr  # a fresh home: it measured the machine
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["trials_run"] == 2
    best = result["best"]
    assert best["measurement"]["status"] == "ok"
    assert len(best["measurement"]["step_times"]) >= 3
    side = best["side_by_side"]["step_time_s"]
    assert side["measured"] > 0 and side["analytic"] > 0 and side["learned"] > 0
    losses = best["measurement"]["losses"]
    assert losses[-1] < losses[0]  # it trained
    for name in ("ds_config.json", "hostfile", "rank_map.json", "launch.sh", "candidate.json"):
        assert (tmp_path / "best" / name).exists()
    ds = json.loads((tmp_path / "best" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 16
    # progress went to stderr: the plan, one line per trial, and why it stopped
    assert "runnable by the backend" in done.stderr
    assert best["label"] in done.stderr and "stopped after" in done.stderr
    # what it measured is kept for the next job on this cluster
    store = list((tmp_path / "home" / "trials").glob("*.jsonl"))
    kept = JsonlTrialStore(store[0]).records()
    assert len(store) == 1 and [r.to_dict() for r in kept] == result["trials"]
    # the stack it tuned for (Pipette's runner by default), in the result, the files and the records
    assert result["stack"] == "pipette"
    assert json.loads((tmp_path / "best" / "candidate.json").read_text())["stack"]["name"] == "pipette"
    assert all(r.stack == "pipette" and r.started_at and r.ended_at for r in kept)
    assert list((tmp_path / "home" / "profiles").glob("*.json"))
    assert _no_rank_left()


def test_ctrl_c_stops_the_running_trial_and_keeps_what_was_measured(tmp_path: Path, first_tune: FirstTune) -> None:
    _with_its_profile(first_tune, tmp_path)
    proc = subprocess.Popen(_tune(tmp_path, "--max-trials", "8", "--stop-probability", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    out, text = _signal_during_the_second_trial(proc, signal.SIGINT)
    assert proc.returncode == 130, text[-3000:]
    assert "interrupted" in text
    # issue 43, item 15: stdout says so first, and the stopped trial reads interrupted, not pruned
    assert out.lstrip().startswith("INTERRUPTED: interrupted (Ctrl-C)"), out[:2000]
    trial_lines = [line for line in text.splitlines() if line.strip().startswith("#")]
    assert " interrupted " in trial_lines[-1], text[-3000:]
    assert "interrupted before its end" in out and "best so far: " in out, out
    store = list((tmp_path / "home" / "trials").glob("*.jsonl"))
    kept = JsonlTrialStore(store[0]).records()
    assert kept and kept[0].number == 0
    time.sleep(2)
    assert _no_rank_left()


def _signal_during_the_second_trial(proc: subprocess.Popen[str], signum: int,
                                    send: Callable[[], None] | None = None) -> tuple[str, str]:
    """Wait for the first trial to end and the second to start running, send ``signum`` (or call
    ``send``), and return (stdout, everything on stderr)."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if line.strip().startswith("#0"):  # the first trial ended; the second is starting
            time.sleep(8)
            if send is not None:
                send()
            else:
                proc.send_signal(signum)
            break
    out, err = proc.communicate(timeout=120)
    return out, "".join(lines) + err


def test_a_model_that_fits_nowhere_ends_at_planning(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cli", "tune", "--model", "llama2-70b", "--method", "full",
         "--cluster", "examples/clusters/cpu-4.yaml", "--home", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 1
    assert "nothing fits" in done.stderr and "short by" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "trials").exists()
    assert time.monotonic() - start < 60


def test_sigterm_of_tune_json_prints_the_best_so_far_and_exits_143(tmp_path: Path, first_tune: FirstTune) -> None:
    """Issue 32, item 7: SIGTERM of `pipette tune --json` printed nothing (Ray's handler exited 15)."""
    _with_its_profile(first_tune, tmp_path)
    proc = subprocess.Popen(_tune(tmp_path, "--max-trials", "8", "--stop-probability", "0", "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    out, text = _signal_during_the_second_trial(proc, signal.SIGTERM)
    assert proc.returncode == 143, text[-3000:]
    assert "interrupted (SIGTERM): stopping the running trial" in text
    result = json.loads(out)
    assert result["interrupted"] and result["stop_reason"].startswith("interrupted (SIGTERM)")
    assert result["trials"] and result["trials"][0]["number"] == 0
    time.sleep(2)
    assert _no_rank_left()


def test_sigterm_to_the_process_group_of_tune_json_still_prints_the_json_and_exits_143(
        tmp_path: Path, first_tune: FirstTune) -> None:
    """Issue 43, item 13: ``timeout``, systemd and Slurm send SIGTERM to the whole process group.
    With its own local Ray (no RAY_ADDRESS), the tuner's GCS and raylet were in that group and died
    with it: the tuner waited 60 s for the GCS ("Failed to connect to GCS within 60 seconds") and
    died without the JSON. Ray's processes now live in a session of their own."""
    env = {k: v for k, v in _env().items() if k != "RAY_ADDRESS"}  # it starts a local Ray of its own
    _with_its_profile(first_tune, tmp_path)
    proc = subprocess.Popen(_tune(tmp_path, "--max-trials", "8", "--stop-probability", "0", "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group, as under `timeout`
    killed_at = 0.0
    ray_processes: list[int] = []

    def to_the_group() -> None:
        nonlocal killed_at
        ray_processes.extend(_descendants(proc.pid))
        assert any(os.getpgid(p) != proc.pid for p in ray_processes)  # out of the tuner's group
        os.killpg(proc.pid, signal.SIGTERM)
        killed_at = time.monotonic()

    try:
        out, text = _signal_during_the_second_trial(proc, signal.SIGTERM, send=to_the_group)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 143, text[-3000:]
    assert time.monotonic() - killed_at < 45, text[-3000:]  # no 60 s wait for a dead GCS
    assert "Failed to connect to GCS" not in text
    result = json.loads(out)
    assert result["interrupted"] and result["stop_reason"].startswith("interrupted (SIGTERM)")
    assert result["trials"] and result["trials"][0]["number"] == 0 and result["best"] is not None
    time.sleep(2)
    assert _no_rank_left()
    assert not [p for p in ray_processes if Path(f"/proc/{p}").exists()]  # its Ray ended with it


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2:].split()[1])
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        todo += children
    return found
