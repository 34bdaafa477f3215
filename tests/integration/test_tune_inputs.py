"""``pipette tune`` checks the job's own inputs before it measures anything (issue 17, item 4):
a bad data file was found only by every trial (each failing twice as 'rank 0 exited with
status 2', the failures stored in the cluster's trial memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tune(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", "tune", "--home", str(tmp / "home"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize(("content", "words"), [
    (None, "--data: no data file"),
    ('{"input": "a"}\nnot json\n', "line 2 is not JSON"),
    ('[1, 2]\n', "line 1 is not a JSON object"),
    ('{"input": "a"}\n', "fewer than one sequence"),
])
def test_a_bad_data_file_is_refused_before_profiling(tmp_path: Path, content: str | None, words: str) -> None:
    data = tmp_path / "prompts.jsonl"
    if content is not None:
        data.write_text(content)
    done = tune(tmp_path, "--data", str(data))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("pipette: error: --data: "), done.stderr
    assert words in lines[0]
    assert not (tmp_path / "home").exists()  # no profile measured, no trial stored


def test_a_sequence_longer_than_the_model_is_refused_before_profiling(tmp_path: Path) -> None:
    done = tune(tmp_path, "--seq-len", "100000")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("pipette: error: --seq-len: is 100000, more than the 256")
    assert not (tmp_path / "home" / "profiles").exists()


@pytest.mark.parametrize(("args", "words"), [
    (["--max-trials", "6", "--reserve", "6"], "--reserve: is 6 of max_trials 6"),
    (["--reserve", "-1"], "--reserve: is -1"),
    (["--retime-rounds", "-2"], "--retime-rounds: is -2"),
    (["--tolerance", "1.5"], "--tolerance: is 1.5"),
    (["--time-budget", "0"], "--time-budget: is 0"),
])
def test_a_bad_budget_names_its_flag_before_profiling(tmp_path: Path, args: list[str], words: str) -> None:
    done = tune(tmp_path, *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("pipette: error: "), done.stderr
    assert words in lines[0] and "fix:" in lines[0], lines[0]
    assert not (tmp_path / "home").exists()


def test_a_trial_memory_it_cannot_read_is_refused_before_ray_starts(tmp_path: Path) -> None:
    """A line of the cluster's trial memory that is not a record (a crash cut it, a hand edit)
    was skipped in silence: the job learned from less than the user believed. Now it is named,
    with its line and the fix, in one line, before Ray or any trial starts."""
    from types import SimpleNamespace

    from pipette.clusterfile import load_cluster
    from pipette.tuner import cluster_key

    cluster = ROOT / "examples" / "clusters" / "cpu-4.yaml"
    store = tmp_path / "home" / "trials" / f"{cluster_key(SimpleNamespace(cluster=load_cluster(cluster)))}.jsonl"
    store.parent.mkdir(parents=True)
    store.write_text('{"number": 0, "attempt": 1, "label": "tp1-pp1-dp4-mb\n')
    done = tune(tmp_path, "--cluster", str(cluster))
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert last.startswith(f"pipette: error: {store}: line 1 is not a trial record (not JSON: "), last
    assert "delete or repair line 1" in last and "--no-memory" in last
    assert "ray" not in done.stderr.lower()


def _processes_with(marker: str) -> list[str]:
    """The command lines of live processes whose environment holds ``marker``."""
    out = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                out.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            continue  # gone, or not ours to read
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_embedded_tune_leaves_no_process_behind(tmp_path: Path) -> None:
    """`pipette tune` on its own local Ray: once it ends, nothing it started runs on (the zygote
    its Ray's host actor started outlived it by 30+ minutes; issue 17, item 6). Its processes
    are found by a marker in their environment, which every descendant inherits; its own
    TMPDIR gives it its own zygote, not the test session's."""
    import os
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="pl", dir="/tmp"))  # short: Ray's socket paths live under it

    marker = f"PIPETTE_LEAK_MARK={tmp_path.name}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "TMPDIR": str(tmp), "PIPETTE_LEAK_MARK": tmp_path.name}
    done = subprocess.run([sys.executable, "-m", "cli", "tune", "--devices", "2", "--max-trials", "1",
                           "--steps", "2", "--home", str(tmp_path / "home"), "--out", str(tmp_path / "best")],
                          capture_output=True, text=True, timeout=540, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tmp.glob("pipette-*/zygote-*.sock*")), "the job's ranks did not fork from its own zygote"
    import time

    deadline = time.monotonic() + 30  # Ray's last processes take a moment to go
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left
    shutil.rmtree(tmp, ignore_errors=True)
