"""What one rank of an ``fsdp`` trial runs (``FsdpPlan``), and the check that refuses, before any
process starts, a candidate the PyTorch-native runner cannot split the model by.

No torch here: the host calls ``check_fsdp`` with the candidate and the number of processes it
is about to start, and a bad candidate ends in one line (``SpecError``: what, and the fix).

The mesh is torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``): the
dimensions ``pp, dp_replicate, dp_shard, tp`` in that order, row-major, so a rank's coordinates
are Pipette's rank layout (``pipette.config``: pp outermost, tp fastest) with
``dp_index = replicate_index * dp_shard + shard_index``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.fsdp_rules import fsdp_problems as fsdp_problems  # the rules live with the planner
from pipette.model import ModelSpec
from pipette.training import MIXED_DTYPES, TrainingSpec

#: mesh dimension names, outermost first (torchtitan's order, without cp and ep)
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp")
#: ``torch.distributed.pipelining`` schedules by name; a ParallelConfig says 1f1b or interleaved,
#: ``gpipe`` is there for callers that build a plan themselves
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class FsdpPlan:
    """The PyTorch-native parallelisms of one candidate, as the rank program applies them."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
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

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp * stages_per_rank``)."""
        return self.pp * self.stages_per_rank

    @property
    def fsdp(self) -> bool:
        """Whether ``fully_shard`` wraps the model: over a data-parallel group, or on one rank for
        its mixed precision or offload (without them a single rank trains the plain model)."""
        return self.dp > 1 or self.offload or self.dtype in MIXED_DTYPES

    def stage_ids(self, pp_index: int) -> list[int]:
        """The stages pipeline rank ``pp_index`` holds: one, or one per round of the interleaved
        loop (torchtitan's ``stage_ids_this_rank`` for a "loop" style schedule)."""
        return [pp_index + k * self.pp for k in range(self.stages_per_rank)]

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's index along each mesh dimension."""
        out: dict[str, int] = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(self.mesh_shape), strict=True):
            rank, out[name] = divmod(rank, size)
        return out


def plan_for(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str = "cpu",
             world: int | None = None) -> FsdpPlan:
    """The plan of ``config``, or the first reason the runner cannot run it (``SpecError``)."""
    check_fsdp(model, training, config, device_kind, world)
    c = config
    shard = c.dp if c.dp_shard is None else c.dp_shard
    if c.zero_stage == 0:
        shard = 1  # NO_SHARD: every replica holds the whole model (checked: dp_shard is unset or 1)
    return FsdpPlan(
        pp=c.pp, dp_replicate=c.dp // shard, dp_shard=shard, tp=c.tp, reshard_after_forward=c.zero_stage == 3,
        offload=c.offload, schedule=c.schedule, stages_per_rank=c.virtual_stages if c.schedule == "interleaved" else 1,
        microbatches=c.grad_accum, mbs=c.mbs, recompute=c.recompute, dtype=training.dtype,
    )


def check_fsdp(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str = "cpu",
               world: int | None = None) -> None:
    """Refuse, in one line naming the field and the fix, what the runner cannot run; ``world``
    is the number of processes the candidate is about to get (None: not known here)."""
    problem = fsdp_problems(model, training, config, device_kind, world)
    if problem:
        message, field, fix = problem[0]
        raise SpecError(message, field=field, fix=fix)
