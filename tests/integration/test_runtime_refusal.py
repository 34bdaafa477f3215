"""A planted symlink in the runtime folder (issue 43, item 11): the node refuses to open the
zygote's lock through it, and ``pipette tune`` says so in one line naming the file, with the fix.
Before, the refusal came back through two Ray tasks as a ``failed`` trial, "Ray lost a rank's
node", with a 20-line coloured traceback per trial."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_planted_lock_symlink_is_one_line_naming_it() -> None:
    # A temp folder of the test's own (short: Ray's socket paths must fit 107 bytes), so the
    # planted link is in no one else's runtime folder and the tune starts a Ray of its own.
    with tempfile.TemporaryDirectory(prefix="pz", dir="/tmp") as tmp:
        env = {**os.environ, "TMPDIR": tmp, "PYTHONPATH": str(ROOT)}
        env.pop("RAY_ADDRESS", None)
        where = subprocess.run(
            [sys.executable, "-c", "from workers.cpu_isa import cpu_isa_env; from workers.host.zygote import "
             "lock_path; print(lock_path(cpu_isa_env()))"],
            env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
        lock = where.stdout.strip()
        victim = Path(tmp, "victim")
        victim.write_text("keep")
        os.symlink(victim, lock)
        done = subprocess.run(
            [sys.executable, "-m", "cli", "tune", "--cluster", str(ROOT / "examples/clusters/cpu-4.yaml"),
             "--max-trials", "2", "--steps", "3", "--home", str(Path(tmp, "home")), "--out", str(Path(tmp, "best"))],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert victim.read_text() == "keep"
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "runtime file" in line]
    assert errors == [f"pipette: error: TMPDIR: Pipette's runtime file {lock} is a symbolic link; it is not "
                      f"opened through it (fix: remove {lock} (it is recreated))"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Ray lost" not in done.stderr + done.stdout, done.stderr[-3000:]
