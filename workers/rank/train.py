"""The entry point every rank runs, for a trial and for a launch Pipette emitted.

    python -m deepspeed.launcher.runner --hostfile hostfile --include ... \\
        --module workers.rank.train --deepspeed_config ds_config.json --candidate candidate.json \\
        --rank_map rank_map.json

Launchers number processes node by node; the rank map (``--rank_map``, or
``PIPETTE_RANK_MAP``; ``pipette.emit.rank_map``) renumbers each one to the rank its (node,
local device) has in the candidate's placement, so any placement runs as planned. The
rendezvous store stays with the launcher's rank 0, at ``MASTER_ADDR``. The Ray executor
runs this same command with ``RANK`` already the candidate's rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from pipette.contract import RANK_ENV, build_environment
from pipette.errors import PipetteError, SpecError


def pipette_rank(launcher_rank: int, rank_map: list[dict[str, Any]]) -> int:
    """The candidate's rank of this process, from the launcher's node order and local rank."""
    nodes = sorted({int(e["node"]) for e in rank_map})
    node = nodes[int(os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", "0")))]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    here = [e for e in rank_map if int(e["node"]) == node]
    if visible:
        device = int(visible.split(",")[local_rank])
        match = [e for e in here if int(e["local_device"]) == device]
    else:
        match = sorted(here, key=lambda e: int(e["rank"]))[local_rank : local_rank + 1]
    if len(match) != 1:
        raise SpecError(
            f"process {launcher_rank} (node {node}, local rank {local_rank}) is not in the rank map",
            field="--rank_map", fix="launch with the hostfile and --include Pipette wrote",
        )
    return int(match[0]["rank"])


def own_session() -> bool:
    """Make this rank a session of its own, as a trial's rank is (the executor starts each in
    one); returns whether it moved.

    Linux's scheduler shares the CPU fairly between sessions first (autogroup), then between
    the processes of a session. A launcher starts its ranks in its own session: on a machine
    with any other busy session, its 4 ranks shared one session's part of the CPU where the
    trial's 4 ranks had four parts, and ``launch.sh`` ran 1.5-1.9x slower per step than the
    trial that picked it (issue 32, item 5). Moved, the rank dies with its launcher (a
    terminal's hang-up no longer reaches it)."""
    if os.getsid(0) == os.getpid():
        return False
    try:
        os.setsid()
    except OSError:
        return False  # a process-group leader cannot; it keeps its launcher's session
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher died before the line above
        os._exit(1)
    return True


def main(argv: list[str] | None = None) -> int:
    own_session()
    os.environ.update(build_environment())
    # What a trial's rank runs with (pipette.contract.RANK_ENV), on a node the launcher reached
    # over ssh too, where launch.sh's exports do not arrive; before torch is imported.
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    parser = argparse.ArgumentParser(prog="workers.rank.train")
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--candidate", required=True)
    parser.add_argument("--rank_map", default=os.environ.get("PIPETTE_RANK_MAP"),
                        help="rank_map.json: renumber this process to its rank in the candidate's placement")
    parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = parser.parse_args(argv)

    from workers.phases import PHASES

    PHASES.begin()
    PHASES.mark("start")
    import deepspeed  # noqa: F401  # what a rank imports, timed as one phase
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from workers.rank.trial import run_rank
    from workers.spec import TrialSpec

    PHASES.mark("imports")

    candidate = json.loads(Path(args.candidate).read_text())
    options = candidate["trial"] = dict(candidate.get("trial") or {})
    if "device_kind" not in options:  # an emitted candidate.json: the devices are this machine's
        import torch

        options["device_kind"] = "gpu" if torch.cuda.is_available() else "cpu"
    trial = TrialSpec.from_candidate(candidate)
    ds_config = json.loads(Path(args.deepspeed_config).read_text())
    rank, world, store = join(args.rank_map, trial.device_kind)
    return run_rank(trial, ds_config, rank, world, store)


def join(rank_map: str | None, device_kind: str) -> tuple[int, int, Any]:
    """This process's rank (renumbered by ``rank_map.json`` when given: a launcher numbers its
    processes its own way), the world size, and the rendezvous store; says which it is (``rank``)."""
    from workers.rank.store import rendezvous_store
    from workers.rank.trial import emit

    launcher_rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = launcher_rank
    if rank_map:
        rank = pipette_rank(launcher_rank, json.loads(Path(rank_map).read_text()))
        os.environ["RANK"] = str(rank)
    emit({"event": "rank", "rank": rank, "launcher_rank": launcher_rank, "local_rank": os.environ.get("LOCAL_RANK"),
          "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "device_kind": device_kind,
          "master_port": os.environ.get("MASTER_PORT")})
    store = rendezvous_store(world, is_master=launcher_rank == 0, timeout=timedelta(seconds=120))
    return rank, world, store


def _exit(code: int) -> None:
    # Leave without running destructors: DeepSpeed's and gloo's threads can abort the
    # interpreter at teardown ("terminate called without an active exception") after a
    # trial that finished fine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        _exit(main())
    except PipetteError as e:
        print(f"pipette: {e}", file=sys.stderr)
        _exit(2)
