"""Request bodies to the core's specs: ``ModelSpec``, ``TrainingSpec``, ``ClusterProfile``.

The core validates meaning and raises ``SpecError``s naming the field. This module adds what
a shared service needs on top: a cap on the size of a described cluster (its link matrix is
n x n), and a guard that turns any other exception of the parsers into a 422 naming the
field, so no body can make the service answer 5xx.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pipette.cluster import ClusterProfile
from pipette.clusterfile import cluster_from_dict
from pipette.errors import PipetteError, SpecError
from pipette.model import MODEL_PRESETS, ModelSpec, preset_fix
from pipette.options import defaults
from pipette.training import TrainingSpec
from pipette.tuner import TuneOptions
from service.schemas import ModelIn, TrainingIn

#: The largest cluster a what-if plan may describe: 128 nodes x 8 devices, the size the
#: planning-speed benchmark plans in about a second (docs/results.md, "Planning speed").
MAX_PLAN_DEVICES = 1024

T = TypeVar("T")


def model_spec(value: ModelIn) -> ModelSpec:
    if isinstance(value, str):
        if value.lower() not in MODEL_PRESETS:
            raise SpecError(f"unknown model preset {value!r}", field="model",
                            fix=preset_fix(value, "or the content of a config.json"))
        return ModelSpec.preset(value)
    model = _guard(lambda: ModelSpec.from_hf_config(value), "model", "give a Hugging Face config.json object")
    # The name is the one free text of a model that is stored (PostgreSQL refuses NUL in text).
    if any(ord(c) < 32 or ord(c) == 127 for c in model.name) or len(model.name) > 200:
        raise SpecError("the model's name (_name_or_path or model_type) has control characters or is too long",
                        field="model._name_or_path", fix="give a name of at most 200 printable characters")
    return model


def training_spec(value: TrainingIn) -> TrainingSpec:
    return _guard(lambda: TrainingSpec.from_dict(value.to_spec_dict()), "training", "check the recipe's fields")


def tune_options(options: dict[str, Any], used_s: float = 0.0) -> TuneOptions:
    """A job's stored budget (``BudgetIn.model_dump()``) as the tuner's options, ``used_s``
    seconds of its time budget already spent. Jobs stored before an option existed get its
    default. At submit it checks what the schema cannot (``reserve`` below ``max_trials``)."""
    values = {**defaults("tune"), **options}
    budget = values["time_budget_s"]
    if budget is not None:
        values["time_budget_s"] = max(float(budget) - used_s, 1e-3)
    return TuneOptions.from_values(values)


def cluster_file(data: dict[str, Any]) -> ClusterProfile:
    """A cluster file given as an object (either form of docs/inputs.md's "Cluster file")."""
    devices = declared_devices(data)
    if devices > MAX_PLAN_DEVICES:
        raise SpecError(
            f"describes {devices} devices; this service plans up to {MAX_PLAN_DEVICES}",
            field="cluster.nodes", fix=f"describe at most {MAX_PLAN_DEVICES} devices, or run `pipette plan` locally",
        )
    cluster = _guard(lambda: cluster_from_dict(data, default_name="what-if"), "cluster",
                     "see docs/inputs.md, Cluster file, for the two forms")
    if cluster.world > MAX_PLAN_DEVICES:
        raise SpecError(f"describes {cluster.world} devices", field="cluster.nodes",
                        fix=f"describe at most {MAX_PLAN_DEVICES} devices")
    return cluster


def declared_devices(data: dict[str, Any]) -> int:
    """How many devices a cluster file declares, counted before any matrix is built."""
    if isinstance(data.get("devices"), list):
        return len(data["devices"])
    nodes, per = data.get("nodes"), data.get("devices_per_node")
    per_count = per if isinstance(per, int) and not isinstance(per, bool) and per > 0 else 1
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        return max(nodes, 0) * per_count
    if isinstance(nodes, list):
        total = 0
        for node in nodes:
            count = node.get("devices", per_count) if isinstance(node, dict) else 1
            total += count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
        return total
    return 0


def _guard(parse: Callable[[], T], field: str, fix: str) -> T:
    try:
        return parse()
    except PipetteError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
        # The core's parsers expect the types their files hold; a JSON body can hold anything.
        raise SpecError(f"cannot read it ({type(e).__name__}: {e})", field=field, fix=fix) from None
