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
from pipette.model import ModelSpec
from pipette.training import TrainingSpec

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
        return self.dp > 1 or self.offload or self.dtype != "fp32"

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


def fsdp_problems(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, device_kind: str,
                  world: int | None) -> list[tuple[str, str, str]]:
    """Every (message, field, fix) that stops ``config`` on the fsdp runner; empty when it runs."""
    m, c = model, config
    out: list[tuple[str, str, str]] = []
    if world is not None and world != c.world:
        out.append((f"{world} processes for a candidate of tp x pp x dp = {c.tp} x {c.pp} x {c.dp} = {c.world}",
                    "config", f"start {c.world} ranks, or choose degrees whose product is {world}"))
    if m.arch != "llama":
        out.append((f"the runner builds Llama models, not {m.arch!r}", "model.arch", "use a Llama model"))
    if c.zero_stage == 1:
        out.append(("FSDP has no optimizer-only sharding (ZeRO-1)", "config.zero_stage",
                    "use 3 (FULL_SHARD), 2 (SHARD_GRAD_OP: no reshard after forward) or 0 (NO_SHARD)"))
    if c.zero_stage == 0 and c.dp_shard not in (None, 1):
        out.append((f"NO_SHARD (zero_stage 0) replicates, but dp_shard is {c.dp_shard}", "config.dp_shard",
                    "leave dp_shard out with zero_stage 0, or shard with zero_stage 2 or 3"))
    out += _split_problems(m, c)
    out += _pipeline_problems(m, c)
    if device_kind == "cpu" and training.dtype == "fp16":
        out.append(("fp16 needs a GPU", "training.dtype", "use fp32 or bf16 on CPU devices"))
    if training.seq_len > m.max_seq:
        out.append((f"seq_len {training.seq_len} exceeds the model's max_seq {m.max_seq}", "training.seq_len",
                    f"use at most {m.max_seq}"))
    return out


def _split_problems(m: ModelSpec, c: ParallelConfig) -> list[tuple[str, str, str]]:
    """Tensor parallelism shards heads, the MLP and the vocabulary over tp (DTensor
    ``parallelize_module``), and the sequence between them (sequence parallelism)."""
    out = []
    if c.tp > 1:
        for name, width in (("heads", m.heads), ("kv_heads", m.kv_heads), ("ffn_hidden", m.ffn_hidden),
                            ("vocab", m.vocab)):
            if width % c.tp:
                out.append((f"tp={c.tp} does not divide the model's {name}={width}", "config.tp",
                            f"use a tp that divides {name} ({_divisors(width)})"))
        if m.tied_embeddings:
            out.append(("tied embeddings cannot be split over tp: the embedding is cut by rows and the LM head "
                        "by columns of one weight", "config.tp", "use tp=1, or an untied model"))
    return out


def _pipeline_problems(m: ModelSpec, c: ParallelConfig) -> list[tuple[str, str, str]]:
    """``torch.distributed.pipelining``'s own limits (``schedules.py``): 1F1B needs at least as
    many micro-batches as stages, interleaved 1F1B a whole number of rounds."""
    if c.pp == 1:
        return []
    out = []
    stages = c.pp * (c.virtual_stages if c.schedule == "interleaved" else 1)
    if stages > m.layers:
        out.append((f"{stages} pipeline stages for {m.layers} layers", "config.pp",
                    f"use at most {m.layers} stages (pp x virtual_stages)"))
    if m.tied_embeddings:
        out.append(("tied embeddings across pipeline stages (the first stage's embedding is the last one's "
                    "head) are not supported by this runner", "config.pp", "use pp=1, or an untied model"))
    n = c.grad_accum
    if c.schedule == "1f1b" and n < c.pp:
        out.append((f"1F1B needs at least pp={c.pp} micro-batches per step, this candidate has {n}", "config.mbs",
                    f"use a micro-batch size of at most {c.global_batch // (c.dp * c.pp)}"))
    if c.schedule == "interleaved" and n % max(1, n // c.pp):
        out.append((f"interleaved 1F1B runs micro-batches in rounds of pp={c.pp}; {n} is not a whole number "
                    "of rounds", "config.mbs", f"choose mbs so that the {n} micro-batches are a multiple of pp"))
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)
