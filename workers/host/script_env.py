"""The environment a user's training script runs in: what a training process needs, and none
of the credentials of the process that starts it.

A script trial is the user's code. In the service, the Ray workers that start its ranks carry
the service's own settings (database URL, API and metrics tokens, ...): the script must see
none of them. So a script's environment is built from an allow-list (the shell basics, the
compute stack's own variables), minus anything that names a secret, plus what the trial sets.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

#: Variables a training process needs, passed as they are.
ALLOWED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "SHELL",
    "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHASHSEED", "XDG_CACHE_HOME", "CUDA_HOME",
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
})
#: Prefixes of the compute stack's variables (CUDA, NCCL, OpenMP, torch, DeepSpeed, Hugging Face, ...).
ALLOWED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "DS_", "HF_",
                    "TRANSFORMERS_", "ACCELERATE_", "GLOO_", "NVIDIA_", "MALLOC_", "UCX_", "FI_", "TOKENIZERS_")
#: Names that hold a secret whatever their prefix: never passed on.
SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|(^|_)KEY($|_)|DATABASE|DSN|AUTH", re.IGNORECASE)


def script_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` a script may see."""
    return {
        k: v for k, v in environ.items()
        if (k in ALLOWED or k.startswith(ALLOWED_PREFIXES)) and not SECRET.search(k)
    }


def script_path(path: str) -> str:
    """``PATH`` with this interpreter's ``bin`` first, so ``python`` in a script's command is the
    Python Pipette runs in (the one with DeepSpeed), as in an activated environment."""
    bindir = str(Path(sys.executable).parent)
    parts = [p for p in path.split(os.pathsep) if p and p != bindir]
    return os.pathsep.join([bindir, *parts])


#: The folder whose ``sitecustomize`` times a DeepSpeed script that does not report
#: (``workers/rank/script_hook``); put first on a script's ``PYTHONPATH``.
HOOK_DIR = str(Path(__file__).resolve().parents[1] / "rank" / "script_hook")


def with_hook(pythonpath: str | None) -> str:
    parts = [p for p in (pythonpath or "").split(os.pathsep) if p and p != HOOK_DIR]
    return os.pathsep.join([HOOK_DIR, *parts])
