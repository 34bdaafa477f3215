"""How an MoE candidate routes and moves its tokens: the two MoE choices of the search beside the
degrees (issue 47).

**Routing** (``ParallelConfig.routing``): ``dropless`` (every token reaches its ``k`` experts:
MegaBlocks, Gale et al. 2023; Megatron-Core's default) or a capacity factor ``cf<c>`` (each expert
takes at most ``c x tokens x k / experts`` tokens, the rest dropped: GShard, Lepikhin et al. 2021,
sec. 2.2). Dropping tokens changes what the model learns, so the search never picks it on its own:
it plans the routings the job allows (``TrainingSpec.moe_routing``), and without that list the
model's own (``MoeSpec.capacity_factor``: dropless unless set). ``None`` on a candidate is the model's.

**Token dispatcher** (``ParallelConfig.dispatcher``): how the routed tokens cross the expert-parallel
group. ``None`` is the all-to-all (NCCL's all-to-all of every token copy: Megatron-Core's
``--moe-token-dispatcher-type alltoall``, torchtitan's, DeepSpeed's); ``flex`` is Megatron-Core's
flex dispatcher over DeepEP or HybridEP (``--moe-token-dispatcher-type flex``): a token crosses to
another node once and is forwarded inside it over NVLink (DeepSeek-V3 report sec. 3.2.2). It changes
no result, only the speed and the memory, so the stacks that run it search it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from pipette.errors import SpecError

if TYPE_CHECKING:
    from pipette.model import ModelSpec

DROPLESS = "dropless"
#: the token dispatchers a candidate names; None on a candidate: the all-to-all
DISPATCHERS: tuple[str, ...] = ("alltoall", "flex")
_FIX = "give dropless, or a capacity factor such as 1.0 or 1.25 (written cf1.25 in a layout's label)"


def routing_name(capacity_factor: float | None) -> str:
    """The canonical name of a routing: ``dropless``, or ``cf`` and the factor (``cf1``, ``cf1.25``)."""
    return DROPLESS if capacity_factor is None else f"cf{capacity_factor:g}"


def parse_routing(value: object, field: str = "training.moe_routing") -> str:
    """``value`` (``dropless``, a positive number, or ``cf<number>``) as its canonical name; a
    ``SpecError`` that says what is wrong otherwise."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == DROPLESS:
            return DROPLESS
        number: object = text[2:] if text.startswith("cf") else text
        try:
            value = float(str(number))
        except ValueError:
            raise SpecError(f"unknown MoE routing {value!r}", field=field, fix=_FIX) from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not value > 0:
        raise SpecError(f"must be dropless or a positive capacity factor, got {value!r}", field=field, fix=_FIX)
    return routing_name(float(value))


def routing_capacity(routing: str) -> float | None:
    """The capacity factor of a canonical routing name (None: dropless)."""
    return None if routing == DROPLESS else float(routing[2:])


def capacity_of(model_capacity: float | None, routing: str | None) -> float | None:
    """A candidate's capacity factor: its ``routing``'s, or the model's where it names none."""
    return model_capacity if routing is None else routing_capacity(routing)


def routed(model: ModelSpec, routing: str | None) -> ModelSpec:
    """``model`` with the candidate's routing as its experts' (the model itself under None or dense)."""
    if routing is None or model.moe is None:
        return model
    capacity = routing_capacity(routing)
    if capacity == model.moe.capacity_factor:
        return model
    return replace(model, moe=replace(model.moe, capacity_factor=capacity))


def check_dispatcher(value: object, field: str = "config.dispatcher") -> str | None:
    """``value`` as a candidate stores it (the all-to-all as None), or a ``SpecError``."""
    if value is None or value == "alltoall":
        return None
    if value not in DISPATCHERS:
        raise SpecError(f"unknown token dispatcher {value!r}", field=field,
                        fix=f"use one of {', '.join(DISPATCHERS)} (or leave it out: the all-to-all)")
    return str(value)


__all__ = ["DISPATCHERS", "DROPLESS", "capacity_of", "check_dispatcher", "parse_routing", "routed",
           "routing_capacity", "routing_name"]
