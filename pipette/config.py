"""``ParallelConfig``: one candidate (degrees, micro-batch, ZeRO, recomputation, schedule,
placement) and the rank layout every part of Pipette agrees on.

The rank layout is ``pipette.layout`` (``ParallelConfig.layout``, a stack's own with
``pipette.stacks.rank_layout(config, stack)``): pp outermost, tp fastest, as Megatron-LM's and DeepSpeed's
``PipeModelDataParallelTopology``::

    rank = pp_index * (dp * tp) + dp_index * tp + tp_index        (cp = 1)

so a TP group is ``tp`` consecutive ranks. ``placement[rank]`` is the device index (row
of the cluster's link matrix) that runs ``rank``; ``None`` means ``rank -> device rank``.
``cp`` (context parallelism) adds ranks, ``world = tp * pp * dp * cp``; ``ep`` (expert
parallelism) is carved out of the ``dp * cp`` ranks (``pipette.layout``). Both are 1 unless
given, and written (``to_dict``, ``label``) only when not 1. An MoE candidate's ``routing``
(dropless or a capacity factor) and token ``dispatcher`` (``pipette.routing``) are None (the model's
routing, the all-to-all) unless given, and written only when given.

Two options are the ``fsdp`` stack's alone (``workers.rank.fsdp``; DeepSpeed refuses them):
``dp_shard``, the data-parallel degree FSDP2 shards over (HSDP, torchtitan's
``data_parallel_shard_degree``: the ``dp`` ranks form ``dp // dp_shard`` replicas of ``dp_shard``
shards; ``None`` shards over all of ``dp``), and ``offload`` (FSDP2's ``CPUOffloadPolicy``).
Under that stack ``zero_stage`` names FSDP's sharding: 3 ``FULL_SHARD`` (reshard after forward),
2 ``SHARD_GRAD_OP`` (kept unsharded until backward), 0 ``NO_SHARD`` (replicated).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipette.errors import SpecError
from pipette.layout import Layout, check_degrees, layout_of
from pipette.routing import check_dispatcher, parse_routing
from pipette.training import RECOMPUTE_MODES, SCHEDULES


@dataclass(frozen=True)
class ParallelConfig:
    tp: int
    pp: int
    dp: int
    mbs: int
    global_batch: int
    zero_stage: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    placement: tuple[int, ...] | None = None
    #: FSDP2's shard degree within dp (HSDP: dp // dp_shard replicas); None: all of dp
    dp_shard: int | None = None
    #: FSDP2's CPU offload of parameters, gradients and optimizer states
    offload: bool = False
    #: the stack that runs this candidate when one plan ranks candidates of several stacks
    #: (``pipette.plan.make_plan`` with ``pipette,fsdp``); None: the plan's one stack
    stack: str | None = None
    #: context-parallel degree: ranks that split each sequence (extra ranks: world = tp * pp * dp * cp)
    cp: int = 1
    #: expert-parallel degree: carved out of the dp * cp ranks (the world is unchanged)
    ep: int = 1
    #: expert tensor-parallel degree (Megatron-Core's ``expert_tensor_parallel_size``); None: tp, its default
    etp: int | None = None
    #: an MoE candidate's routing (``pipette.routing``): ``dropless`` or ``cf<factor>``; None: the model's own
    routing: str | None = None
    #: an MoE candidate's token dispatcher (``pipette.routing``): ``flex`` (DeepEP / HybridEP); None: the all-to-all
    dispatcher: str | None = None

    def __post_init__(self) -> None:
        check_degrees(self.tp, self.pp, self.dp, self.cp, self.ep, self.dp_shard)
        if self.etp is not None and (not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 1
                                     or (self.tp * self.dp * self.cp) % (self.ep * self.etp)):
            raise SpecError(f"is {self.etp!r}: ep x etp must divide tp x dp x cp = {self.tp * self.dp * self.cp}",
                            field="config.etp", fix="give an etp of 1 or tp, or leave it out (etp = tp)")
        if self.etp == self.tp:
            object.__setattr__(self, "etp", None)  # one spelling of Megatron-Core's default
        if self.routing is not None:
            object.__setattr__(self, "routing", parse_routing(self.routing, "config.routing"))
        object.__setattr__(self, "dispatcher", check_dispatcher(self.dispatcher))
        if self.dispatcher is not None and self.tp * self.ep == 1:
            # Megatron-Core's MoEFlexTokenDispatcher: "Flex token dispatcher requires TPxEP > 1"
            raise SpecError("the flex dispatcher needs tp x ep > 1 (it moves tokens between ranks)",
                            field="config.dispatcher", fix="use it with ep > 1, or leave the dispatcher out")
        for name in ("mbs", "global_batch", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(
                    f"must be a positive integer, got {value!r}",
                    field=f"config.{name}", fix="give a whole number of at least 1",
                )
        if self.zero_stage not in (0, 1, 2, 3):
            raise SpecError(f"is {self.zero_stage!r}", field="config.zero_stage", fix="use 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE_MODES:
            raise SpecError(
                f"is {self.recompute!r}", field="config.recompute",
                fix=f"use one of {', '.join(RECOMPUTE_MODES)}",
            )
        if self.schedule not in SCHEDULES:
            raise SpecError(
                f"is {self.schedule!r}", field="config.schedule", fix=f"use one of {', '.join(SCHEDULES)}"
            )
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            raise SpecError(
                "1F1B has one virtual stage per device", field="config.virtual_stages",
                fix="use schedule: interleaved for more than one",
            )
        if self.global_batch % (self.dp * self.mbs):
            raise SpecError(
                f"global batch {self.global_batch} is not divisible by dp x mbs = {self.dp * self.mbs}",
                field="config.mbs", fix="choose dp and mbs whose product divides the global batch",
            )
        if self.dp_shard == self.dp:
            object.__setattr__(self, "dp_shard", None)  # one spelling of "shard over all of dp"
        if not isinstance(self.offload, bool):
            raise SpecError(f"is {self.offload!r}", field="config.offload", fix="use true or false")
        if self.stack is not None and (not isinstance(self.stack, str) or not self.stack.strip()):
            raise SpecError(f"is {self.stack!r}", field="config.stack",
                            fix="name the stack that runs the candidate (pipette, fsdp), or leave it out")
        if self.placement is not None:
            p = tuple(int(x) for x in self.placement)
            if len(p) != self.world or len(set(p)) != len(p) or min(p) < 0:
                raise SpecError(
                    f"placement must list {self.world} distinct device indices, got {list(p)}",
                    field="config.placement", fix="give one distinct device per rank",
                )
            object.__setattr__(self, "placement", p)

    # ---- derived ------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def grad_accum(self) -> int:
        """Micro-batches per step per data-parallel replica: ``global / (dp * mbs)``."""
        return self.global_batch // (self.dp * self.mbs)

    def layers_per_stage(self, layers: int) -> list[int]:
        """Layers per pipeline stage, heaviest first when uneven (DeepSpeed's uniform split)."""
        base, extra = divmod(layers, self.pp)
        return [base + (1 if s < extra else 0) for s in range(self.pp)]

    def devices(self) -> tuple[int, ...]:
        return self.placement if self.placement is not None else tuple(range(self.world))

    # ---- rank layout --------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """The named mesh of the ranks (``pipette.layout``): ``rank``, ``coords``, ``groups``."""
        return layout_of(self)

    # ---- identity -----------------------------------------------------------------
    @property
    def label(self) -> str:
        """A short readable name; unique among candidates of one plan (not placements)."""
        sched = "1f1b" if self.schedule == "1f1b" else f"int{self.virtual_stages}"
        fsdp = "" if self.dp_shard is None else f"-hsdp{self.dp // self.dp_shard}x{self.dp_shard}"
        extra = f"{'' if self.cp == 1 else f'-cp{self.cp}'}{'' if self.ep == 1 else f'-ep{self.ep}'}" \
            f"{'' if self.etp is None else f'-etp{self.etp}'}" \
            f"{'' if self.routing is None else '-' + self.routing}" \
            f"{'' if self.dispatcher is None else '-' + self.dispatcher}"
        return (
            f"tp{self.tp}-pp{self.pp}-dp{self.dp}{extra}-mbs{self.mbs}-z{self.zero_stage}"
            f"-rc:{self.recompute}-{sched}{fsdp}{'-offload' if self.offload else ''}"
            f"{'' if self.stack is None else '-' + self.stack}"
        )

    def with_placement(self, placement: tuple[int, ...] | list[int] | None) -> ParallelConfig:
        return replace(self, placement=None if placement is None else tuple(placement))

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp, "pp": self.pp, "dp": self.dp, "mbs": self.mbs,
            "global_batch": self.global_batch, "grad_accum": self.grad_accum,
            "zero_stage": self.zero_stage, "recompute": self.recompute,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "placement": None if self.placement is None else list(self.placement),
            # the fsdp stack's options, written only when set: a DeepSpeed candidate's dict is unchanged
            **({"dp_shard": self.dp_shard} if self.dp_shard is not None else {}),
            **({"offload": True} if self.offload else {}),
            **({"stack": self.stack} if self.stack is not None else {}),
            # the degrees no stack runs yet, written only when set: every stored candidate is unchanged
            **({"cp": self.cp} if self.cp != 1 else {}),
            **({"ep": self.ep} if self.ep != 1 else {}),
            **({"etp": self.etp} if self.etp is not None else {}),
            **({"routing": self.routing} if self.routing is not None else {}),
            **({"dispatcher": self.dispatcher} if self.dispatcher is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        kwargs = {k: v for k, v in data.items() if k != "grad_accum"}
        if kwargs.get("placement") is not None:
            kwargs["placement"] = tuple(kwargs["placement"])
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise SpecError(str(e), field="config", fix="give tp, pp, dp, mbs, global_batch") from None
