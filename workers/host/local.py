"""Run a trial on this machine without Ray: one fresh ``python -m workers.rank.train`` process per
rank, the ranks' GPUs (or CPU devices) on this node as the placement names them.

This is what the GPU suite (``tests/gpu``) and the GPU benchmarks run on a machine that has a
GPU but no Ray, and what a user can run to time one candidate by hand. The Ray executor
(``workers.host.executor``) is the product's path on a cluster; both read the same event lines and
end the same way (``ok``, ``oom``, ``failed``, ``timeout``), with every process gone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pipette.emit import RANK_ENV
from pipette.measurement import Measurement
from workers.host.outcome import Outcome, measurement
from workers.ops import kill_session
from workers.phases import earliest, timeout_text
from workers.spec import TrialSpec
from workers.support import check_inputs, check_runnable

EVENT_PREFIX = "@@pipette "  # workers.rank.trial.EVENT_PREFIX, without importing torch here


def run_local(trial: TrialSpec, timeout_s: float = 600.0, env: dict[str, str] | None = None,
              workdir: str | Path | None = None) -> Measurement:
    """Run ``trial`` here and return what it measured (``extra["output_tail"]`` holds the
    last lines the ranks printed that were not events)."""
    check_runnable(trial)
    check_inputs(trial)
    work = Path(workdir or tempfile.mkdtemp(prefix="pipette-local-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "candidate.json").write_text(json.dumps(trial.candidate()))
    (work / "ds_config.json").write_text(json.dumps(trial.ds_config()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    world = trial.config.world
    argv = [sys.executable, "-m", "workers.rank.train", "--deepspeed_config", "ds_config.json",
            "--candidate", "candidate.json"]
    root = str(Path(__file__).resolve().parents[1])
    procs: list[subprocess.Popen[str]] = []
    lines: list[list[str]] = [[] for _ in range(world)]
    tails: list[list[str]] = [[] for _ in range(world)]
    for rank, device in enumerate(trial.config.devices()):
        rank_env = {**os.environ, **RANK_ENV, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        if trial.device_kind == "gpu":
            rank_env["CUDA_VISIBLE_DEVICES"] = str(device)
        else:
            rank_env |= {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
        rank_env["PIPETTE_SPAWNED_AT"] = repr(time.time())
        proc = subprocess.Popen(argv, cwd=work, env=rank_env | (env or {}), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        procs.append(proc)
        threading.Thread(target=_read, args=(proc, lines[rank], tails[rank]), daemon=True).start()
    start = time.monotonic()
    outcome: Outcome | None = None
    try:
        while outcome is None:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                time.sleep(0.5)  # the other ranks' last lines (an oom report) and exits
                if _events(lines, "oom"):
                    outcome = Outcome("oom")
                else:
                    rank = next(r for r, c in enumerate(codes) if c not in (None, 0))
                    outcome = Outcome("failed", f"rank {rank} (GPU {trial.config.devices()[rank]}) exited with "
                                                f"status {codes[rank]}\n" + "\n".join(tails[rank][-40:]))
            elif all(c == 0 for c in codes):
                time.sleep(0.1)  # the reader threads drain the pipes
                outcome = Outcome("ok")
            elif time.monotonic() - start > timeout_s:
                steps = [e for e in _parsed(lines[0]) if e.get("event") == "step"]
                behind = earliest([_phase(rank_lines) for rank_lines in lines])
                outcome = Outcome("timeout", timeout_text(timeout_s, behind, int(steps[-1]["step"]) if steps else None),
                                  phase=behind)
            else:
                time.sleep(0.1)
    finally:
        for p in procs:
            kill_session(p.pid)  # the rank and its op build's compilers (their own groups)
            p.wait()
    wall = time.monotonic() - start
    steps = [e for e in _parsed(lines[0]) if e.get("event") == "step"]
    done = {int(e["rank"]): e for e in _events(lines, "done")}
    if outcome.status == "ok" and len(done) != world:
        outcome = Outcome("failed", f"{world - len(done)} rank(s) exited without reporting their steps")
    m = measurement(trial, outcome, steps, done, _events(lines, "oom"), wall)
    m.extra["output_tail"] = "\n".join(tails[0][-40:])
    return m


def _read(proc: subprocess.Popen[str], events: list[str], tail: list[str]) -> None:
    if proc.stdout is None:
        return
    for line in proc.stdout:
        if line.startswith(EVENT_PREFIX):
            events.append(line[len(EVENT_PREFIX):])
        else:
            tail.append(line.rstrip("\n"))
            del tail[:-200]


def _phase(lines: list[str]) -> str:
    """The phase a rank said it entered last (``start`` before it said any)."""
    said = [e["phase"] for e in _parsed(lines) if e.get("event") == "phase"]
    return str(said[-1]) if said else "start"


def _parsed(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in list(lines)]


def _events(lines: list[list[str]], kind: str) -> list[dict[str, Any]]:
    return [e for rank_lines in lines for e in _parsed(rank_lines) if e.get("event") == kind]
