"""Keep oneDNN off CPU instructions the kernel does not let this process use.

Seen on this project's CI machines (Xeon with AMX, in a sandbox): the CPU advertises
``amx_bf16`` but the kernel never grants the AMX tile state, so the first bf16 matmul
dies with SIGILL (``python -c "torch.ones(64, 64, dtype=torch.bfloat16) @ ..."`` exits 132).
A rank that dies like that would be a failed trial that says nothing about the candidate,
so every rank process gets ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` where, and only where,
a one-off bf16 matmul in a child process proves AMX unusable.

The answer is the node's (its CPU, its kernel since boot, this Python and torch), so it is
probed once per node and kept in a file in this user's runtime folder (``workers.runtime``:
private, so no other user can plant an answer, which goes into every rank's environment) that
every process of the node reads: ``RankProcess`` actors are fresh for every trial, and each of them probing (a torch
import, ~1.5 CPU-seconds) cost a 4-rank tiny-llama trial on a 2-core machine a third of its
time (``tests/benchmarks/trial_overhead.py``; docs/results.md, "Trial builds and overhead").
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from pipette.errors import PipetteError
from workers.runtime import open_private, read_private, runtime_dir, write_private

_PROBE = "import torch; a = torch.ones(64, 64, dtype=torch.bfloat16); (a @ a).sum().item()"
SAFE_ISA = "AVX512_CORE_BF16"


def _advertises_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def _node_key() -> str:
    """What the probe's answer depends on: this boot of the kernel, the Python, the torch."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "no-torch"
    return hashlib.sha256(f"{boot}\0{sys.executable}\0{torch_version}\0{_PROBE}".encode()).hexdigest()[:16]


def cache_path() -> Path:
    """The node's answer, shared by this user's processes (the temp folder honours ``TMPDIR``)."""
    return runtime_dir() / f"cpu-isa-{_node_key()}.json"


def _read(path: Path) -> dict[str, str] | None:
    try:
        data = json.loads(read_private(path))
    except (OSError, ValueError):
        return None  # absent, or torn by a crash: probe again
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    return env


def _probe() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"ONEDNN_MAX_CPU_ISA": SAFE_ISA}
    return {} if done.returncode == 0 else {"ONEDNN_MAX_CPU_ISA": SAFE_ISA}


@functools.cache
def cpu_isa_env() -> dict[str, str]:
    """Environment for a rank process on this node: empty unless AMX must be avoided. The
    first process of the node to ask probes (the others wait on a file lock) and writes the
    answer for the rest; an unreadable answer is probed again."""
    if "ONEDNN_MAX_CPU_ISA" in os.environ or not _advertises_amx():
        return {}
    try:
        path = cache_path()
        lock = os.fdopen(open_private(path.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a")
    except (OSError, PipetteError):
        return _probe()  # an unwritable or unsafe temp folder: probe in this process only
    cached = _read(path)
    if cached is not None:
        lock.close()
        return cached
    with contextlib.closing(lock):
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read(path)  # another process may have probed while this one waited
        if cached is not None:
            return cached
        env = _probe()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            write_private(tmp, json.dumps({"env": env}))
            os.replace(tmp, path)
        return env
