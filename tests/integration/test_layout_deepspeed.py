"""The DeepSpeed runner's pipeline topology is built from the layout object
(``workers.rank.pipe_model.topology`` of ``pipette.stacks.rank_layout(config, "pipette")``): it is
DeepSpeed's own ``PipeModelDataParallelTopology``, group for group and rank for rank."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.stacks import rank_layout
from workers.rank.pipe_model import topology

AXES = {"pipe": "pp", "data": "dp", "model": "tp"}


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 1), (2, 2, 2), (1, 4, 2), (4, 2, 1), (2, 3, 4), (1, 2, 8)])
def test_the_runners_topology_is_deepspeeds(tp: int, pp: int, dp: int) -> None:
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=1, global_batch=dp)
    mesh = rank_layout(config, "pipette")
    ours = topology(mesh)
    theirs = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    assert ours.get_axis_names() == theirs.get_axis_names() == ["pipe", "data", "model"]
    assert ours.world_size() == theirs.world_size() == config.world
    for axis, name in AXES.items():
        groups = theirs.get_axis_comm_lists(axis)
        assert ours.get_axis_comm_lists(axis) == groups
        assert sorted(map(sorted, mesh.groups(name))) == sorted(map(sorted, groups))
    for rank in range(config.world):
        at = theirs.get_coord(rank)
        assert ours.get_coord(rank) == at
        assert {name: getattr(at, axis) for axis, name in AXES.items()} == mesh.coords(rank)


def test_the_runner_refuses_context_parallelism_in_one_line() -> None:
    with pytest.raises(SpecError, match="issue 48"):
        rank_layout(ParallelConfig(tp=1, pp=2, dp=1, cp=2, mbs=1, global_batch=4), "pipette")
