"""Start the CPU ranks of one launch (``tests.fsdp.cases.launch``) warm: import the ranks' stack
once, then fork every rank from that process and run ``python -m MODULE ARGS`` in it.

The product's CPU ranks start this way too (``workers.host.zygote``: a warm process per node
forks each rank), and for the same reason: on the 2-core VM a rank imports ~6 CPU-seconds of
torch, transformers and PEFT before its first step, and a 4-rank launch paid it four times.
Each rank is still a process of its own (its own memory, process group, output and exit
status). Only CPU ranks: a GPU rank must not inherit a process that touched CUDA (nothing here
does, but ``launch`` keeps GPU ranks on a fresh interpreter each, as the product does).

    python -m tests.fsdp.forkranks spec.json

``spec.json``: ``{"module", "args", "envs": [one environment per rank], "logs": [one output path
per rank], "codes": path}``; the exit status of every rank (negative: the signal that ended it)
is written to ``codes`` as JSON once all have ended. Run in a session of its own: a kill of its
process group ends the ranks too.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

#: what every rank of tests/fsdp imports (``workers.host.zygote.PRELOAD`` less DeepSpeed, which
#: the PyTorch-native runner does not use); none of it starts a thread, so it forks safely
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "peft",
    "scipy.stats",
    "workers.rank.trial",
    "workers.rank.fsdp_rank",
)


def _rank(module: str, args: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: become ``python -m module args`` with ``env``; never returns."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.environ.clear()
        os.environ.update(env)
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(path: str) -> int:
    spec: dict[str, Any] = json.loads(Path(path).read_text())
    for name in PRELOAD:
        importlib.import_module(name)
    pids = []
    for env, log in zip(spec["envs"], spec["logs"], strict=True):
        pid = os.fork()
        if pid == 0:
            _rank(spec["module"], spec["args"], env, log)
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    Path(spec["codes"]).write_text(json.dumps(codes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
