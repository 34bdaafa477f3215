"""Files people give Pipette are read bounded, as UTF-8, as YAML without aliases or repeated
keys, and every problem is one line (issue 17, items 15 and 25): a circular alias and invalid
UTF-8 gave tracebacks, a 395-byte "billion laughs" took 4.5 GB and 36 s, and a repeated key
was silently dropped."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.client_jobfile import load_job_file
from pipette.errors import SpecError
from pipette.textfile import MAX_BYTES

ROOT = Path(__file__).resolve().parents[2]


def laughs() -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(ord("b"), ord("j")):
        text += f"{chr(i)}: &{chr(i)} [" + ",".join([f"*{chr(i - 1)}"] * 9) + "]\n"
    return text


@pytest.mark.parametrize(("content", "words"), [
    (b"a: &a [*a]\n", "uses an alias"),
    (laughs().encode(), "uses an alias"),
    (b"cluster: local\nmodel: \xff\xfe tiny\n", "is not UTF-8 text (byte 22)"),
    (b"cluster: local\ncluster: other\nmodel: tiny-llama\n", "gives the key 'cluster' twice"),
    (b"cluster: local\nmodel: [unclosed\n", "is not valid YAML at line"),
    (b"- a list\n", "does not hold a mapping"),
])
def test_a_bad_job_file_is_one_error(tmp_path: Path, content: bytes, words: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_bytes(content)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(SpecError) as e:
        load_job_file(str(job))
    assert words in e.value.message and e.value.field == "job file"
    assert time.monotonic() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB: no expansion


def test_a_file_larger_than_the_service_takes_is_refused_unread(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("cluster: local\n" + "# padding\n" * (MAX_BYTES // 10 + 1))
    with pytest.raises(SpecError, match="more than the 1,048,576 a job file may have"):
        load_job_file(str(job))


def test_a_good_job_file_still_loads(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("cluster: local\nmodel: tiny-llama\ntraining: {global_batch: 4, seq_len: 32}\n")
    assert load_job_file(str(job))["training"] == {"global_batch": 4, "seq_len": 32}


@pytest.mark.parametrize("flag", ["--cluster", "--recipe"])
def test_plan_refuses_an_aliased_file_in_one_line(tmp_path: Path, flag: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(laughs())
    args = ["--cluster", str(ROOT / "examples" / "clusters" / "cpu-4.yaml"), "--global-batch", "4", "--seq-len", "8"]
    args = [str(bad) if a == str(ROOT / "examples" / "clusters" / "cpu-4.yaml") and flag == "--cluster" else a
            for a in args]
    if flag == "--recipe":
        args += ["--recipe", str(bad)]
    done = subprocess.run([sys.executable, "-m", "cli", "plan", "--model", "tiny-llama", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"pipette: error: {flag}: ") and "uses an alias" in lines[0]


@pytest.mark.parametrize(("config", "words"), [
    ('{"hidden_size": 64, "x": ' + "[" * 5000 + "]" * 5000 + "}", "is nested too deeply to read"),
    ('{"hidden_size": 64, "pad": "' + "x" * (MAX_BYTES + 1) + '"}', "more than the 1,048,576 a config.json may have"),
])
def test_a_job_files_model_config_is_read_bounded(tmp_path: Path, config: str, words: str) -> None:
    """Issue 32, item 19: a deeply nested ``model:`` config.json gave a RecursionError
    traceback, a 1 MiB+ one "cannot reach the service" (the service reset the upload)."""
    (tmp_path / "config.json").write_text(config)
    job = tmp_path / "job.yaml"
    job.write_text("cluster: local\nmodel: config.json\ntraining: {global_batch: 4, seq_len: 32}\n")
    with pytest.raises(SpecError) as e:
        load_job_file(str(job))
    assert words in e.value.message and e.value.field == "model" and e.value.fix, e.value
