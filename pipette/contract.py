"""The contract between a rank and the host that starts and watches it; no torch here.

A rank (Pipette's runner, the probe, a user's script through ``pipette.report``) writes its
reports to stdout as JSON lines that start with ``EVENT_PREFIX``; the host
(``workers.host.monitor``) reads them with ``split_event``. The kinds of event:

- ``phase`` (every rank): the phase it entered (``workers.phases``);
- ``step`` (rank 0 of the runner; every rank of a script): one optimizer step's time and loss;
- ``done`` (every rank): what it measured (the probe's rank 0: every rank's figures);
- ``oom`` (a rank that ran out of memory, then exits with ``OOM_EXIT``);
- ``ds_engine``, ``ds_step``, ``ds_done`` (a script's DeepSpeed engine, ``workers/script_hook``).

``rank_env`` is the one place a rank's process environment is built, for every transport (Ray,
local) and every rank program; the emitted launch files set ``RANK_ENV`` too, so a launch
runs at its trial's speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EVENT_PREFIX = "@@pipette "
#: the exit status of a rank that ran out of memory (after its ``oom`` event)
OOM_EXIT = 3
#: the modules a rank runs as ``python -m``: Pipette's runners (what launch files run too) and
#: the probe's rank; ``workers.train`` is the runner's old name, kept for earlier launch files
TRAIN_ENTRY = "workers.rank.train"
#: the PyTorch-native runner (FSDP2, TP, PP on a DeviceMesh): the ``fsdp`` stack's trials
FSDP_ENTRY = "workers.rank.fsdp"
PROBE_ENTRY = "workers.rank.probe"
OLD_TRAIN_ENTRY = "workers.train"

#: One intra-op thread per rank (the ranks of a node share its cores; unpinned, a CPU launch
#: ran 0.5-2.3 s a step against its trial's 0.14 s) and few malloc arenas: docs/workers.md.
RANK_ENV = {"PYTHONUNBUFFERED": "1", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}


def event_line(event: dict[str, Any]) -> str:
    """The line a rank writes for ``event``."""
    return EVENT_PREFIX + json.dumps(event) + "\n"


def split_event(line: str) -> tuple[str | None, str]:
    """(the event's JSON, the text before it) of an output line; (None, line) when it holds
    none. An event may follow a progress bar's carriage return on one line (stdout and stderr
    share the pipe), so it starts at its prefix wherever that is."""
    at = line.find(EVENT_PREFIX)
    if at < 0:
        return None, line.rstrip("\n")
    return line[at + len(EVENT_PREFIX):], line[:at].rstrip()


def rank_env(device_kind: str, rank: int, world: int, master: tuple[str, int], gpu: str | None = None,
             local_rank: int = 0) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world``: the rendezvous at ``master``, the threads
    and arenas of ``RANK_ENV``, and its device: on a GPU node it sees only ``gpu``; on CPU
    devices no GPU and DeepSpeed's CPU accelerator."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])} | RANK_ENV
    if device_kind == "gpu":
        env |= {"CUDA_VISIBLE_DEVICES": gpu or "0", "LOCAL_RANK": "0"}
    else:
        env |= {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    env["PIPETTE_SPAWNED_AT"] = repr(time.time())
    return env


def extensions_dir(prefix: str | None = None) -> str:
    """Where the ranks of the Python environment at ``prefix`` (this one by default) build
    DeepSpeed's JIT ops: one cache per environment, since two environments compile different
    paths and rebuilt the op in turn."""
    tag = hashlib.sha1((prefix or sys.prefix).encode()).hexdigest()[:10]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "pipette", f"torch_extensions-{tag}")


def build_environment() -> dict[str, str]:
    """``PATH`` and ``TORCH_EXTENSIONS_DIR`` for DeepSpeed's JIT builds in a rank.

    Ninja 1.13 (the environment's) and 1.11 (Debian's) discard each other's build log, and two
    environments compile different paths, so processes that differ in either rebuilt the op in
    turn (1.5 to 4 minutes each on a 2-core machine: docs/workers.md). So a rank uses its
    environment's ``bin`` first (as an activated environment does) and a cache of its own
    environment, unless the user set one."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bindir:
        path = bindir + os.pathsep + path if path else bindir
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or extensions_dir()  # the emitted launches' too
    return {"PATH": path, "TORCH_EXTENSIONS_DIR": cache}
