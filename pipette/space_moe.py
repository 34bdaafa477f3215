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
* ``hf-deepspeed``, ``nanotron``: a model with experts at ``ep = 1`` only (DeepSpeed's expert
  parallelism, ``ep_size`` within the data-parallel group, deepspeed/moe/layer.py and
  deepspeed/utils/groups.py ``_create_expert_and_data_parallel``, needs DeepSpeed's own ``MoE``
  layers, which a Hugging Face model's MoE blocks are not; nanotron's MoE path lays its ranks out
  in an order of its own, not planned);
* ``pipette``: Pipette's DeepSpeed runner builds dense Llama layers: a model with experts is refused
  in one line (``refuse_stack``).

Routing is dropless unless the model sets ``capacity_factor`` (``pipette.moe.MoeSpec``); the token
dispatcher is the stack's (``pipette.perf_moe.MoeConstants.dispatcher``: all-to-all by default).
"""

from __future__ import annotations

from dataclasses import replace

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.stacks import stack_layout

#: the expert tensor-parallel degrees a stack plans, as "tp" (the dense degree) or a number
ETP_CHOICES: dict[str, tuple[str | int, ...]] = {"megatron": ("tp", 1)}
#: stacks that do not run a model with experts at all, and why (one line each)
NO_MOE: dict[str, str] = {
    "pipette": "Pipette's DeepSpeed runner (workers.train) builds dense Llama layers, no MoE layer",
}


def refuse_stack(model: ModelSpec, stack: str) -> None:
    """A ``SpecError`` in one line when ``stack`` cannot run ``model``'s experts."""
    name = stack.split("+", 1)[0]
    if model.moe is not None and name in NO_MOE:
        raise SpecError(f"{model.name} is a Mixture-of-Experts model; the {name} stack does not run one: "
                        f"{NO_MOE[name]}", field="stack",
                        fix="plan it with --stack megatron, or --stack fsdp, whose runner trains experts with "
                            "expert parallelism")


def expert_degrees(model: ModelSpec, dp: int, cp: int) -> list[int]:
    """Every ``ep`` that divides the routed experts and the ``dp x cp`` ranks it is carved from."""
    if model.moe is None:
        return [1]
    room = dp * cp
    return [e for e in range(1, min(model.moe.experts, room) + 1) if model.moe.experts % e == 0 and room % e == 0]


def expert_variants(model: ModelSpec, config: ParallelConfig, stack: str | None) -> list[ParallelConfig]:
    """``config`` in every (ep, etp) ``stack`` runs for ``model`` (a dense model: ``config`` alone)."""
    if model.moe is None:
        return [config]
    rules = stack_layout(stack) if stack is not None else None
    choices = ETP_CHOICES.get(stack.split("+", 1)[0], ("tp",)) if stack is not None else ("tp",)
    out = []
    for ep in expert_degrees(model, config.dp, config.cp):
        if ep > 1 and (rules is None or not rules.ep):
            continue
        for etp in choices:
            value = config.tp if etp == "tp" else int(etp)
            try:
                candidate = replace(config, ep=ep, etp=value)
            except SpecError:
                continue
            if candidate in out:
                continue  # etp 1 under tp 1 is etp = tp's own spelling: one candidate, not two
            if rules is None or not rules.problems(candidate):
                out.append(candidate)
    return out


__all__ = ["ETP_CHOICES", "NO_MOE", "expert_degrees", "expert_variants", "refuse_stack"]
