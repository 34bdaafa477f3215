"""Trial records for the tests of the trial stores (``tests/unit/test_trial_records.py``,
``tests/service/test_trial_store.py``)."""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipette.clusterfile import load_cluster
from pipette.measurement import Measurement
from pipette.model import ModelSpec
from pipette.plan import Plan, make_plan
from pipette.training import TrainingSpec
from pipette.trials import TrialRecord

ROOT = Path(__file__).resolve().parents[1]
#: lines written by ``pipette tune`` as it was on each date: ``TrialRecord(...).to_dict()`` of
#: the same two attempts (one ok, one failed) by a ``git archive`` of that day's commit
#: (2026-11-21: ab40535, the first; 2026-11-26: fb6bdbe^, before stacks; 2026-11-27: 5405712,
#: before the records kept their times)
FIXTURES = ROOT / "tests" / "unit" / "fixtures" / "trials"


@functools.cache
def a_plan() -> Plan:
    """tiny-llama on the 4-CPU cluster file, planned once."""
    cluster = load_cluster(ROOT / "examples" / "clusters" / "cpu-4.yaml")
    return make_plan(ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=8, seq_len=64, dtype="fp32"), cluster)


def a_record(number: int = 0, **changes: Any) -> TrialRecord:
    """A record as the tuner makes it: every field set, the workers' extras included."""
    training = a_plan().training
    planned = a_plan().ranked[number % 3]
    m = Measurement("ok", (0.31, 0.30, 0.32), training.tokens_per_step, (2**27, 2**28), (6.2, 6.1, 6.0), extra={
        "wall_s": 21.5, "backend": "deepspeed+zero1", "phases": {"imports": 3.25, "steps": 1.5},
        "peak_rss_bytes": [501_000_000, 498_000_000], "peak_reserved_bytes": [2**28, 2**28 + 4096],
        "outside_allocator_bytes": [2**20, 2**21], "output_tail": "step 3 done", "devices": ["cpu:0", "cpu:1"]})
    fields: dict[str, Any] = {
        "measurement": m, "predicted_sd": 0.2, "attempt": 1, "job_key": "0123456789abcdef", "purpose": "search",
        "stack": "pipette", "started_at": datetime(2026, 11, 28, 9, 0, 1, 250000, tzinfo=UTC),
        "ended_at": datetime(2026, 11, 28, 9, 0, 23, 750000, tzinfo=UTC), **changes}
    return TrialRecord(number=number, config=planned.config, perf=planned.perf, memory=planned.memory,
                       predicted_step_time=0.29, **fields)
