"""A ``Plan`` as the API returns it: ``pipette plan --json``'s object plus every dropped
candidate with its estimate and reason, and (for a job) what the trial backends refuse."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipette.config import ParallelConfig
from pipette.plan import Plan

NOT_RUNNABLE = "not_runnable"


def plan_dict(
    plan: Plan,
    *,
    top: int | None = None,
    planning_seconds: float = 0.0,
    refusals: Callable[[ParallelConfig], list[str]] | None = None,
) -> dict[str, Any]:
    out = plan.to_dict(top=top)
    oom = plan.out_of_memory if top is None else plan.out_of_memory[:top]
    out["out_of_memory"] = [d.to_dict() for d in oom]
    out["planning_seconds"] = planning_seconds
    if refusals is not None:
        refused = 0
        for item, planned in zip(out["ranked"], plan.ranked, strict=False):
            reasons = refusals(planned.config)
            item["runnable"] = not reasons
            item["refusals"] = reasons
            refused += bool(reasons)
        if refused:
            out["dropped"][NOT_RUNNABLE] = {
                "count": refused, "reason": "the trial backends cannot run it (see each candidate's refusals)",
            }
    return out
