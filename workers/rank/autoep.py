"""DeepSpeed's AutoEP beside the transformers it runs with.

DeepSpeed 0.19.8's AutoEP (deepspeed/module_inject/auto_ep_presets/base.py,
``_install_instance_transformers_output_recorders``) treats transformers' output-recorder registry
(``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``) as a plain dict of class-name keys:
``registry.get(key, default)`` and ``registry[key] = entry``. transformers 5.25's registry is a
``_CanRecordRegistry`` keyed by a model, whose ``get(model)`` takes no default, so
``deepspeed.initialize`` of a Hugging Face MoE model with ``expert_parallel`` enabled fails with
``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given`` (seen on the
2-core dev VM, 2026-12-05). ``accept_class_name_keys`` lets the registry take the class-name keys
AutoEP hands it, as well as the models transformers hands it, and does nothing where the registry
already does (another transformers) or is absent.
"""

from __future__ import annotations

import inspect
from typing import Any

#: where AutoEP finds the MoE blocks of a PEFT-wrapped Hugging Face model (``expert_parallel.moe_layer_pattern``):
#: its presets' ``model\.layers\.\d+\.mlp`` (re.fullmatch over the module names) under PEFT's two prefixes
PEFT_MOE_LAYERS = r"base_model\.model\.model\.layers\.\d+\.mlp"


def accept_class_name_keys() -> bool:
    """Make the registry take AutoEP's class-name keys; True where it was changed."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry is None or getattr(registry, "_pipette_class_name_keys", False):
        return False
    if len(inspect.signature(registry.get).parameters) > 2:
        return False  # a get(key, default): a registry AutoEP can use as it is

    def get(self: dict[str, Any], key: Any, default: Any = None) -> Any:
        if isinstance(key, str):
            return dict.get(self, key, default)
        return dict.get(self, str(key.__class__)) or {}

    def setitem(self: dict[str, Any], key: Any, value: Any) -> None:
        dict.__setitem__(self, key if isinstance(key, str) else str(key.__class__), value)

    registry.get = get
    registry.__setitem__ = setitem
    registry._pipette_class_name_keys = True
    return True


def autoep_ds_config(ds_config: dict[str, Any], lora: bool) -> dict[str, Any]:
    """``ds_config`` as AutoEP runs it on this rank (unchanged without ``expert_parallel``): the registry
    made to take its keys, and under PEFT (``lora``) the MoE blocks looked up under PEFT's prefixes."""
    if "expert_parallel" not in ds_config:
        return ds_config
    accept_class_name_keys()
    if not lora:
        return ds_config
    return {**ds_config, "expert_parallel": {**ds_config["expert_parallel"], "moe_layer_pattern": PEFT_MOE_LAYERS}}


__all__ = ["PEFT_MOE_LAYERS", "accept_class_name_keys", "autoep_ds_config"]
