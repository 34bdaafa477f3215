"""Planning: enumerate, drop what does not fit, rank by predicted step time, place.

``make_plan`` is the what-if answer of the core (``pipette plan``, ``POST /v1/plan``) and
the first step of every tuning job: the data flow of DESIGN.md up to the search.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError, SpecError
from pipette.estimates import MemoryEstimate, PerfEstimate
from pipette.memory import DEFAULT_OPTIONS, SAFETY_MARGIN, MemoryOptions, estimate_memory
from pipette.model import ModelSpec
from pipette.perf import PerfConstants, PerfModel
from pipette.placement import default_placement, optimize_placement
from pipette.space import RULES, enumerate_space
from pipette.training import TrainingSpec

OUT_OF_MEMORY = "out_of_memory"
DROP_REASONS: dict[str, str] = {**RULES, OUT_OF_MEMORY: "predicted to run out of device memory"}

GiB = 1024**3


@dataclass(frozen=True)
class Planned:
    """A feasible candidate with its estimates, under its chosen placement."""

    config: ParallelConfig
    memory: MemoryEstimate
    perf: PerfEstimate
    default_step_time: float
    placement_method: str = "default"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label,
            "config": self.config.to_dict(),
            "memory": self.memory.to_dict(),
            "perf": self.perf.to_dict(),
            "default_placement_step_time": self.default_step_time,
            "placement_method": self.placement_method,
        }


@dataclass(frozen=True)
class Dropped:
    """A candidate predicted not to fit, with its estimate (the plan keeps them)."""

    config: ParallelConfig
    memory: MemoryEstimate

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label,
            "config": self.config.to_dict(),
            "reason": OUT_OF_MEMORY,
            "memory": self.memory.to_dict(),
        }


@dataclass
class Plan:
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterProfile
    ranked: list[Planned]
    dropped: Counter[str]
    out_of_memory: list[Dropped] = field(default_factory=list)
    margin: float = SAFETY_MARGIN
    enumerated: int = 0

    @property
    def best(self) -> Planned:
        return self.ranked[0]

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        ranked = self.ranked if top is None else self.ranked[:top]
        return {
            "model": self.model.to_dict(),
            "training": self.training.to_dict(),
            "cluster": {"name": self.cluster.name, "devices": self.cluster.world,
                        "nodes": len(self.cluster.nodes)},
            "safety_margin": self.margin,
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
            "(max_position_embeddings)",
            field="training.seq_len", fix=f"use a sequence length of at most {model.max_seq}",
        )


def make_plan(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterProfile,
    *,
    margin: float = SAFETY_MARGIN,
    optimize_top: int = 20,
    seed: int = 0,
    constants: PerfConstants | None = None,
    memory_options: MemoryOptions = DEFAULT_OPTIONS,
) -> Plan:
    """Every memory-feasible candidate, ranked by predicted step time.

    Raises ``InfeasibleError`` when no candidate is valid (with the rejection counts) or
    none fits (with the shortfall of the closest one and what would help).
    """
    check_recipe(model, training)
    space = enumerate_space(model, training, cluster.world)
    if not space.candidates:
        raise _no_valid_candidate(model, training, cluster, space.rejected)
    capacity = cluster.min_usable_memory
    kind = cluster.device_spec.kind
    dropped: Counter[str] = Counter(space.rejected)
    fitting: list[tuple[ParallelConfig, MemoryEstimate]] = []
    oom: list[Dropped] = []
    for config in space.candidates:
        mem = estimate_memory(model, training, config, capacity, device_kind=kind, options=memory_options)
        if mem.fits(margin):
            fitting.append((config, mem))
        else:
            oom.append(Dropped(config, mem))
    dropped[OUT_OF_MEMORY] = len(oom)
    if not fitting:
        raise _nothing_fits(model, training, cluster, oom, margin, dropped)

    placements: dict[tuple[int, int, int], tuple[int, ...]] = {}
    planned: list[tuple[Planned, PerfModel]] = []
    for config, mem in fitting:
        key = (config.tp, config.pp, config.dp)
        if key not in placements:
            placements[key] = default_placement(config, cluster)
        placed = config.with_placement(placements[key])
        perf_model = PerfModel(model, training, placed, cluster, constants=constants)
        perf = perf_model.estimate()
        planned.append((Planned(placed, mem, perf, perf.step_time), perf_model))
    planned.sort(key=lambda p: _rank_key(p[0]))

    improved = []
    for item, perf_model in planned[:optimize_top]:
        result = optimize_placement(item.config, cluster, perf_model.step_time, seed=seed)
        placed = item.config.with_placement(result.placement)
        improved.append(
            Planned(placed, item.memory, perf_model.estimate(result.placement),
                    item.default_step_time, result.method)
        )
    ranked = improved + [p for p, _ in planned[optimize_top:]]
    ranked.sort(key=_rank_key)
    oom.sort(key=lambda d: d.memory.shortfall(margin))
    return Plan(model, training, cluster, ranked, dropped, oom, margin, space.total)


def _rank_key(p: Planned) -> tuple[float, int, str]:
    """Fastest first; among equally fast ones the one with the most memory headroom."""
    return (p.perf.step_time, p.memory.peak_bytes, p.config.label)


def _no_valid_candidate(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterProfile, rejected: Counter[str]
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
    where, fix = fixes.get(top, ("training", "relax the recipe's limits"))
    return InfeasibleError(
        f"no configuration of {model.name} on {cluster.world} devices satisfies the recipe ({counts})",
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
    return InfeasibleError(
        f"nothing fits: {len(oom)} candidates of {model.name} on {cluster.world} x "
        f"{cluster.device_spec.name} all exceed device memory; the closest "
        f"({closest.config.label}) needs {closest.memory.peak_bytes / GiB:.1f} GiB "
        f"+{margin:.0%} margin of {closest.memory.capacity_bytes / GiB:.1f} GiB, "
        f"short by {short / GiB:.1f} GiB",
        field="cluster", fix="try " + "; or ".join(helps),
        shortfall_bytes=short, reasons=dict(dropped),
    )
