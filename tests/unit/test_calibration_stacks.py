"""The loaders of the three stack calibration sets (tests/benchmarks/calibration.py): rows that
Pipette cannot express are skipped and counted, each kept row names its stack and options."""

from __future__ import annotations

import pytest

from pipette.stacks import get_stack
from tests.benchmarks.calibration import STACK_SETS, calibration_dir, load_stack_set

DIRECTORY = calibration_dir()
pytestmark = pytest.mark.skipif(DIRECTORY is None or not all((DIRECTORY / n).exists() for n in STACK_SETS),
                                reason="no calibration data (../shared/data/calibration)")


@pytest.mark.parametrize(("name", "kept", "skipped", "stacks"), [
    ("llmfoundry_h100_fsdp.csv", 77, {}, {"fsdp": 70, "fsdp+fp8": 7}),
    ("torchtitan_h100_fsdp2.csv", 26, {"context parallel (cp>1)": 6},
     {"fsdp": 2, "fsdp+compile": 4, "fsdp+async-tp+compile": 2, "fsdp+compile+fp8": 8,
      "fsdp+async-tp+compile+fp8": 6, "fsdp+compile+fp8-rowwise": 2, "fsdp+async-tp+compile+fp8-rowwise": 2}),
    ("simumax_b200_megatron.csv", 25, {"MoE (DeepSeek, expert parallel)": 12, "context parallel (cp>1)": 7},
     {"megatron": 25}),
])
def test_stack_sets_load_with_their_skips_counted(name: str, kept: int, skipped: dict[str, int],
                                                  stacks: dict[str, int]) -> None:
    assert DIRECTORY is not None
    s = load_stack_set(DIRECTORY, name)
    assert len(s.rows) == kept and dict(s.skipped) == skipped
    counts: dict[str, int] = {}
    for r in s.rows:
        counts[r.stack] = counts.get(r.stack, 0) + 1
        assert get_stack(r.stack).name == STACK_SETS[name]  # every key is a known stack with its options
        assert r.config.global_batch == r.training.global_batch and r.step_time and r.step_time > 0
    assert counts == stacks
