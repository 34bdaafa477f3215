"""How a trial ended and what it measured, from its ranks' event lines: shared by the Ray
executor (``workers.host.executor``) and the local one (``workers.host.local``), through
``workers.host.kinds``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipette import flops
from pipette.measurement import Measurement, Status
from workers.spec import TrialSpec


@dataclass
class Outcome:
    status: Status
    error: str = ""
    #: the addresses of the Ray nodes lost during the trial (the failure is the cluster's, not
    #: the candidate's: the runner waits for them before the next attempt)
    lost: tuple[str, ...] = ()
    #: the phase the ranks were in when it timed out or failed (``workers.phases``; the one
    #: furthest behind), None where they said none
    phase: str | None = None


def measurement(
    trial: TrialSpec,
    outcome: Outcome,
    steps: list[dict[str, Any]],
    done: dict[int, dict[str, Any]],
    ooms: list[dict[str, Any]],
    wall: float,
) -> Measurement:
    extra: dict[str, Any] = {"wall_s": wall, "backend": None}
    if outcome.status == "ok":
        ranks = [done[r] for r in sorted(done)]
        # A step ends when its slowest rank does.
        step_times = tuple(max(ts) for ts in zip(*(d["step_times"] for d in ranks), strict=True))
        losses = tuple(float(x) for x in ranks[0]["losses"])
        extra |= {
            "backend": ranks[0]["backend"],
            "devices": [d.get("device") for d in ranks],
            "peak_rss_bytes": [int(d["peak_rss_bytes"]) for d in ranks],
            "trainable_params": int(ranks[0]["trainable_params"]),
            "warmup_steps": trial.warmup_steps,
        }
        if "phases" in ranks[0]:  # rank 0's wall time by phase (workers.phases)
            extra["phases"] = {k: round(float(v), 3) for k, v in ranks[0]["phases"].items()}
        extra |= allocator_extra(ranks)
        # Model FLOPs as the planner counts them (pipette.flops); hardware FLOPs add recomputation.
        counted = flops.per_step(trial.model, trial.training, trial.config.recompute)
        extra |= {"model_flops_per_step": counted.model, "hardware_flops_per_step": counted.hardware}
        if step_times:
            import statistics

            seconds = statistics.median(step_times) * trial.config.world
            extra["achieved_flops_per_device"] = counted.model / seconds
            if trial.peak_flops:
                extra["mfu"] = counted.model / seconds / trial.peak_flops
                extra["hfu"] = counted.hardware / seconds / trial.peak_flops
        return Measurement(
            "ok", step_times=step_times, tokens_per_step=trial.tokens_per_step,
            peak_memory=tuple(int(d["peak_tensor_bytes"]) for d in ranks), losses=losses, extra=extra,
        )
    if outcome.phase is not None:
        extra["phase"] = outcome.phase
    timed = tuple(float(s["time"]) for s in steps if not s["warmup"])
    losses = tuple(float(s["loss"]) for s in steps)
    error = outcome.error
    if outcome.status == "oom":
        first = min(ooms, key=lambda e: int(e["rank"]))
        where, phase = first.get("where", "device"), first.get("phase")
        extra |= {"oom_rank": int(first["rank"]), "oom_bytes": int(first["bytes"]), "oom_where": where,
                  "oom_phase": phase, **allocator_extra([first])}
        during = f" during {phase}" if phase else ""
        error = (f"rank {first['rank']} ran out of {where} memory{during} asking for {first['bytes']} bytes: "
                 f"{first['error']}")
    return Measurement(
        outcome.status, step_times=timed, tokens_per_step=trial.tokens_per_step, losses=losses, error=error,
        extra=extra, lost_nodes=outcome.lost,
    )


ALLOCATOR_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_inactive_split_bytes", "alloc_retries",
                    "allocator_ooms", "outside_allocator_bytes")


def allocator_extra(events: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The GPU allocator's figures (``workers.rank.memory.allocator_record``), one list per field
    with an entry per rank, for the fields every rank reported."""
    return {k: [int(e[k]) for e in events] for k in ALLOCATOR_FIELDS if events and all(k in e for e in events)}
