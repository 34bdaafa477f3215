"""A rank layout a stack cannot run is one of the stack's refusals (issue 44): ``Stack.refusals`` reads
its entry's ``Stack.layout.problems``, so the planner drops such a candidate under one code,
``stack_layout``, with the stack's other rules."""

from __future__ import annotations

from collections import Counter

from pipette.config import ParallelConfig
from pipette.plan import DROP_REASONS, _runnable
from pipette.space import Space
from pipette.stacks import STACKS, get_stack, stack_layout

CP2 = ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=8, cp=2)
#: ep 2 beside cp 4: Megatron-Core carves it out of dp x cp; torchtitan wants whole cp groups (ep % cp)
EP_IN_CP = ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=8, cp=4, ep=2, zero_stage=3)


def test_a_degree_the_stacks_layout_does_not_run_is_refused() -> None:
    assert get_stack("pipette").refusals(CP2) == ["stack_layout"]  # its DeepSpeed runner has no cp
    assert get_stack("nanotron").refusals(CP2) == ["stack_layout"]
    assert "stack_layout" not in get_stack("fsdp").refusals(CP2)
    assert "stack_layout" in get_stack("fsdp").refusals(EP_IN_CP)
    assert "stack_layout" not in get_stack("megatron").refusals(EP_IN_CP)


def test_the_refusal_is_the_layouts_own_rule_on_every_stack() -> None:
    dense = ParallelConfig(tp=2, pp=1, dp=2, mbs=1, global_batch=8)
    for name in STACKS:
        assert stack_layout(name) is STACKS[name].layout
        for config in (dense, CP2, EP_IN_CP):
            refused = "stack_layout" in get_stack(name).refusals(config)
            assert refused == bool(stack_layout(name).problems(config)), (name, config.label)


def test_the_planner_counts_it_under_its_code() -> None:
    kept = Space([CP2, ParallelConfig(tp=1, pp=1, dp=4, mbs=1, global_batch=8)], Counter())
    runnable = _runnable(kept, get_stack("pipette"))
    assert [c.cp for c in runnable.candidates] == [1]
    assert runnable.rejected == Counter({"stack_layout": 1})
    assert "cannot lay out the ranks" in DROP_REASONS["stack_layout"]
