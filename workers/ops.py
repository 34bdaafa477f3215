"""DeepSpeed's JIT-built ops, built once per environment before a rank needs them, under a lock
that cannot outlive its holder.

A CPU rank's DeepSpeed builds its shared-memory communication op on first use (a minute or
more on a small machine), guarded by PyTorch's ``FileBaton``: a ``lock`` file that whoever
creates it must delete. A build killed mid-way (Ctrl-C, ``timeout``, a SIGKILLed service)
left that file behind, and every later rank on the machine waited on it silently until its
trial timed out, and was charged for it (issue 17, item 9). Here every Pipette rank builds
through ``ensure_ops``: it takes an ``flock`` on the extensions folder (the kernel releases it
when its holder dies, however it dies); holding it, any ``lock`` file left in the folder is a
dead builder's, so it is removed; then the op is built or loaded from the cache, and the rank
says so while it builds.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the folder (under TORCH_EXTENSIONS_DIR) of each op a CPU rank builds
CPU_OPS = ("deepspeed_shm_comm",)


def ensure_ops(device_kind: str, report: Callable[[dict[str, Any]], None] | None = None) -> float:
    """Build (or load) the ops a rank of ``device_kind`` needs; returns the seconds it took."""
    if device_kind != "cpu":
        return 0.0  # GPU ranks use ops that were built ahead (DS_BUILD_OPS) or none
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    cache.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(cache / "pipette-build.flock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        removed = remove_stale_locks(cache)
        built = all((cache / name / f"{name}.so").exists() for name in CPU_OPS)
        if report is not None and (removed or not built):
            report({"event": "building", "what": "DeepSpeed's CPU communication op", "stale_locks_removed": removed})
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
    return time.monotonic() - start


def remove_stale_locks(cache: Path) -> list[str]:
    """Remove the ``lock`` files of op builds (only call with the folder's flock held: then no
    live builder of ours holds them)."""
    removed = []
    for name in CPU_OPS:
        lock = cache / name / "lock"
        if lock.exists():
            lock.unlink()
            removed.append(str(lock))
    return removed
