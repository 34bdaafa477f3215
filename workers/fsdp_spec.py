"""What one rank of an ``fsdp`` trial runs (``FsdpPlan``), and the check that refuses, before any
process starts, a candidate the PyTorch-native runner cannot split the model by.

No torch here: the host calls ``check_fsdp`` with the candidate and the number of processes it
is about to start, and a bad candidate ends in one line (``SpecError``: what, and the fix).

The mesh is the ``fsdp`` stack's layout (``pipette.stacks.rank_layout(config, "fsdp")``: torchtitan's
``ParallelDims`` order ``pp, dp_replicate, dp_shard, cp, tp``, row-major, cp only above 1), so a
rank's coordinates are Pipette's rank layout with ``dp`` flattened from ``dp_replicate, dp_shard``.

Context parallelism (cp > 1) is torchtitan's: ring attention (``CP_KIND``) over the cp dimension, the
cp ranks of one data-parallel replica reading the same rows and each holding its ``2 cp``-chunk part
of every sequence, and FSDP sharding over the flattened ``dp_shard x cp`` (torchtitan's ``dp_shard_cp``;
``ParallelDims.fsdp_enabled`` is ``dp_shard_enabled or cp_enabled``). Under NO_SHARD (zero_stage 0)
the cp ranks hold whole replicas, as its dp ranks do, and average their gradients over cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.fsdp_rules import fsdp_problems as fsdp_problems  # the rules live with the planner
from pipette.layout import Layout
from pipette.model import ModelSpec
from pipette.stacks import rank_layout, stack_layout
from pipette.training import MIXED_DTYPES, TrainingSpec

#: ``torch.distributed.pipelining`` schedules by name; a ParallelConfig says 1f1b or interleaved,
#: ``gpipe`` is there for callers that build a plan themselves
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
#: how the fsdp stack's cp ranks attend over the whole sequence: torchtitan's ring attention
#: (``context_parallel_degree``, ``torchtitan/distributed/context_parallel.py``); Ulysses is not its kind
CP_KIND = "ring"


@dataclass(frozen=True)
class FsdpPlan:
    """The PyTorch-native parallelisms of one candidate, as the rank program applies them."""

    #: the device mesh (its names and sizes are ``init_device_mesh``'s)
    mesh: Layout
    #: FSDP2's ``reshard_after_forward`` (ZeRO-3-like when True, ZeRO-2-like when False)
    reshard_after_forward: bool
    #: FSDP2's ``CPUOffloadPolicy``
    offload: bool
    #: the pipeline schedule (``SCHEDULES``) and the stages each pipeline rank holds
    schedule: str
    stages_per_rank: int
    #: micro-batches per step of each data-parallel replica (the pipeline's micro-batches under pp)
    microbatches: int
    mbs: int
    #: activation checkpointing: none, selective (torchtitan's per-op policy) or full (per layer)
    recompute: str
    #: the dtype FSDP2 computes in (``MixedPrecisionPolicy.param_dtype``); master weights are fp32
    dtype: str
    #: how the cp ranks attend over the whole sequence (``CP_KIND``; read only when cp > 1)
    cp_kind: str = CP_KIND
    #: FSDP shards over ``dp_shard x cp`` (torchtitan's ``dp_shard_cp``: zero_stage 2 and 3 with cp > 1);
    #: False: the cp ranks hold whole replicas (NO_SHARD) or there is no cp
    shard_cp: bool = False

    @property
    def pp(self) -> int:
        return self.mesh.size("pp")

    @property
    def dp_replicate(self) -> int:
        return self.mesh.size("dp_replicate")

    @property
    def dp_shard(self) -> int:
        return self.mesh.size("dp_shard")

    @property
    def dp(self) -> int:
        return self.mesh.size("dp")

    @property
    def tp(self) -> int:
        return self.mesh.size("tp")

    @property
    def cp(self) -> int:
        """Context-parallel degree (1 when the mesh has no cp dimension)."""
        return self.mesh.size("cp")

    @property
    def ep(self) -> int:
        """Expert-parallel degree: the ranks one MoE layer's experts are split over (1: each rank
        holds them all)."""
        return self.mesh.ep

    @property
    def expert_mesh(self) -> Layout:
        """The experts' mesh, torchtitan's for ``ep > 1`` (``ParallelDims``: ep "borrows all cp and
        some dp_shard degree"): ``pp, dp_replicate, efsdp, ep, tp`` with ``efsdp = dp_shard * cp / ep``,
        the ranks that shard one block of experts with FSDP2; ``ep`` is ``mesh``'s expert groups
        (``Layout.expert``: the data block re-split, ep fastest)."""
        return Layout((("pp", self.pp), ("dp_replicate", self.dp_replicate),
                       ("efsdp", self.dp_shard * self.cp // self.ep), ("ep", self.ep), ("tp", self.tp)))

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp * stages_per_rank``)."""
        return self.pp * self.stages_per_rank

    @property
    def fsdp(self) -> bool:
        """Whether ``fully_shard`` wraps the model: over a data-parallel group (``dp_shard x cp``
        under ``shard_cp``), or on one rank for its mixed precision or offload (without them a
        single rank trains the plain model)."""
        return self.dp > 1 or self.shard_cp or self.offload or self.dtype in MIXED_DTYPES

    @property
    def cp_grad_average(self) -> bool:
        """Whether the rank averages its gradients over cp itself (cp ranks holding whole replicas)."""
        return self.cp > 1 and not self.shard_cp

    def stage_ids(self, pp_index: int) -> list[int]:
        """The stages pipeline rank ``pp_index`` holds: one, or one per round of the interleaved
        loop (torchtitan's ``stage_ids_this_rank`` for a "loop" style schedule)."""
        return [pp_index + k * self.pp for k in range(self.stages_per_rank)]


def plan_for(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str = "cpu",
             world: int | None = None) -> FsdpPlan:
    """The plan of ``config``, or the first reason the runner cannot run it (``SpecError``)."""
    check_fsdp(model, training, config, device_kind, world)
    c = config
    # NO_SHARD (zero_stage 0) is dp_shard 1: every replica holds the whole model (pipette.layout.degrees_of)
    return FsdpPlan(
        mesh=rank_layout(c, "fsdp"), reshard_after_forward=c.zero_stage == 3,
        offload=c.offload, schedule=c.schedule, stages_per_rank=c.virtual_stages if c.schedule == "interleaved" else 1,
        microbatches=c.grad_accum, mbs=c.mbs, recompute=c.recompute, dtype=training.dtype,
        cp_kind=CP_KIND, shard_cp=c.cp > 1 and c.zero_stage != 0,
    )


def check_fsdp(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str = "cpu",
               world: int | None = None) -> None:
    """Refuse, in one line naming the field and the fix, what the runner cannot run; ``world``
    is the number of processes the candidate is about to get (None: not known here)."""
    problem = stack_layout("fsdp").problems(config) + fsdp_problems(model, training, config, device_kind, world)
    if problem:
        message, field, fix = problem[0]
        raise SpecError(message, field=field, fix=fix)
