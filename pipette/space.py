"""The search space: every candidate the backends can run, and why the others cannot.

``enumerate_space`` walks tp x pp x dp (``world = tp * pp * dp`` = the cluster's devices),
micro-batch, ZeRO stage, recomputation and pipeline schedule; ``check`` says, for any
candidate, which validity rule it breaks. Rejections are counted per rule so a user can
see what removed what.

Context parallelism (``cp``, issue 48) is a degree of the walk for a stack that runs it
(``pipette.layout.StackLayout.cp``) at a sequence long enough that splitting it matters
(``cp_degrees``: ``CP_MIN_SEQ_PER_HIDDEN`` x h tokens and more, each cp rank keeping h): then
``world = tp * pp * dp * cp``. A shorter job's space is what it was without cp.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.stacks import stack_layout
from pipette.training import TrainingSpec

#: Every rule, by code, with the sentence a user reads.
RULES: dict[str, str] = {
    "tp_heads": "tp does not divide the attention heads",
    "tp_kv_heads": "tp does not divide the key/value heads",
    "pp_layers": "pp is larger than the number of layers",
    "zero_pipeline": "ZeRO-2/3 under a pipeline (pp > 1): the stack's pipeline engine refuses it (DeepSpeed's does)",
    "interleaved_pp": "an interleaved schedule needs pp > 1",
    "interleaved_layers": "layers are not divisible by pp x virtual stages",
    "interleaved_microbatches": "interleaving needs the micro-batch count to be a multiple of pp",
    "mbs_not_allowed": "micro-batch size not in the recipe's list",
    "batch_divisible": "global batch is not divisible by dp x micro-batch",
    "recompute_not_allowed": "recomputation mode not allowed by the recipe",
    "zero_not_allowed": "ZeRO stage not allowed by the recipe",
    "schedule_not_allowed": "pipeline schedule not allowed by the recipe",
    "world_mismatch": "tp x pp x dp is not the cluster's device count",
    "cp_stack": "the stack does not run context parallelism (cp > 1)",
    "cp_split": "the stack's context parallelism cannot split this sequence (or these heads) over cp x tp",
}

#: cp is offered where the sequence has this many tokens per unit of the hidden size, s >= 4 h: there
#: a token's causal attention (2 s h FLOPs a layer forward, QK^T and PV halved) is a third of its
#: linear layers' (24 h^2 with a 4h MLP: Narayanan et al. 2021, sec. 5.1) and its activations
#: outgrow what tp and recomputation save. Below it a layout without cp holds the same job and
#: cp's exchange only adds traffic, so plans of shorter jobs keep their candidates (an 8B model,
#: h 4,096: 16,384 tokens; a 70B, h 8,192: 32,768; the tiny CPU models, h 128: 512).
CP_MIN_SEQ_PER_HIDDEN = 4


def cp_degrees(model: ModelSpec, training: TrainingSpec, world: int, stack: str | None) -> list[int]:
    """The cp degrees to walk for ``stack`` (None: no stack, cp 1 only): 1, and where the stack runs
    context parallelism and ``s >= CP_MIN_SEQ_PER_HIDDEN x h``, every divisor of ``world`` that leaves
    a rank at least h tokens (a shorter chunk's ring blocks are too small to hide their transfer,
    ``pipette.perf_cp``, and its GEMMs thinner than the model is wide)."""
    h, s = model.hidden, training.seq_len
    if stack is None or not stack_layout(stack).cp or s < CP_MIN_SEQ_PER_HIDDEN * h:
        return [1]
    return [c for c in divisors(world) if c == 1 or s // c >= h]


def cp_rules(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, stack: str | None) -> list[str]:
    """The cp codes ``config`` breaks on ``stack`` (``RULES``)."""
    if config.cp == 1:
        return []
    if stack is None or not stack_layout(stack).cp:
        return ["cp_stack"]
    if stack_layout(stack).cp_problems(config.cp, config.tp, training.seq_len, model.heads, model.kv_heads):
        return ["cp_split"]
    return []


def check(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, world: int, *,
          sharded_pipeline: bool = False, uneven_virtual_stages: bool = False, stack: str | None = None,
          embedding_loss_split: bool = False) -> list[str]:
    """The codes of every rule ``config`` breaks (empty when it is valid); ``sharded_pipeline``:
    the stack shards gradients and parameters under a pipeline (FSDP2 with
    ``torch.distributed.pipelining``), so ``zero_pipeline`` is not a rule; ``uneven_virtual_stages``:
    it splits the layers over an interleaved schedule's stages as evenly as they go, so
    ``interleaved_layers`` is not one either, nor where ``embedding_loss_split`` and the layers plus the
    embedding and the loss split evenly (Megatron-Core's); ``stack``: whose cp rules apply (``cp_rules``)."""
    broken = []
    if config.world != world:
        broken.append("world_mismatch")
    broken += cp_rules(model, training, config, stack)
    if model.heads % config.tp:
        broken.append("tp_heads")
    if model.kv_heads % config.tp:
        broken.append("tp_kv_heads")
    if config.pp > model.layers:
        broken.append("pp_layers")
    if config.pp > 1 and config.zero_stage >= 2 and not sharded_pipeline:
        broken.append("zero_pipeline")
    if config.schedule == "interleaved":
        if config.pp == 1:
            broken.append("interleaved_pp")
        chunks = config.pp * config.virtual_stages
        if model.layers % chunks and not uneven_virtual_stages \
                and not (embedding_loss_split and (model.layers + 2) % chunks == 0):
            broken.append("interleaved_layers")
        # Megatron-LM's interleaved 1F1B runs micro-batches in groups of pp.
        if config.grad_accum % config.pp:
            broken.append("interleaved_microbatches")
    if training.micro_batches and config.mbs not in training.micro_batches:
        broken.append("mbs_not_allowed")
    if config.global_batch != training.global_batch or config.global_batch % (config.dp * config.mbs):
        broken.append("batch_divisible")
    if config.recompute not in training.recompute:
        broken.append("recompute_not_allowed")
    if config.zero_stage not in training.zero_stages:
        broken.append("zero_not_allowed")
    if config.schedule not in training.schedules:
        broken.append("schedule_not_allowed")
    return broken


@dataclass
class Space:
    """The valid candidates, and the count of rejected ones per rule code."""

    candidates: list[ParallelConfig]
    rejected: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return len(self.candidates) + sum(self.rejected.values())


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_sizes(training: TrainingSpec, dp: int) -> list[int]:
    """Micro-batches to try for a given dp: the recipe's list, or powers of two."""
    per_replica = training.global_batch // dp if training.global_batch % dp == 0 else 0
    if training.micro_batches:
        return sorted(set(training.micro_batches))
    sizes, m = [], 1
    while m <= max(per_replica, 1):
        sizes.append(m)
        m *= 2
    return sizes


def enumerate_space(model: ModelSpec, training: TrainingSpec, world: int, *, sharded_pipeline: bool = False,
                    uneven_virtual_stages: bool = False, stack: str | None = None,
                    embedding_loss_split: bool = False) -> Space:
    """All candidates for ``world`` devices; each rejection is counted by its first rule
    (``sharded_pipeline``, ``uneven_virtual_stages``, ``embedding_loss_split``: as ``check``; ``stack``: the
    cp degrees it runs, ``cp_degrees``).

    Degree tuples whose tp or pp break a model rule are counted once per tuple, not once
    per (mbs, zero, recompute, schedule) combination, so the counts stay readable.
    """
    space = Space(candidates=[])
    for cp, tp, pp in _degrees(model, training, world, stack):
        dp = world // (tp * pp * cp)
        degree_rules = [
            code for code, bad in (
                ("tp_heads", model.heads % tp != 0),
                ("tp_kv_heads", model.kv_heads % tp != 0),
                ("pp_layers", pp > model.layers),
            ) if bad
        ]
        probe = ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=1, global_batch=dp, cp=cp)
        degree_rules += cp_rules(model, training, probe, stack)
        if degree_rules:
            space.rejected[degree_rules[0]] += 1
            continue
        if training.global_batch % dp:
            space.rejected["batch_divisible"] += 1
            continue
        for mbs in micro_batch_sizes(training, dp):
            if training.global_batch % (dp * mbs):
                space.rejected["batch_divisible"] += 1
                continue
            for zero in training.zero_stages:
                for recompute in training.recompute:
                    for schedule, v in _schedules(training, pp):
                        config = ParallelConfig(
                            tp=tp, pp=pp, dp=dp, mbs=mbs,
                            global_batch=training.global_batch, zero_stage=zero,
                            recompute=recompute, schedule=schedule, virtual_stages=v, cp=cp,
                        )
                        broken = check(model, training, config, world, sharded_pipeline=sharded_pipeline,
                                       uneven_virtual_stages=uneven_virtual_stages, stack=stack,
                                       embedding_loss_split=embedding_loss_split)
                        if broken:
                            space.rejected[broken[0]] += 1
                        else:
                            space.candidates.append(config)
    return space


def _degrees(model: ModelSpec, training: TrainingSpec, world: int, stack: str | None) -> list[tuple[int, int, int]]:
    """(cp, tp, pp) of every degree tuple, cp 1 first (the order without cp is unchanged)."""
    return [(cp, tp, pp) for cp in cp_degrees(model, training, world, stack)
            for tp in divisors(world // cp) for pp in divisors(world // (cp * tp))]


def hsdp_shard(config: ParallelConfig, devices_per_node: tuple[int, ...]) -> int | None:
    """FSDP2's HSDP shard degree for ``config`` on nodes of ``devices_per_node`` devices, or None
    when HSDP does not apply: shard within a node, replicate across nodes (torchtitan's
    ``data_parallel_shard_degree`` x ``data_parallel_replicate_degree``; the FSDP2 documentation's
    2-D mesh). Ranks are laid out tp fastest, then dp (``ParallelConfig.rank``), so a shard group
    of ``dp_shard`` replicas' shards spans ``dp_shard * tp`` consecutive ranks: it fills one node
    when ``dp_shard = devices per node / tp``, and the replicas sit on other nodes. Only for a
    sharded candidate (ZeRO-2/3: NO_SHARD has no shard group) whose data-parallel group spans
    more than one node of equal ones."""
    if len(devices_per_node) < 2 or len(set(devices_per_node)) != 1 or config.zero_stage not in (2, 3):
        return None
    per_node = devices_per_node[0]
    if per_node % config.tp or config.dp * config.tp <= per_node:
        return None
    shard = per_node // config.tp
    return shard if 1 < shard < config.dp and config.dp % shard == 0 else None


def _schedules(training: TrainingSpec, pp: int) -> list[tuple[str, int]]:
    out = []
    if "1f1b" in training.schedules:
        out.append(("1f1b", 1))
    if "interleaved" in training.schedules and pp > 1:
        out.extend(("interleaved", v) for v in range(2, training.max_virtual_stages + 1))
    return out
