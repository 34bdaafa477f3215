"""Job files: YAML (or JSON) holding exactly what ``POST /v1/jobs`` takes.

    cluster: local                 # a registered cluster's name or id
    model: tiny-llama              # a preset, a path to a Hugging Face config.json, or its content
    training: {global_batch: 4, seq_len: 32, method: lora}
    budget: {max_trials: 2}
    name: my first job
    stack: pipette                 # optional: pipette (default), hf-deepspeed, ...; several: [pipette, fsdp]

The file is only read and parsed here; the service checks every field and answers with the
field's name and the fix, so the CLI and the API can never disagree on what is valid.
``--set budget.max_trials=4`` overrides one value (the value is read as YAML).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from pipette.errors import SpecError
from pipette.textfile import parse_yaml, read_text

TOP_LEVEL = ("cluster", "model", "training", "budget", "name", "script", "stack")


def load_job_file(path: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    file = Path(path)
    text = read_text(file, "job file", "job file", "give the path of a job YAML file (see examples/jobs/)")
    data = parse_yaml(text, path, "job file", "fix the syntax (indent with spaces; quote values that contain ': ')")
    if not isinstance(data, dict):
        raise SpecError(f"{path} does not hold a mapping", field="job file",
                        fix="write key: value pairs: cluster, model, training, budget, name (see examples/jobs/)")
    for item in overrides:
        apply_override(data, item)
    model = data.get("model")
    if isinstance(model, str) and model.endswith(".json"):
        data["model"] = _read_hf_config(file.parent / model if not Path(model).is_absolute() else Path(model))
    if isinstance(data.get("script"), dict):
        data["script"] = _script_body(data["script"], file.parent)
    if isinstance(data.get("stack"), list):  # stack: [pipette, fsdp]: several side by side, as the API's
        data["stack"] = ",".join(str(s) for s in data["stack"])
    return data


def _script_body(script: dict[str, Any], base: Path) -> dict[str, Any]:
    """The job's ``script`` as the API takes it: ``workdir`` (relative to the job file) sent as
    ``files`` (zipped, base64), a ``base_config`` path read as JSON."""
    import base64

    out = dict(script)
    workdir = out.pop("workdir", None)
    if workdir is not None:
        from workers.host.workdir import pack

        folder = base / str(workdir) if not Path(str(workdir)).is_absolute() else Path(str(workdir))
        out["files"] = base64.b64encode(pack(folder)).decode()
    config = out.get("base_config")
    if isinstance(config, str):
        path = base / config if not Path(config).is_absolute() else Path(config)
        try:
            out["base_config"] = json.loads(read_text(path, "script.base_config", "a DeepSpeed config"))
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} is not JSON ({e.msg} at line {e.lineno})", field="script.base_config",
                            fix="give a DeepSpeed config file (JSON)") from None
    return out


def apply_override(data: dict[str, Any], item: str) -> None:
    """``a.b=value``: set ``data["a"]["b"]`` to ``value`` read as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"{item!r} is not KEY=VALUE", field="--set", fix="write e.g. --set budget.max_trials=4")
    parts = [p for p in key.strip().split(".") if p]
    if parts[0] not in TOP_LEVEL:
        raise SpecError(f"{parts[0]!r} is not a job field", field="--set", fix=f"use one of {', '.join(TOP_LEVEL)}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _read_hf_config(path: Path) -> dict[str, Any]:
    # Bounded like every file the CLI reads: a 1 MiB+ config made the service reset the
    # connection ("cannot reach the service"), a deeply nested one a RecursionError traceback.
    text = read_text(path, "model", "config.json", "give a preset name or the path of a Hugging Face config.json")
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})", field="model",
                        fix="give a Hugging Face config.json") from None
    except RecursionError:
        raise SpecError(f"{path} is nested too deeply to read (about 1000 levels)", field="model",
                        fix="give a Hugging Face config.json (a flat object of numbers)") from None
    if not isinstance(loaded, dict):
        raise SpecError(f"{path} does not hold an object", field="model", fix="give a Hugging Face config.json")
    return loaded
