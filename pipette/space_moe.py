"""The expert degrees of the search space (issue 47): each candidate of a Mixture-of-Experts model
in every expert-parallel degree ``ep`` (and expert tensor-parallel degree ``etp``) its stack runs.

``ep`` divides the routed experts (each rank holds ``E / ep`` whole experts) and is carved out of the
data-parallel ranks by each stack's own rule, its ``Stack.layout`` (``pipette.layout.StackLayout.problems``):

* ``megatron``: Megatron-Core folds ``ep`` into the ``dp x cp`` ranks of a stage (its expert
  ``RankGenerator``, megatron/core/parallel_state.py: ``tp=expert_tensor_parallel_size, ep=ep,
  dp=world // (etp * ep * pp)``). Its experts take their own tensor-parallel degree
  (``--expert-tensor-parallel-size``, default ``tp``): ``etp`` is ``tp`` or 1 (``ETP_CHOICES``);
* ``fsdp``: torchtitan's ``ParallelDims`` borrows ``ep`` from ``dp_shard x cp``
  (torchtitan/distributed/parallel_dims.py, ``_validate``: ``ep % cp == 0`` and
  ``(dp_shard * cp) % ep == 0``); the runner's ``workers.rank.expert_parallel`` runs it, the experts
  at ``etp = tp``;
* ``hf-deepspeed`` and ``pipette``: DeepSpeed's AutoEP (DeepSpeed 0.19,
  deepspeed/module_inject/auto_ep*.py; ds_config ``expert_parallel``), which replaces the MoE blocks of a
  Hugging Face model of the families it has presets for (``pipette.autoep.autoep_family``): per pipeline stage the
  expert groups are blocks of ``ep`` consecutive ranks (tp fastest, then dp), so ``ep`` divides
  ``tp x dp`` (``auto_ep_folding.build_folding_spec``; planned within dp), beside tp only at pp 1, the experts whole
  (``etp`` 1), not beside Ulysses' cp (not planned); another model at ``ep = 1``;
* ``nanotron``: ``ep = 1`` (its MoE path lays its ranks out in an order of its own, not planned);
* ``pipette``: Pipette's DeepSpeed runner builds the Hugging Face model of the AutoEP families it
  knows (``pipette.autoep.DEEPSPEED_MOE_FAMILIES``; another is refused in one line, ``refuse_stack``)
  and trains its experts under AutoEP at tp 1, pp 1, ZeRO 0-2 (``pipette.runners.deepspeed_moe_refusals``).

Each (ep, etp) variant comes in every routing and token dispatcher (``pipette.routing``) the stack runs:

* **routing**: the routings the job allows (``TrainingSpec.moe_routing``: dropping tokens changes what
  the model learns, so nothing is planned that the job does not list); without that list, the model's
  own (``MoeSpec.capacity_factor``, dropless unless set). A capacity factor only where the stack runs one
  (``StackLayout.capacity``: Megatron-Core's ``--moe-expert-capacity-factor``; torchtitan's ``MoEArgs``
  has none, its router is dropless); a job whose routings no stack of the plan runs is refused in one line.
* **dispatcher**: the all-to-all everywhere; Megatron-Core's ``flex`` dispatcher (DeepEP / HybridEP,
  ``StackLayout.dispatchers``) beside it where it runs: ``ep > 1`` (``MoEFlexTokenDispatcher``: "Flex
  token dispatcher requires TPxEP > 1"), an expert tensor x expert parallel group of a size DeepEP's
  configs list (deep_ep/buffer.py ``get_dispatch_config``: ``pipette.memory_moe.DEEPEP_NVL_RECV_TOKENS``)
  and a GPU of Hopper's generation or later (DeepEP's README; ``flex_devices``: a device with an FP8 rate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from pipette.autoep import DEEPSPEED_MOE_FAMILIES, autoep_family
from pipette.config import ParallelConfig
from pipette.device import DeviceSpec
from pipette.errors import SpecError
from pipette.layout import degrees_of
from pipette.memory_moe import DEEPEP_NVL_RECV_TOKENS
from pipette.model import ModelSpec
from pipette.routing import DROPLESS, routing_name
from pipette.stacks import get_stack, stack_layout
from pipette.training import TrainingSpec

#: the expert tensor-parallel degrees a stack plans, as "tp" (the dense degree) or a number; DeepSpeed's
#: AutoEP leaves the experts whole (``expert_tensor_parallel_size`` 1)
ETP_CHOICES: dict[str, tuple[str | int, ...]] = {"megatron": ("tp", 1), "hf-deepspeed": (1,), "pipette": (1,)}
#: the stacks whose expert parallelism is DeepSpeed's AutoEP, which replaces the MoE blocks of the
#: Hugging Face families it has presets for (deepspeed/module_inject/auto_ep_presets: mixtral,
#: qwen2_moe / qwen3_moe, deepseek_v2, deepseek_v3); another model plans ep 1 there
AUTOEP_STACKS = ("hf-deepspeed", "pipette")


def refuse_stack(model: ModelSpec, stack: str) -> None:
    """A ``SpecError`` in one line when ``stack`` cannot run ``model``'s experts: Pipette's DeepSpeed
    runner builds the AutoEP families of ``pipette.autoep.DEEPSPEED_MOE_FAMILIES`` alone."""
    name = stack.split("+", 1)[0]
    runner = get_stack(name).runner
    if model.moe is not None and runner is not None and runner.deepspeed \
            and autoep_family(model) not in DEEPSPEED_MOE_FAMILIES:
        raise SpecError(f"{model.name} is a Mixture-of-Experts model; the {name} stack's DeepSpeed runner builds "
                        f"the experts of {', '.join(DEEPSPEED_MOE_FAMILIES)} models (under DeepSpeed's AutoEP) "
                        "alone", field="stack",
                        fix="plan it with --stack megatron, or --stack fsdp, whose runner trains experts with "
                            "expert parallelism")


def expert_degrees(model: ModelSpec, room: int) -> list[int]:
    """Every ``ep`` that divides the routed experts and the ``room`` ranks it is carved from."""
    if model.moe is None:
        return [1]
    return [e for e in range(1, min(model.moe.experts, room) + 1) if model.moe.experts % e == 0 and room % e == 0]


def routings(model: ModelSpec, training: TrainingSpec, stack: str | None) -> list[str | None]:
    """The routings ``stack`` plans for ``model`` (None: the model's own; the module docstring); a
    ``SpecError`` in one line where the job lists routings and the stack runs none of them."""
    if not training.moe_routing:
        return [None]
    if model.moe is None:
        raise SpecError(f"{model.name} is a dense model: it has no experts to route", field="training.moe_routing",
                        fix="leave moe_routing out for a dense model")
    rules = stack_layout(stack) if stack is not None else None
    own = routing_name(model.moe.capacity_factor)
    out: list[str | None] = [None if r == own else r for r in training.moe_routing
                             if r == DROPLESS or (rules is not None and rules.capacity)]
    if not out:
        raise SpecError(f"the {stack} stack routes dropless only; the job allows {', '.join(training.moe_routing)}",
                        field="training.moe_routing",
                        fix="add dropless to moe_routing, or plan it with --stack megatron (capacity factors)")
    return out


def flex_devices(device: DeviceSpec) -> bool:
    """Whether DeepEP / HybridEP run on ``device``: a GPU of Hopper's generation or later (an FP8 rate)."""
    return device.kind == "gpu" and "fp8" in device.peak_flops


def expert_variants(model: ModelSpec, config: ParallelConfig, stack: str | None,
                    routes: Sequence[str | None] = (None,), flex: bool = False) -> list[ParallelConfig]:
    """``config`` in every (ep, etp, routing, dispatcher) ``stack`` runs for ``model`` (a dense model:
    ``config`` alone). ``routes``: ``routings``' list; ``flex``: the devices run the flex dispatcher."""
    if model.moe is None:
        return [config]
    rules = stack_layout(stack) if stack is not None else None
    choices = ETP_CHOICES.get(stack.split("+", 1)[0], ("tp",)) if stack is not None else ("tp",)
    out = []
    within = rules.ep_within if rules is not None else ("dp", "cp")
    room = math.prod(degrees_of(config)[d] for d in within)
    autoep = stack is not None and stack.split("+", 1)[0] in AUTOEP_STACKS
    for ep in expert_degrees(model, room):
        if ep > 1 and (rules is None or not rules.ep or (autoep and autoep_family(model) is None)):
            continue
        for etp in choices:
            value = config.tp if etp == "tp" else int(etp)
            try:
                candidate = replace(config, ep=ep, etp=value)
            except SpecError:
                continue
            if candidate in out or (rules is not None and rules.problems(candidate)):
                continue  # etp 1 under tp 1 is etp = tp's own spelling: one candidate, not two
            dispatchers: list[str | None] = [None]
            group = ep * (config.tp if candidate.etp is None else candidate.etp)
            if flex and ep > 1 and rules is not None and "flex" in rules.dispatchers \
                    and group in DEEPEP_NVL_RECV_TOKENS:
                dispatchers.append("flex")
            out += [replace(candidate, routing=r, dispatcher=d) for r in routes for d in dispatchers]
    return out


__all__ = ["AUTOEP_STACKS", "ETP_CHOICES", "expert_degrees", "expert_variants",
           "flex_devices", "refuse_stack", "routings"]
