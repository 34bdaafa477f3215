"""Planning: enumerate, give each candidate its chance to fit, rank by expected step time, place.

``make_plan`` is the what-if answer of the core (``pipette plan``, ``POST /v1/plan``) and
the first step of every tuning job: the data flow of DESIGN.md up to the search. A candidate
is dropped only when its chance to fit (``pipette.fits``) is below ``KEEP_THRESHOLD``; the
others are ranked by the step time one can expect from trying them, so the fastest
configuration next to the memory limit is tried first when it is likely enough to fit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError, SpecError
from pipette.estimates import MemoryEstimate, PerfEstimate
from pipette.fits import KEEP_THRESHOLD, SURE_TO_FIT, FitsPrior, expected_step_time
from pipette.fsdp_rules import model_problems
from pipette.memory import MemoryOptions, estimate_memory
from pipette.model import ModelSpec
from pipette.perf import PerfConstants, PerfModel
from pipette.placement import default_placement, optimize_placement
from pipette.space import RULES, Space, enumerate_space, hsdp_shard
from pipette.space_moe import expert_variants, flex_devices, refuse_stack, routings
from pipette.stacks import STACK_RULES, Stack, get_stack, get_stacks, stacks_key
from pipette.training import TrainingSpec

OUT_OF_MEMORY = "out_of_memory"
DROP_REASONS: dict[str, str] = {
    **RULES, **STACK_RULES, OUT_OF_MEMORY: f"less than a {KEEP_THRESHOLD:.0%} chance to fit in device memory",
}
#: Capacity a user asks to keep free, as a fraction added to the predicted peak (``--margin``):
#: none by default, the chance to fit prices the estimator's error.
DEFAULT_MARGIN = 0.0

GiB = 1024**3


@dataclass(frozen=True)
class Planned:
    """A feasible candidate with its estimates, under its chosen placement."""

    config: ParallelConfig
    memory: MemoryEstimate
    perf: PerfEstimate
    default_step_time: float
    placement_method: str = "default"
    #: the chance it fits in device memory (``pipette.fits``)
    chance_to_fit: float = 1.0
    #: the step time to expect from trying it (``pipette.fits.expected_step_time``)
    expected_step_time: float = 0.0

    @property
    def sure_to_fit(self) -> bool:
        return self.chance_to_fit >= SURE_TO_FIT

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label,
            "config": self.config.to_dict(),
            "memory": self.memory.to_dict(),
            "perf": self.perf.to_dict(),
            "default_placement_step_time": self.default_step_time,
            "placement_method": self.placement_method,
            "chance_to_fit": self.chance_to_fit,
            "sure_to_fit": self.sure_to_fit,
            "expected_step_time": self.expected_step_time,
        }


@dataclass(frozen=True)
class Dropped:
    """A candidate too unlikely to fit, with its estimate (the plan keeps them)."""

    config: ParallelConfig
    memory: MemoryEstimate
    chance_to_fit: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label,
            "config": self.config.to_dict(),
            "reason": OUT_OF_MEMORY,
            "memory": self.memory.to_dict(),
            "chance_to_fit": self.chance_to_fit,
        }


@dataclass
class Plan:
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterProfile
    ranked: list[Planned]
    dropped: Counter[str]
    out_of_memory: list[Dropped] = field(default_factory=list)
    margin: float = DEFAULT_MARGIN
    enumerated: int = 0
    fits_prior: FitsPrior | None = None
    stack: Stack = field(default_factory=lambda: get_stack(None))
    #: every stack the plan ranks candidates of (``pipette,fsdp``); empty: ``stack`` alone. With
    #: more than one, each candidate names its own (``ParallelConfig.stack``)
    stacks: tuple[Stack, ...] = ()

    @property
    def best(self) -> Planned:
        return self.ranked[0]

    @property
    def launch_pick(self) -> Planned:
        """The candidate ``plan`` writes launch files for: the fastest (predicted step time) of
        those sure to fit (a chance of ``SURE_TO_FIT`` or more), else the likeliest to fit. The
        best-ranked one may be a riskier, faster bet, which a trial settles and a launch cannot."""
        sure = [p for p in self.ranked if p.sure_to_fit]
        if sure:
            return min(sure, key=lambda p: p.perf.step_time)
        return max(self.ranked, key=lambda p: (p.chance_to_fit, -p.perf.step_time))

    @property
    def all_stacks(self) -> tuple[Stack, ...]:
        return self.stacks or (self.stack,)

    @property
    def stack_key(self) -> str:
        """What the plan is for, as a user names it: ``fsdp``, ``pipette,fsdp``."""
        return stacks_key(self.all_stacks)

    def stack_of(self, config: ParallelConfig) -> Stack:
        """The stack that runs ``config``: the one it names, else the plan's."""
        if config.stack is None:
            return self.stack
        for s in self.all_stacks:
            if s.key == config.stack:
                return s
        raise SpecError(f"names stack {config.stack!r}, not one of this plan's ({self.stack_key})",
                        field="config.stack", fix=f"use one of {self.stack_key}")

    @property
    def calibration_notes(self) -> list[str]:
        """One line per stack and device of the cluster its step-time constants were never fitted on
        (``Stack.calibration_note``)."""
        devices = {d.spec.name: d.spec for d in self.cluster.devices}
        notes = (st.calibration_note(spec) for st in self.all_stacks for spec in devices.values())
        return [n for n in notes if n]

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        ranked = self.ranked if top is None else self.ranked[:top]
        return {
            "model": self.model.to_dict(),
            "training": self.training.to_dict(),
            "cluster": {"name": self.cluster.name, "devices": self.cluster.world,
                        "nodes": len(self.cluster.nodes)},
            "stack": self.stack.to_dict(),
            **({"stacks": [st.to_dict() for st in self.stacks]} if len(self.stacks) > 1 else {}),
            "calibration_notes": self.calibration_notes,
            "safety_margin": self.margin,
            "fits_prior": self.fits_prior.to_dict() if self.fits_prior else None,
            "keep_threshold": KEEP_THRESHOLD,
            "sure_to_fit": SURE_TO_FIT,
            "enumerated": self.enumerated,
            "feasible": len(self.ranked),
            "dropped": {k: {"count": v, "reason": DROP_REASONS.get(k, k)} for k, v in self.dropped.most_common()},
            "ranked": [p.to_dict() for p in ranked],
        }


def check_recipe(model: ModelSpec, training: TrainingSpec) -> None:
    """Refuse a recipe the model cannot train, before anything is measured or planned."""
    if training.seq_len > model.max_seq:
        # Beyond its positions a model is not what it was trained as (and the trial runner
        # refuses it): planning a 1M-token step for a 4096-position model helps nobody.
        raise SpecError(
            f"is {training.seq_len}, more than the {model.max_seq} positions {model.name} has "
            "(max_position_embeddings, or the reach of its rope_scaling)",
            field="training.seq_len", fix=f"use a sequence length of at most {model.max_seq}",
        )


def make_plan(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterProfile,
    *,
    margin: float = DEFAULT_MARGIN,
    optimize_top: int = 20,
    seed: int = 0,
    constants: PerfConstants | None = None,
    memory_options: MemoryOptions | None = None,
    fits_prior: FitsPrior | None = None,
    stack: str | Stack | Sequence[str | Stack] | None = None,
) -> Plan:
    """Every candidate likely enough to fit, ranked by the step time to expect from trying it.

    ``stack``: the software that runs the job (a name such as ``megatron`` or a ``Stack``;
    default Pipette's runner): it gives the constants, the memory options and the fits prior
    unless ``constants``, ``memory_options`` or ``fits_prior`` are given, and drops the
    candidates it cannot run. Several (``pipette,fsdp`` or a list): the candidates of each,
    side by side in one ranking, each priced with its own stack and naming it
    (``ParallelConfig.stack``, in its label: ``...-1f1b-fsdp``). ``fits_prior``: the
    estimator's error for the stack and device.
    ``margin``: capacity the user keeps free (the chance to fit
    is taken against ``capacity / (1 + margin)``). Raises ``InfeasibleError`` when no candidate
    is valid (with the rejection counts) or none is likely to fit (with the shortfall of the
    closest one and what would help).
    """
    check_recipe(model, training)
    chosen_all = get_stacks(stack)
    chosen = chosen_all[0]
    several = len(chosen_all) > 1
    space = _candidates(model, training, cluster, chosen_all)
    if not space.candidates:
        raise _no_valid_candidate(model, training, cluster, space.rejected, chosen)
    dropped: Counter[str] = Counter(space.rejected)
    fitting, oom = _fitting(model, training, cluster, space, chosen_all, margin, memory_options, fits_prior)
    prior = fits_prior or chosen.fits_prior(cluster.device_spec.kind)
    dropped[OUT_OF_MEMORY] = len(oom)
    if not fitting:
        raise _nothing_fits(model, training, cluster, oom, margin, dropped)
    planned = _estimated(model, training, cluster, fitting, chosen_all, constants)
    ranked = _placed(planned, cluster, optimize_top, seed)
    oom.sort(key=lambda d: -d.chance_to_fit)
    return Plan(model, training, cluster, ranked, dropped, oom, margin, space.total, prior, chosen,
                chosen_all if several else ())


def _candidates(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile, stacks: tuple[Stack, ...]
) -> Space:
    """The valid candidates every stack of ``stacks`` runs (each naming its stack when there are
    several), and the others counted by the first rule they break."""
    several = len(stacks) > 1
    kind = cluster.device_spec.kind
    candidates: list[ParallelConfig] = []
    rejected: Counter[str] = Counter()
    for st in stacks:
        base = enumerate_space(model, training, cluster.world, sharded_pipeline=st.sharded_pipeline,
                               uneven_virtual_stages=st.uneven_virtual_stages, stack=st.name,
                               embedding_loss_split=st.embedding_loss_split)
        refuse_stack(model, st.name)  # a stack that runs no model with experts, in one line
        problems = model_problems(model, training, kind) if st.native_rules else []
        if problems and not several:
            message, where, fix = problems[0]
            also = "" if "--stack" in fix else ", or plan it with --stack megatron"
            raise SpecError(f"{message} (the {st.key} stack's candidates run on Pipette's PyTorch-native runner)",
                            field=where, fix=f"{fix}{also}")
        if problems:  # another stack may run it: this one's candidates are counted as refused
            rejected["stack_native_split"] += len(base.candidates)
            continue
        try:
            routes = routings(model, training, st.name)
        except SpecError:
            if not several:
                raise
            rejected["stack_routing"] += len(base.candidates)  # another stack of the plan may route them
            continue
        flex = flex_devices(cluster.device_spec)
        base = Space([v for c in base.candidates for v in expert_variants(model, c, st.name, routes, flex)],
                     base.rejected)
        runnable = _runnable(_stack_space(base, st, cluster), st, model, training, kind)
        rejected.update(runnable.rejected)
        candidates += [replace(c, stack=st.key) if several else c for c in runnable.candidates]
    return Space(candidates, rejected)


def _fitting(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile, space: Space, stacks: tuple[Stack, ...],
    margin: float, memory_options: MemoryOptions | None, fits_prior: FitsPrior | None,
) -> tuple[list[tuple[ParallelConfig, MemoryEstimate, float]], list[Dropped]]:
    """(the candidates likely enough to fit, with their memory estimate and chance to fit; the
    others, each as its closest try), each under its stack's memory options and fits prior."""
    kind = cluster.device_spec.kind
    fitting: list[tuple[ParallelConfig, MemoryEstimate, float]] = []
    oom: list[Dropped] = []
    for config in space.candidates:
        st = stacks[0] if config.stack is None else _named(stacks, config.stack)
        tries = [config]
        if st.offload and kind == "gpu" and config.zero_stage >= 2:
            # CPU offload as the option of last resort: its host transfers are not priced by the
            # step-time model, so it is offered only where the candidate without it is too unlikely
            # to fit (an offload twin of a fitting candidate would tie it on time and win on memory);
            # sharded candidates only: under NO_SHARD every replica would keep the whole model on its host
            tries.append(replace(config, offload=True))
        fit, closest = _fit(model, training, cluster, tries, memory_options or st.memory_options,
                            fits_prior or st.fits_prior(kind), margin)
        if fit is not None:
            fitting.append(fit)
        if closest is not None:
            oom.append(closest)
    return fitting, oom


def _fit(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile, tries: list[ParallelConfig],
    options: MemoryOptions, prior: FitsPrior, margin: float,
) -> tuple[tuple[ParallelConfig, MemoryEstimate, float] | None, Dropped | None]:
    """The first of ``tries`` likely enough to fit (its memory estimate and chance), else the last
    try as the dropped one; an offload try whose host bytes do not fit a node ends the tries."""
    capacity = cluster.min_usable_memory
    closest: Dropped | None = None
    for each in tries:
        mem = estimate_memory(model, training, each, capacity, device_kind=cluster.device_spec.kind, options=options)
        if mem.host_bytes:
            host, fits_host = _host_check(mem, cluster)
            if not fits_host and closest is not None:
                # the candidate stays out of memory: its offload twin's host bytes do not fit a node
                closest = replace(closest, memory=replace(closest.memory, notes=(*closest.memory.notes, host)))
                break
            mem = replace(mem, notes=(*mem.notes, host))
        chance = prior.chance_to_fit(mem, int(capacity / (1.0 + margin)))
        if chance >= KEEP_THRESHOLD:
            return (each, mem, chance), None
        closest = Dropped(each, mem, chance)
    return None, closest


def _estimated(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile,
    fitting: list[tuple[ParallelConfig, MemoryEstimate, float]], stacks: tuple[Stack, ...],
    constants: PerfConstants | None,
) -> list[tuple[Planned, PerfModel]]:
    """Each fitting candidate under the default placement of its degrees, with its step-time
    estimate (its stack's constants for the cluster's devices, unless ``constants``) and the step
    time to expect from trying it; best expected first."""
    kind = cluster.device_spec.kind
    placements: dict[tuple[int, ...], tuple[int, ...]] = {}
    planned: list[tuple[Planned, PerfModel]] = []
    for config, mem, chance in fitting:
        key = (config.tp, config.pp, config.dp, config.cp)
        if key not in placements:
            placements[key] = default_placement(config, cluster)
        placed = config.with_placement(placements[key])
        perf_model = PerfModel(model, training, placed, cluster,
                               constants=constants or (stacks[0] if config.stack is None else
                                                       _named(stacks, config.stack)).constants_for(kind))
        perf = perf_model.estimate()
        planned.append((Planned(placed, mem, perf, perf.step_time, chance_to_fit=chance), perf_model))
    first = _fallback([q for q, _ in planned])  # once: per candidate it made planning quadratic in them
    planned = [(_with_expectation(p, first), m) for p, m in planned]
    planned.sort(key=lambda p: _rank_key(p[0]))
    return planned


def _placed(planned: list[tuple[Planned, PerfModel]], cluster: ClusterProfile, optimize_top: int,
            seed: int) -> list[Planned]:
    """The ranking after the placement optimizer has placed the ``optimize_top`` best (the others
    keep their default placement), re-ranked by the step time to expect."""
    improved = []
    for item, perf_model in planned[:optimize_top]:
        result = optimize_placement(item.config, cluster, perf_model.step_time, seed=seed)
        placed = item.config.with_placement(result.placement)
        improved.append(
            Planned(placed, item.memory, perf_model.estimate(result.placement),
                    item.default_step_time, result.method, chance_to_fit=item.chance_to_fit)
        )
    ranked = improved + [p for p, _ in planned[optimize_top:]]
    fallback = _fallback(ranked)
    return sorted((_with_expectation(p, fallback) for p in ranked), key=_rank_key)


def _host_check(memory: MemoryEstimate, cluster: ClusterProfile) -> tuple[str, bool]:
    """Whether an offload candidate's host bytes fit every node's host memory (a node holds its
    devices' ranks), and the note that says so; a host memory the cluster does not give is said."""
    gib = memory.host_bytes / GiB
    limits = [(node.host_memory, len(cluster.devices_on(i))) for i, node in enumerate(cluster.nodes)]
    if any(host is None for host, _ in limits):
        return f"CPU offload: {gib:.1f} GiB per rank in host memory, not checked (no host_memory in the cluster)", True
    need = max(ranks for _, ranks in limits) * gib
    if any(ranks * memory.host_bytes > (host or 0) for host, ranks in limits):
        have = min(host or 0 for host, _ in limits) / GiB
        return f"with CPU offload: {need:.0f} GiB of host memory a node, more than the {have:.0f} GiB a node has", False
    return f"CPU offload: {gib:.1f} GiB per rank in host memory, {need:.0f} GiB a node (fits its host memory)", True


def _named(stacks: tuple[Stack, ...], key: str) -> Stack:
    return next(s for s in stacks if s.key == key)


def _stack_space(space: Space, stack: Stack, cluster: ClusterProfile) -> Space:
    """``space`` with the candidates only ``stack`` has: FSDP2's HSDP twin of a sharded candidate
    on a cluster of several nodes (``pipette.space.hsdp_shard``)."""
    if not stack.hsdp:
        return space
    per_node = tuple(len(cluster.devices_on(n)) for n in range(len(cluster.nodes)))
    out: list[ParallelConfig] = []
    for config in space.candidates:
        out.append(config)
        shard = hsdp_shard(config, per_node)
        if shard is not None:
            out.append(replace(config, dp_shard=shard))
    return Space(out, Counter(space.rejected))


def _runnable(space: Space, stack: Stack, model: ModelSpec | None = None, training: TrainingSpec | None = None,
              device_kind: str = "gpu") -> Space:
    """The valid candidates ``stack`` runs; the others counted by the first stack rule they break."""
    kept: list[ParallelConfig] = []
    rejected = Counter(space.rejected)
    for config in space.candidates:
        broken = stack.refusals(config, model, training, device_kind)
        if broken:
            rejected[broken[0]] += 1
        else:
            kept.append(config)
    return Space(kept, rejected)


def _fallback(planned: list[Planned]) -> float:
    """The step time of the fastest candidate sure to fit (of the likeliest to fit, if none is):
    what a user falls back to when a riskier candidate runs out of memory."""
    sure = [p.perf.step_time for p in planned if p.sure_to_fit]
    if sure:
        return min(sure)
    return min(planned, key=lambda p: (-p.chance_to_fit, p.perf.step_time)).perf.step_time


def _with_expectation(p: Planned, fallback: float) -> Planned:
    expected = expected_step_time(p.perf.step_time, p.chance_to_fit, max(fallback, p.perf.step_time))
    return replace(p, expected_step_time=expected)


def _rank_key(p: Planned) -> tuple[float, float, int, str]:
    """Best expected step time first; among equal ones the likelier to fit, then the most headroom."""
    return (p.expected_step_time, -p.chance_to_fit, p.memory.peak_bytes, p.config.label)


def _no_valid_candidate(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile, rejected: Counter[str], stack: Stack,
) -> InfeasibleError:
    counts = ", ".join(f"{DROP_REASONS[k]}: {v}" for k, v in rejected.most_common())
    top = rejected.most_common(1)[0][0] if rejected else ""
    fixes = {
        "batch_divisible": (
            "training.global_batch",
            f"use a global batch divisible by the data-parallel degree (e.g. a multiple of {cluster.world})",
        ),
        "tp_heads": ("cluster", "use a device count whose divisors match the model's heads"),
        "tp_kv_heads": ("cluster", "use a device count whose divisors match the model's heads"),
        "mbs_not_allowed": (
            "training.micro_batches", "allow micro-batch sizes that divide the global batch per replica"
        ),
        "zero_pipeline": ("training.zero_stages", "allow ZeRO 0 or 1 with pipelining"),
        "interleaved_layers": ("training.schedules", "allow the 1f1b schedule"),
        "interleaved_microbatches": ("training.schedules", "allow the 1f1b schedule"),
        "interleaved_pp": ("training.schedules", "allow the 1f1b schedule"),
    }
    if top in STACK_RULES:
        fixes[top] = ("stack", f"allow what {stack.key} runs (ZeRO {list(stack.zero_stages)}, schedules "
                               f"{list(stack.schedules)}, recompute {list(stack.recompute)}), or choose another stack")
    where, fix = fixes.get(top, ("training", "relax the recipe's limits"))
    return InfeasibleError(
        f"no configuration of {model.name} on {cluster.world} devices satisfies the recipe on stack {stack.key} "
        f"({counts})",
        field=where, fix=fix, reasons=dict(rejected),
    )


def _nothing_fits(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterProfile,
    oom: list[Dropped],
    margin: float,
    dropped: Counter[str],
) -> InfeasibleError:
    closest = min(oom, key=lambda d: d.memory.shortfall(margin))
    short = closest.memory.shortfall(margin)
    helps = []
    ratio = closest.memory.peak_bytes * (1 + margin) / closest.memory.capacity_bytes
    helps.append(f"more devices (the closest candidate needs {ratio:.1f}x the memory it has)")
    if not training.is_lora:
        helps.append("LoRA (method: lora) instead of full fine-tuning")
    if 3 not in training.zero_stages:
        helps.append("allowing ZeRO-3")
    if "full" not in training.recompute:
        helps.append("allowing full recomputation")
    if training.seq_len > 1 and closest.memory.breakdown.get("activations", 0) > short:
        helps.append("a shorter sequence length")
    kept = f" with {margin:.0%} kept free" if margin else ""
    return InfeasibleError(
        f"nothing fits: {len(oom)} candidates of {model.name} on {cluster.world} x "
        f"{cluster.device_spec.name} all exceed device memory (each under a {KEEP_THRESHOLD:.0%} chance "
        f"to fit); the closest ({closest.config.label}) needs {closest.memory.peak_bytes / GiB:.1f} GiB"
        f"{kept} of {closest.memory.capacity_bytes / GiB:.1f} GiB, short by {short / GiB:.1f} GiB",
        field="cluster", fix="try " + "; or ".join(helps),
        shortfall_bytes=short, reasons=dict(dropped),
    )
