"""Keep oneDNN off CPU instructions the kernel does not let this process use.

Seen on this project's CI machines (Xeon with AMX, in a sandbox): the CPU advertises
``amx_bf16`` but the kernel never grants the AMX tile state, so the first bf16 matmul
dies with SIGILL (``python -c "torch.ones(64, 64, dtype=torch.bfloat16) @ ..."`` exits 132).
A rank that dies like that would be a failed trial that says nothing about the candidate,
so every rank process gets ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` where, and only where,
a one-off bf16 matmul in a child process proves AMX unusable.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

_PROBE = "import torch; a = torch.ones(64, 64, dtype=torch.bfloat16); (a @ a).sum().item()"
SAFE_ISA = "AVX512_CORE_BF16"


def _advertises_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


@functools.cache
def cpu_isa_env() -> dict[str, str]:
    """Environment for a rank process on this node: empty unless AMX must be avoided."""
    if "ONEDNN_MAX_CPU_ISA" in os.environ or not _advertises_amx():
        return {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"ONEDNN_MAX_CPU_ISA": SAFE_ISA}
    return {} if done.returncode == 0 else {"ONEDNN_MAX_CPU_ISA": SAFE_ISA}
