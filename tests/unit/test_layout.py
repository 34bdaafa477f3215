"""The one layout object (``pipette.layout``): groups partition the ranks, rank <-> coordinates
round-trip in every stack's order, every order is the same rank layout, and cp/ep are validated
once and refused by each stack in one line until their issue flips its rule."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.layout import (
    CANONICAL,
    FLATTENED,
    OPTIONAL_DIMS,
    Layout,
    StackLayout,
    degrees_of,
)
from pipette.stacks import STACKS, rank_layout, stack_layout

#: each stack's rank layout, from its entry in the registry
STACK_LAYOUTS = {name: s.layout for name, s in STACKS.items()}

#: (tp, pp, dp, cp, dp_shard, zero_stage)
SHAPES = [(1, 1, 1, 1, None, 3), (2, 2, 2, 1, None, 3), (2, 1, 4, 1, 2, 3), (1, 3, 4, 1, None, 0),
          (2, 2, 2, 2, None, 3), (1, 2, 4, 2, 2, 2), (4, 1, 2, 3, None, 1)]


def config(tp: int, pp: int, dp: int, cp: int = 1, dp_shard: int | None = None, zero_stage: int = 3,
           ep: int = 1) -> ParallelConfig:
    return ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, dp_shard=dp_shard, zero_stage=zero_stage, mbs=1,
                          global_batch=dp * 4)


def mesh(c: ParallelConfig, rules: StackLayout) -> Layout:
    """The stack's mesh of ``c`` whatever its rules say of cp and ep (as its issue will lay it out)."""
    sizes = degrees_of(c)
    return Layout(tuple((n, sizes[n]) for n in rules.mesh if n not in OPTIONAL_DIMS or sizes[n] > 1), ep=c.ep)


def orders(c: ParallelConfig) -> list[tuple[str, Layout]]:
    out = [("canonical", c.layout)]
    out += [(name, mesh(c, rules)) for name, rules in STACK_LAYOUTS.items() if c.cp == 1 or "cp" in rules.mesh]
    return out


def test_every_stack_has_a_layout_rule() -> None:
    for name, rules in STACK_LAYOUTS.items():
        assert rules.name == name, "a stack's layout is its own"
        assert rules.mesh[0] == "pp" and rules.mesh[-1] == "tp", name
        assert len(rules.axes) == len(rules.mesh) and rules.source
        assert stack_layout(name + "+compile") is rules


@pytest.mark.parametrize("shape", SHAPES)
def test_rank_and_coordinates_round_trip_in_every_order(shape: tuple[int, int, int, int, int | None, int]) -> None:
    c = config(*shape)
    for name, lay in orders(c):
        assert lay.world == c.world == c.tp * c.pp * c.dp * c.cp, name
        for rank in range(lay.world):
            at = lay.coords(rank)
            assert list(at) == list(lay.names) and lay.rank(at) == rank, (name, rank)
        assert [lay.coords(r) for r in range(lay.world)] == [
            dict(zip(lay.names, idx, strict=True)) for idx in itertools.product(*map(range, lay.sizes))
        ]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_order_is_the_same_rank_layout(shape: tuple[int, int, int, int, int | None, int]) -> None:
    c = config(*shape)
    base = c.layout
    for name, lay in orders(c):
        for rank in range(c.world):
            assert [lay.index(rank, d) for d in CANONICAL] == [base.index(rank, d) for d in CANONICAL], name
        for d in CANONICAL:
            assert lay.groups(d) == base.groups(d), (name, d)


def _names(lay: Layout) -> list[tuple[str, ...]]:
    """Every dimension, flattened name (where the mesh has its parts), pair of dimensions, all, none."""
    def known(name: str) -> bool:
        try:
            lay.resolve(name)
        except SpecError:
            return False
        return True

    single = [(n,) for n in (*lay.names, *FLATTENED, "cp", "ep", "edp") if n in ("ep", "edp") or known(n)]
    pairs = [tuple(p) for p in itertools.combinations(lay.names, 2)]
    return single + pairs + [tuple(lay.names), ()]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_groups_of_any_dimension_partition_the_ranks(shape: tuple[int, int, int, int, int | None, int]) -> None:
    c = config(*shape)
    for name, lay in orders(c):
        for dims in _names(lay):
            groups = lay.groups(*dims)
            size = 1
            for d in dims:
                size *= lay.size(d)
            assert sorted(r for g in groups for r in g) == list(range(c.world)), (name, dims)
            assert all(len(g) == size for g in groups), (name, dims)
            if not {"ep", "edp"} & set(dims):  # a group varies only along its dimensions
                others = [n for n in lay.names if n not in {x for d in dims for x in lay.resolve(d)}]
                for g in groups:
                    assert len({tuple(lay.coords(r)[n] for n in others) for r in g}) == 1, (name, dims)


def test_the_groups_are_megatrons_and_the_old_parallel_configs() -> None:
    # Megatron-Core's initialize_model_parallel docstring: 16 GPUs, tp 2, pp 4 (dp 2)
    lay = config(2, 4, 2).layout
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # its cp example: 8 GPUs, tp 4, cp 2 -> cp groups [0, 4], [1, 5], [2, 6], [3, 7]
    assert config(4, 1, 1, cp=2).layout.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_an_absent_optional_dimension_is_zero_and_single_ranks() -> None:
    lay = config(2, 1, 2).layout
    assert "cp" not in lay.names and lay.size("cp") == 1 and lay.index(3, "cp") == 0
    assert lay.groups("cp") == [[0], [1], [2], [3]] and lay.groups("dp_cp") == lay.groups("dp")
    assert lay.rank({"pp": 0, "dp": 1, "cp": 0, "tp": 1}) == 3
    with pytest.raises(SpecError, match="cp"):
        lay.rank({"pp": 0, "dp": 1, "cp": 1, "tp": 1})
    with pytest.raises(SpecError, match="dp_shard"):
        lay.groups("dp_shard")  # a DeepSpeed-order mesh has no shard dimension


def test_hsdp_flattens_to_dp_and_dp_shard_cp_is_torchtitans() -> None:
    c = config(1, 1, 4, cp=2, dp_shard=2)
    lay = mesh(c, STACK_LAYOUTS["fsdp"])
    assert lay.names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and lay.sizes == (1, 2, 2, 2, 1)
    assert lay.size("dp") == 4 and lay.size("dp_shard_cp") == 4 and lay.size("dp_cp") == 8
    assert lay.groups("dp_shard_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [lay.index(r, "dp") for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # zero_stage 0 replicates: the mesh's shard dimension is 1 (FSDP's NO_SHARD)
    assert rank_layout(config(1, 1, 4, zero_stage=0), "fsdp").sizes == (1, 4, 1, 1)


def test_expert_groups_are_carved_out_of_dp_times_cp() -> None:
    c = config(2, 2, 4, cp=2, ep=4)
    lay = c.layout
    assert c.world == 32 and lay.size("ep") == 4 and lay.size("edp") == 2
    for g in lay.groups("ep"):
        at = [lay.coords(r) for r in g]
        assert len({(a["pp"], a["tp"]) for a in at}) == 1  # one stage and tensor rank
        flat = [lay.index(r, "dp_cp") for r in g]
        assert flat == list(range(flat[0], flat[0] + 4)) and flat[0] % 4 == 0  # consecutive, as Megatron's
    assert lay.groups("ep")[0] == [0, 2, 4, 6] and lay.groups("edp")[0] == [0, 8]
    # torchtitan: under HSDP an expert group stays inside one replicate
    h = mesh(config(1, 1, 4, cp=2, dp_shard=2, ep=4), STACK_LAYOUTS["fsdp"])
    assert all(len({h.coords(r)["dp_replicate"] for r in g}) == 1 for g in h.groups("ep"))


def test_degrees_are_validated_once_with_the_fix() -> None:
    for kw, field in (({"cp": 0}, "config.cp"), ({"ep": -1}, "config.ep"), ({"cp": True}, "config.cp"),
                      ({"ep": 3}, "config.ep"), ({"dp_shard": 3}, "config.dp_shard")):
        with pytest.raises(SpecError) as e:
            config(1, 1, 4, **kw)  # type: ignore[arg-type]
        assert e.value.field == field and e.value.fix
    assert config(1, 1, 2, cp=3, ep=6).world == 6  # ep divides dp x cp, not dp alone


@pytest.mark.parametrize("stack", sorted(STACK_LAYOUTS))
def test_every_stack_refuses_cp_and_ep_naming_the_issue_to_come(stack: str) -> None:
    for kw, issue in (({"cp": 2}, "issue 48"), ({"ep": 2}, "issue 47")):
        if getattr(STACK_LAYOUTS[stack], next(iter(kw))):
            continue  # the stack runs it now (issue 48: the fsdp stack's cp)
        c = config(1, 1, 2, **kw)  # type: ignore[arg-type]
        problems = stack_layout(stack).problems(c)
        assert len(problems) == 1 and issue in problems[0][0] and problems[0][1] == f"config.{next(iter(kw))}"
        assert f"the {stack} stack" in problems[0][0]
        with pytest.raises(SpecError, match=issue):
            rank_layout(c, stack)
    assert stack_layout(stack).problems(config(2, 2, 2)) == []


def test_flipping_a_stacks_rule_is_all_it_takes() -> None:
    c = config(2, 1, 2, cp=2, ep=4)
    megatron = replace(STACK_LAYOUTS["megatron"], cp=True, ep=True)
    assert megatron.problems(c) == []
    fsdp = replace(STACK_LAYOUTS["fsdp"], cp=True, ep=True)
    assert fsdp.problems(c) == []
    # torchtitan's own rules: ep a multiple of cp, dividing dp_shard x cp
    odd = config(1, 1, 6, cp=3, ep=2)
    assert any("multiple of cp" in p[0] for p in fsdp.problems(odd))
    assert megatron.problems(odd) == []  # Megatron-Core needs only ep | dp x cp
    with pytest.raises(SpecError, match="no cp dimension"):
        replace(STACK_LAYOUTS["pipette"], cp=True)  # DeepSpeed's topology has no cp axis to put it on
    hsdp = config(1, 1, 4, cp=2, dp_shard=2, ep=8)
    assert any("dp_shard x cp" in p[0] for p in fsdp.problems(hsdp)) and megatron.problems(hsdp) == []


def test_the_fsdp_stack_runs_cp_in_torchtitans_mesh() -> None:
    c = config(1, 1, 2, cp=2)
    assert stack_layout("fsdp").problems(c) == []
    lay = rank_layout(c, "fsdp")
    assert lay.names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and lay.groups("cp") == [[0, 1], [2, 3]]


def test_cp_and_ep_are_written_only_when_set() -> None:
    plain = config(2, 2, 2)
    assert "cp" not in plain.to_dict() and "ep" not in plain.to_dict()
    assert plain.label == "tp2-pp2-dp2-mbs1-z3-rc:none-1f1b"
    wide = config(2, 1, 2, cp=2, ep=4)
    assert wide.to_dict()["cp"] == 2 and wide.to_dict()["ep"] == 4 and wide.world == 8
    assert wide.label == "tp2-pp1-dp2-cp2-ep4-mbs1-z3-rc:none-1f1b"
    assert ParallelConfig.from_dict(wide.to_dict()) == wide and ParallelConfig.from_dict(plain.to_dict()) == plain
