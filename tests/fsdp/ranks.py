"""One rank of a batch of PyTorch-native trials (``tests.fsdp.cases.run_batch``): the product's
rank program (``workers.rank.fsdp_rank.train``) for each case in turn, on one process group.

    python -m tests.fsdp.ranks cases.json

Each case's events carry its name (``case``); a ``case`` event after each says how long the
case took on this rank. A case that raises ends the process (its peers would wait on it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def main() -> int:
    import torch.distributed as dist

    from workers.fsdp_spec import plan_for
    from workers.phases import Phases
    from workers.rank.devices import init_distributed
    from workers.rank.fsdp_rank import train
    from workers.rank.store import rendezvous_store
    from workers.rank.trial import emit
    from workers.spec import TrialSpec

    cases = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trials = [TrialSpec.from_candidate(c["candidate"]) for c in cases]
    store = rendezvous_store(world, is_master=rank == 0, timeout=timedelta(seconds=120))
    offload = any(t.config.offload for t in trials)
    timeout = timedelta(seconds=120)
    init_distributed(trials[0].device_kind, rank, world, store, timeout=timeout, host_collectives=offload)
    for case, trial in zip(cases, trials, strict=True):
        plan = plan_for(trial.model, trial.training, trial.config, trial.device_kind, world)
        plan = dataclasses.replace(plan, **case["extra"])
        name = case["name"]

        def report(event: dict[str, Any], name: str = name) -> None:
            emit({**event, "case": name})

        start = time.perf_counter()
        try:
            train(trial, plan, rank, report, phases=Phases())
        except Exception:
            print(f"case {name} failed on rank {rank}:\n{traceback.format_exc()}", flush=True)
            return 1
        dist.barrier()
        emit({"event": "case", "case": name, "rank": rank, "seconds": time.perf_counter() - start})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
