"""The layout of one candidate's ranks: its named mesh, rank <-> coordinates, the groups of any
dimension, and each stack's rules for its degrees. The planner (``pipette.comm``, ``pipette.emit``),
the runners (DeepSpeed's pipeline topology, the FSDP2 device mesh) and the emitters all read it.

In the spirit of torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``): the
degrees are validated once (``check_degrees``, from ``ParallelConfig``), and a ``Layout`` is a named
mesh, outermost dimension first, row-major: the last dimension varies fastest.

Degrees:

* ``tp``, ``pp``, ``dp`` as ever; ``world = tp * pp * dp * cp``.
* ``cp`` (context parallelism) adds ranks: each of its ranks holds a slice of every sequence, so it
  multiplies the world as Megatron-Core's ``initialize_model_parallel`` does
  (``megatron/core/parallel_state.py``: ``model_size = tp * pp * cp``, ``dp = world // model_size``)
  and torchtitan's ``ParallelDims._validate`` (``dp_replicate * dp_shard * cp * tp * pp == world``).
  Its mesh dimension sits between the data- and the tensor-parallel ones in both (Megatron-Core's
  default order ``tp-cp-ep-dp-pp``, fastest first; torchtitan's ``pp, dp_replicate, dp_shard, cp, tp``).
* ``ep`` (expert parallelism) adds none: its groups are carved out of the ``dp * cp`` ranks of a
  stage and tensor rank. Megatron-Core builds a second ``RankGenerator`` for the experts
  (``tp=expert_tensor_parallel_size, ep, dp=world // (etp * ep * pp)``, same order), so with
  ``etp = tp`` an expert group is ``ep`` consecutive ranks of the flattened ``(dp, cp)`` block and
  ``dp * cp`` must be a multiple of ``ep``; torchtitan's ``ParallelDims`` "borrows all cp and some
  dp_shard degree" (``ep % cp == 0 and (dp_shard * cp) % ep == 0``). The expert mesh is therefore this
  mesh with its data block re-split as ``(edp, ep)``: ``groups("ep")``, ``groups("edp")``.

A dimension of ``OPTIONAL_DIMS`` is in a mesh only at a degree above 1, as ``ParallelConfig.to_dict``
writes ``cp`` and ``ep`` only when not 1: every mesh of a candidate without them (the runners' device
meshes and process groups, the rank maps) is what it was before they existed. Its coordinate is then
0 and its groups single ranks.

A ``StackLayout`` holds one stack's mesh order and rules; the stack's entry in the registry carries it
(``pipette.stacks.Stack.layout``), so adding a stack is one entry. A stack that does not run ``cp > 1``
or ``ep > 1`` refuses them in one line naming the issue that brings them; that issue flips the stack's
``cp`` or ``ep`` here (and adds its own rule, such as ``ep_whole_cp``). Context
parallelism (issue 48): ``fsdp`` and ``megatron`` run it as a ring, ``hf-deepspeed`` as Ulysses
(``StackLayout.cp_kind``; each stack's rule in ``cp_problems``, cited); ``pipette`` (Pipette's
DeepSpeed runner) and ``nanotron`` refuse it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pipette.errors import SpecError

IntArray = npt.NDArray[np.int64]


class Degrees(Protocol):
    """What a layout reads of a candidate (``pipette.config.ParallelConfig``, which builds on this
    module and so is not imported here)."""

    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def dp_shard(self) -> int | None: ...
    @property
    def zero_stage(self) -> int: ...

#: dimensions a mesh has only at a degree above 1 (their coordinate is 0 otherwise)
OPTIONAL_DIMS: tuple[str, ...] = ("cp",)
#: flattened dimensions by name, each its parts outermost first (torchtitan's ``_flatten`` names: ``dp``
#: for data loading, ``dp_cp`` for the loss, ``dp_shard_cp`` for FSDP's sharding)
FLATTENED: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}
#: the data block of a mesh, which expert parallelism re-splits as (edp, ep)
DATA_DIMS: tuple[str, ...] = ("dp", "dp_replicate", "dp_shard", "cp")
EXPERT_DIMS: tuple[str, ...] = ("edp", "ep")
#: the issue that brings each degree no stack runs yet
COMING: dict[str, str] = {"cp": "context parallelism (issue 48)", "ep": "expert parallelism (issue 47)"}


@dataclass(frozen=True)
class StackLayout:
    """How one stack lays out a candidate's ranks, and which degrees it runs."""

    #: the stack's name (``pipette.stacks.Stack.name``)
    name: str
    #: its mesh dimensions, outermost first
    mesh: tuple[str, ...]
    #: the stack's own name for each of them (DeepSpeed's topology axes, Megatron's group names)
    axes: tuple[str, ...]
    #: where the order is taken from
    source: str
    #: runs context parallelism (cp > 1)
    cp: bool = False
    #: runs expert parallelism (ep > 1)
    ep: bool = False
    #: the dimensions an expert group is carved from (their product must be a multiple of ep)
    ep_within: tuple[str, ...] = ("dp", "cp")
    #: an expert group holds whole context-parallel groups (torchtitan: ``ep % cp == 0``)
    ep_whole_cp: bool = False
    #: how its cp ranks attend over the whole sequence: ``ring`` (KV blocks passed around the cp
    #: group, the sequence in ``2 cp`` load-balanced chunks) or ``ulysses`` (all-to-alls that trade
    #: the sequence split for a head split: the degree is bounded by the heads)
    cp_kind: str = "ring"
    #: where its cp rules are taken from
    cp_source: str = ""
    #: the token dispatchers it runs beside the all-to-all (``pipette.routing.DISPATCHERS``)
    dispatchers: tuple[str, ...] = ()
    #: runs capacity-factor routing (tokens dropped past an expert's capacity) beside dropless
    capacity: bool = False
    #: expert parallelism beside tensor parallelism only without a pipeline (DeepSpeed's AutoEP + AutoTP
    #: folding: "AutoEP+AutoTP folding currently supports pp_size=1 only")
    ep_tp_needs_pp1: bool = False
    #: expert parallelism combines with context parallelism (cp > 1)
    ep_with_cp: bool = True

    def __post_init__(self) -> None:
        if self.cp and "cp" not in self.mesh:
            raise SpecError(f"{self.name} runs cp but its mesh {list(self.mesh)} has no cp dimension",
                            field="stack", fix="add cp to the stack's mesh where its framework puts it")

    def axes_of(self, layout: Layout) -> list[str]:
        """The stack's own names of ``layout``'s dimensions, outermost first."""
        own = dict(zip(self.mesh, self.axes, strict=True))
        return [own[n] for n in layout.names]

    def problems(self, config: Degrees) -> list[tuple[str, str, str]]:
        """Every (message, field, fix) that stops this stack from laying out ``config``."""
        out = []
        for degree, runs in (("cp", self.cp), ("ep", self.ep)):
            value = getattr(config, degree)
            if value > 1 and not runs:
                out.append((f"{degree}={value}: the {self.name} stack does not run {COMING[degree]} yet",
                            f"config.{degree}", f"use {degree}=1"))
        if config.ep > 1 and self.ep:
            sizes = degrees_of(config)
            room = math.prod(sizes[d] for d in self.ep_within)
            if room % config.ep:
                out.append((f"ep={config.ep} does not divide {' x '.join(self.ep_within)} = {room}", "config.ep",
                            f"use an ep that divides {room}"))
            if self.ep_whole_cp and config.ep % config.cp:
                out.append((f"ep={config.ep} is not a multiple of cp={config.cp} (an expert group holds whole "
                            "context-parallel groups)", "config.ep", f"use a multiple of {config.cp}"))
            if self.ep_tp_needs_pp1 and config.tp > 1 and config.pp > 1:
                out.append((f"ep={config.ep} with tp={config.tp} runs without a pipeline only (pp={config.pp})",
                            "config.pp", "use pp=1, or tp=1"))
            if not self.ep_with_cp and config.cp > 1:
                out.append((f"ep={config.ep} with cp={config.cp}: the {self.name} stack's expert parallelism is "
                            "not planned beside its sequence parallelism", "config.cp", "use cp=1 or ep=1"))
        return out

    def cp_problems(self, cp: int, tp: int, seq_len: int, heads: int, kv_heads: int) -> list[tuple[str, str, str]]:
        """Every (message, field, fix) by which this stack's context parallelism cannot split a
        sequence of ``seq_len`` tokens of a model with ``heads`` (``kv_heads``) attention heads over
        ``cp`` ranks beside ``tp``. Ring: ``2 cp`` equal chunks, each cut by tp under sequence
        parallelism (Megatron-Core's ``get_batch_on_this_cp_rank``, megatron/core/utils.py, reshapes
        the sequence into ``2 * cp`` chunks, and its sequence parallelism scatters a cp rank's part
        over tp; torchtitan's ``ParallelDims.seq_len_divisor`` = ``tp * cp * 2``). Ulysses: the
        sequence split by cp and the heads of a tp rank by cp too, query and key/value heads alike
        (DeepSpeed's ``DistributedAttention``, deepspeed/sequence/layer.py: its all-to-all scatters
        the head dimension over the sequence-parallel group)."""
        if cp == 1 or not self.cp:
            return []
        if self.cp_kind == "ulysses":
            out = []
            if seq_len % cp:
                out.append((f"seq_len {seq_len} is not divisible by cp={cp} (Ulysses splits the sequence)",
                            "training.seq_len", f"use a multiple of {cp}"))
            for what, n in (("attention", heads), ("key/value", kv_heads)):
                if n % (tp * cp):
                    out.append((f"cp={cp} x tp={tp} does not divide the {n} {what} heads (Ulysses' all-to-all "
                                "splits the heads)", "config.cp", f"use a cp that divides {n // math.gcd(n, tp)}"))
            return out
        divisor = 2 * cp * tp
        if seq_len % divisor:
            return [(f"seq_len {seq_len} is not divisible by 2 x cp x tp = {divisor} (ring attention's 2 cp chunks, "
                     "each cut by tp)", "training.seq_len", f"use a multiple of {divisor}, or a smaller cp")]
        return []


_DEEPSPEED = ("DeepSpeed's PipeModelDataParallelTopology (deepspeed/runtime/pipe/topology.py): axes pipe, data, "
              "model, model fastest")
# Each stack's mesh order and rules, held by its entry in the one registry of stacks (``Stack.layout``,
# ``pipette.stacks.STACKS``). Every order is pp outermost and tp fastest, with the data dimensions (and cp)
# between: one rank layout for all, so a placement, the planner's groups and every runner agree
# (tests/unit/test_layout.py checks it).
#: DeepSpeed's expert parallelism for Hugging Face MoE models, AutoEP (deepspeed/module_inject/auto_ep*.py,
#: DeepSpeed 0.19; ds_config ``expert_parallel: {enabled, autoep_size}``): per pipeline stage the ranks in
#: blocks of ``autoep_size`` consecutive ranks (tp fastest, then dp: ``expected_folding_group_tables``) form
#: the expert groups, the same position of each block the expert data-parallel ones, so ep divides tp x dp
#: (``build_folding_spec``; planned within dp, every candidate's rule: ``check_degrees``); with AutoTP only
#: at pp 1 (``validate_folding_global``); the experts untouched by tp (``expert_tensor_parallel_size`` 1:
#: "not supported yet"); dropless (its router is torchtitan's).
_AUTOEP: dict[str, Any] = {"ep": True, "ep_within": ("dp",), "ep_tp_needs_pp1": True, "ep_with_cp": False}
# Pipette's DeepSpeed runner builds no sequence-parallel attention: cp stays refused until it does
PIPETTE_LAYOUT = StackLayout("pipette", mesh=("pp", "dp", "tp"), axes=("pipe", "data", "model"), source=_DEEPSPEED,
                             **_AUTOEP)
HF_DEEPSPEED_LAYOUT = StackLayout(
    "hf-deepspeed", mesh=("pp", "dp", "cp", "tp"), axes=("pipe", "data", "sequence", "model"), source=_DEEPSPEED,
    cp=True, cp_kind="ulysses", **_AUTOEP,
    cp_source="DeepSpeed Ulysses (deepspeed/sequence/layer.py DistributedAttention; Arctic Long Sequence "
              "Training's UlyssesSPAttentionHF for Hugging Face models, Accelerate's ParallelismConfig sp_size): "
              "sequence-parallel ranks inside the data-parallel ones, ZeRO partitioned over both; planned, not "
              "run by Pipette")
MEGATRON_LAYOUT = StackLayout(
    "megatron", mesh=("pp", "dp", "cp", "tp"), axes=("pp", "dp", "cp", "tp"),
    source="Megatron-Core's initialize_model_parallel (megatron/core/parallel_state.py), order tp-cp-ep-dp-pp; "
           "the experts' RankGenerator re-splits dp x cp as (expert dp, ep): ep divides dp x cp "
           "(--expert-model-parallel-size; pipette.space_moe)",
    cp=True, cp_kind="ring", ep=True, dispatchers=("flex",), capacity=True,
    cp_source="--context-parallel-size (Megatron-Core; Transformer Engine's attention with cp_comm_type p2p: "
              "KV blocks around the ring, 2 cp load-balanced chunks); gradients reduced and the distributed "
              "optimizer sharded over dp x cp (data_parallel_group with_context_parallel); with tp's sequence "
              "parallelism a cp rank's chunk is cut by tp. Planned and emitted, not run by Pipette")
NANOTRON_LAYOUT = StackLayout(
    "nanotron", mesh=("pp", "dp", "cp", "tp"), axes=("pp", "dp", "cp", "tp"),
    source="nanotron's ParallelContext (src/nanotron/parallel/context.py) without MoE: ranks reshaped "
           "(ep, pp, dp, cp, tp); its MoE path orders (dp, pp, cp, tp) instead, for issue 47 to take up")
FSDP_LAYOUT = StackLayout(
    "fsdp", mesh=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    axes=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    source="torchtitan's ParallelDims (torchtitan/distributed/parallel_dims.py): pp, dp_replicate, dp_shard, "
           "cp, tp; its context parallelism is ring attention over cp (context_parallel_degree, "
           "torchtitan/distributed/context_parallel.py), run by workers.rank.context_parallel; its expert "
           "parallelism borrows all cp and some dp_shard (ParallelDims._validate: ep % cp == 0 and "
           "(dp_shard * cp) % ep == 0), run by workers.rank.expert_parallel",
    cp=True, ep=True, ep_within=("dp_shard", "cp"), ep_whole_cp=True, cp_kind="ring",
    cp_source="torchtitan's context_parallel_degree (torch.distributed.tensor.experimental.context_parallel, "
              "rotate method allgather by default); FSDP shards over dp_shard x cp (the dp_shard_cp mesh)")
#: the mesh of a candidate of no particular stack: Megatron-Core's order, every other one's flattening
CANONICAL: tuple[str, ...] = ("pp", "dp", "cp", "tp")


def check_degrees(tp: int, pp: int, dp: int, cp: int, ep: int, dp_shard: int | None) -> None:
    """Validate the degrees of a candidate once (``ParallelConfig.__post_init__``): ``SpecError``
    naming the field and the fix."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"must be a positive integer, got {value!r}", field=f"config.{name}",
                            fix="give a whole number of at least 1")
    if dp_shard is not None and (
        not isinstance(dp_shard, int) or isinstance(dp_shard, bool) or dp_shard < 1 or dp % dp_shard
    ):
        raise SpecError(f"is {dp_shard!r}, not a divisor of dp={dp}", field="config.dp_shard",
                        fix="give a shard degree that divides dp (HSDP: dp // dp_shard replicas), or leave it out")
    if (dp * cp) % ep:
        raise SpecError(f"ep={ep} does not divide dp x cp = {dp * cp}: expert groups are carved out of the "
                        "data- and context-parallel ranks", field="config.ep",
                        fix=f"use an ep that divides {dp * cp}")


def degrees_of(config: Degrees) -> dict[str, int]:
    """The size of every mesh dimension a stack may name for ``config``. ``dp_shard`` is the ranks the
    model states are sharded over: 1 under zero_stage 0 (replicated: FSDP's NO_SHARD, DDP), the HSDP
    shard degree where set, else all of dp; ``dp_replicate`` the replicas of those shards."""
    c = config
    shard = 1 if c.zero_stage == 0 else (c.dp if c.dp_shard is None else c.dp_shard)
    return {"pp": c.pp, "dp": c.dp, "cp": c.cp, "tp": c.tp, "dp_shard": shard, "dp_replicate": c.dp // shard}


def layout_of(config: Degrees, rules: StackLayout | None = None) -> Layout:
    """The mesh of ``config`` in the order of a stack's ``rules`` (None: ``CANONICAL``; by a stack's name:
    ``pipette.stacks.rank_layout``); a stack that does not run its degrees refuses it in one line
    (``SpecError``)."""
    if rules is None:
        order = CANONICAL
    else:
        problems = rules.problems(config)
        if problems:
            message, field, fix = problems[0]
            raise SpecError(message, field=field, fix=fix)
        order = rules.mesh
    sizes = degrees_of(config)
    dims = tuple((n, sizes[n]) for n in order if n not in OPTIONAL_DIMS or sizes[n] > 1)
    return Layout(dims, ep=config.ep)


@dataclass(frozen=True)
class Layout:
    """A named mesh of ranks, outermost dimension first (row-major), and its expert degree."""

    dims: tuple[tuple[str, int], ...]
    ep: int = 1
    #: the dimensions' names and sizes, outermost first
    names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(n for n, _ in self.dims)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sizes", tuple(s for _, s in self.dims))
        if len(set(names)) != len(names) or any(s < 1 for s in self.sizes):
            raise SpecError(f"is {list(self.dims)}", field="layout", fix="name each dimension once, sizes >= 1")
        block = self._data_block()
        if self.ep < 1 or math.prod(self.sizes[i] for i in block) % self.ep:
            raise SpecError(f"ep={self.ep} does not divide the data ranks of {list(self.dims)}", field="config.ep",
                            fix="use an ep that divides dp x cp")

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def resolve(self, name: str) -> tuple[str, ...]:
        """The mesh dimensions ``name`` stands for, outermost first: itself, the parts of a flattened
        name (``FLATTENED``) present here, or none (an optional dimension at degree 1)."""
        if name in self.names:
            return (name,)
        if name in FLATTENED:
            return tuple(d for part in FLATTENED[name] for d in self.resolve(part))
        if name in OPTIONAL_DIMS:
            return ()
        raise SpecError(f"no mesh dimension {name!r} in {list(self.names)}", field="layout",
                        fix=f"use one of {', '.join(dict.fromkeys((*self.names, *FLATTENED, *EXPERT_DIMS)))}")

    def size(self, name: str) -> int:
        """The degree of a dimension, flattened name or expert dimension (``edp``, ``ep``)."""
        if name in EXPERT_DIMS and name not in self.names:
            return self.expert().size(name)
        return math.prod(dict(self.dims)[d] for d in self.resolve(name))

    def rank(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords`` (every mesh dimension; an absent optional one may be given as 0)."""
        rank = 0
        for name, size in self.dims:
            index = coords.get(name)
            if index is None or not 0 <= index < size:
                raise SpecError(f"coordinate {name}={index!r} outside 0..{size - 1}", field="layout",
                                fix=f"give every dimension of {list(self.names)} in range")
            rank = rank * size + index
        extra = {k: v for k, v in coords.items() if k not in self.names and v != 0}
        if extra:
            raise SpecError(f"coordinates {extra} name no dimension of {list(self.names)}", field="layout",
                            fix="give only this mesh's dimensions")
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's index along each mesh dimension."""
        if not 0 <= rank < self.world:
            raise SpecError(f"rank {rank} outside 0..{self.world - 1}", field="layout", fix="give a rank of the mesh")
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return dict(reversed(out.items()))

    def index(self, rank: int, name: str) -> int:
        """The rank's index along ``name``, row-major over the dimensions it stands for: ``dp`` of an
        HSDP mesh is ``replicate_index * dp_shard + shard_index``; 0 along an absent optional one."""
        if name in EXPERT_DIMS and name not in self.names:
            return self.expert().index(rank, name)
        at, index = self.coords(rank), 0
        for d in self.resolve(name):
            index = index * dict(self.dims)[d] + at[d]
        return index

    def group_array(self, *names: str) -> IntArray:
        """``(groups, members)``: the ranks of each group along the named dimensions (flattened names
        allowed), members row-major over them, groups row-major over the other dimensions. Read-only."""
        if any(n in EXPERT_DIMS and n not in self.names for n in names):
            return self.expert().group_array(*names)
        picked = tuple(d for n in names for d in self.resolve(n))
        return _group_index(self.dims, picked)

    def groups(self, *names: str) -> list[list[int]]:
        """``group_array`` as lists: every rank in exactly one group."""
        return [[int(r) for r in row] for row in self.group_array(*names)]

    def expert(self) -> Layout:
        """The expert mesh: the data block (dp, cp) re-split as (edp, ep), ep fastest (Megatron-Core's
        expert ``RankGenerator``; the module docstring)."""
        block = self._data_block()
        if not block:
            return Layout((*self.dims, ("edp", 1), ("ep", 1)))
        data = math.prod(self.sizes[i] for i in block)
        head, tail = self.dims[: block[0]], self.dims[block[-1] + 1:]
        return Layout((*head, ("edp", data // self.ep), ("ep", self.ep), *tail))

    def _data_block(self) -> list[int]:
        at = [i for i, n in enumerate(self.names) if n in DATA_DIMS]
        if at and at != list(range(at[0], at[-1] + 1)):
            raise SpecError(f"the data dimensions of {list(self.names)} are not adjacent", field="layout",
                            fix="keep dp and cp next to each other in the mesh")
        return at


@lru_cache(maxsize=4096)
def _group_index(dims: tuple[tuple[str, int], ...], picked: tuple[str, ...]) -> IntArray:
    names = [n for n, _ in dims]
    if len(set(picked)) != len(picked):
        raise SpecError(f"names a dimension twice: {list(picked)}", field="layout", fix="name each dimension once")
    grid = np.arange(math.prod(s for _, s in dims), dtype=np.int64).reshape([s for _, s in dims])
    at = [names.index(n) for n in picked]
    rest = [i for i in range(len(names)) if i not in at]
    out = grid.transpose(rest + at).reshape(-1, math.prod(grid.shape[i] for i in at))
    out.setflags(write=False)
    return out
