"""The entry of a PyTorch-native trial's rank (``workers.rank.fsdp_rank``): FSDP2, tensor and
pipeline parallelism on a ``DeviceMesh``, as torchtitan composes them.

    python -m workers.rank.fsdp --candidate candidate.json [--rank_map rank_map.json]

``candidate.json`` is what ``TrialSpec.candidate()`` writes (the fsdp options in its ``config``:
``dp_shard``, ``offload``); ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``LOCAL_RANK`` say where the rank is, as for ``workers.rank.train``. A candidate the runner cannot
split the model by ends before the rendezvous, with one line on stderr and status 2.

Only the standard library is imported before ``main`` runs, so the rank's phases (``start``,
``imports``: ``workers.phases``) time the interpreter and torch apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from workers.phases import PHASES


def read_candidate(path: str) -> Any:
    """The ``TrialSpec`` of ``candidate.json``; an emitted one without runner options runs on this
    machine's devices (a GPU where CUDA is, else the host)."""
    import torch

    from workers.spec import TrialSpec

    candidate = json.loads(Path(path).read_text())
    options = candidate["trial"] = dict(candidate.get("trial") or {})
    options.setdefault("device_kind", "gpu" if torch.cuda.is_available() else "cpu")
    return TrialSpec.from_candidate(candidate)


def main(argv: list[str] | None = None) -> int:
    from pipette.contract import RANK_ENV
    from workers.rank.train import own_session

    own_session()  # as the DeepSpeed runner's entry: a launcher's ranks get their own share of the CPU
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    parser = argparse.ArgumentParser(prog="workers.rank.fsdp")
    parser.add_argument("--candidate", required=True)
    parser.add_argument("--rank_map", default=os.environ.get("PIPETTE_RANK_MAP"),
                        help="rank_map.json: renumber this process to its rank in the candidate's placement")
    args = parser.parse_args(argv)
    from workers.fsdp_spec import plan_for
    from workers.rank.fsdp_rank import run_rank
    from workers.rank.train import join

    PHASES.mark("imports")
    trial = read_candidate(args.candidate)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan_for(trial.model, trial.training, trial.config, trial.device_kind, world)  # refused before the rendezvous
    rank, world, store = join(args.rank_map, trial.device_kind)
    code: int = run_rank(trial, rank, world, store)
    return code


def _exit(code: int) -> None:
    # as workers.rank.train: leave without destructors (gloo's threads can abort the interpreter at teardown)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    PHASES.begin()
    PHASES.mark("start")
    from pipette.errors import PipetteError

    try:
        _exit(main())
    except PipetteError as e:
        print(f"pipette: {e}", file=sys.stderr)
        _exit(2)
