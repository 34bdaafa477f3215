"""LoRA adapters (Hu et al. 2021): ``y = W x + (alpha / r) B A x``, with B zero at start.

Without tensor parallelism PEFT does it. Under AutoTP, PEFT's adapters are lost: AutoTP
replaces each sharded ``nn.Linear``. So the adapters here are sharding-aware and live
beside the layer they adapt, added to its output by a forward hook:

* column-parallel layer (output sharded: q, k, v, gate, up): A is whole, B holds this
  rank's output rows. ``h = A x`` is the same on every rank, but each rank's gradient of
  ``h`` is only its shard's share, so ``h`` passes through ``copy_to_tp`` (identity
  forward, all-reduce backward), as Megatron-LM's ``f`` operator (Shoeybi et al. 2019).
* row-parallel layer (input sharded, output all-reduced: o, down): A holds this rank's
  input columns, B is whole. ``h = A_local x_local`` is a partial sum, completed by
  ``reduce_from_tp`` (all-reduce forward, identity backward): Megatron-LM's ``g``.

The adapters are created before DeepSpeed builds its optimizer (so they are trained,
partitioned under ZeRO like any other parameter) with the shard shapes AutoTP will use;
``attach_tp_lora`` checks those shapes against the sharded layers.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from pipette.errors import PipetteError
from pipette.training import LoraSpec

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron-LM's ``f``: identity forward, all-reduce of the gradient over ``group``."""
    out: torch.Tensor = _CopyToTP.apply(x, group)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return out


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron-LM's ``g``: all-reduce forward over ``group``, identity backward."""
    out: torch.Tensor = _ReduceFromTP.apply(x, group)  # type: ignore[no-untyped-call]
    return out


class TPLoraAdapter(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, kind: str):
        super().__init__()
        self.kind = kind
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's initialization
        self.group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x, self.lora_A.to(x.dtype))
        h = copy_to_tp(h, self.group) if self.kind == "column" else reduce_from_tp(h, self.group)
        out: torch.Tensor = nn.functional.linear(h, self.lora_B.to(x.dtype)) * self.scale
        return out


def add_peft_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    # PEFT annotates lora_alpha as int, but scales by lora_alpha / r in floating point.
    alpha = cast(int, lora.alpha)
    config = LoraConfig(r=lora.rank, lora_alpha=alpha, target_modules=list(lora.targets), lora_dropout=0.0)
    return get_peft_model(model, config)


def add_tp_lora(model: nn.Module, lora: LoraSpec, tp: int, tp_index: int = 0) -> list[tuple[nn.Module, str]]:
    """Freeze the base, add sharded adapters beside each target; returns (parent, name) pairs.

    The adapters are created where the layer's weight is (the meta device while the model is
    being built) and tagged with the PEFT name and the part of it this rank holds, so their
    initial values equal an unsharded PEFT build's (``workers.rank.init``)."""
    for p in model.parameters():
        p.requires_grad_(False)
    added = []
    for parent_name, parent in list(model.named_modules()):
        for name in lora.targets:
            linear = getattr(parent, name, None)
            if not isinstance(linear, nn.Linear):
                continue
            kind = "column" if name in COLUMN else "row"
            fan_in, fan_out = linear.in_features, linear.out_features
            if (fan_out if kind == "column" else fan_in) % tp:
                raise PipetteError(f"{name} width is not divisible by tp={tp}", field="config.tp", fix="lower tp")
            shape = (fan_in, fan_out // tp) if kind == "column" else (fan_in // tp, fan_out)
            with torch.device(linear.weight.device):
                adapter = TPLoraAdapter(*shape, lora.rank, lora.alpha, kind)
            prefix = f"{parent_name}.{name}" if parent_name else name
            a, b = adapter.lora_A, adapter.lora_B
            a.pipette_name, a.pipette_full_shape = f"{prefix}.lora_A.default.weight", (lora.rank, fan_in)  # type: ignore[attr-defined]
            b.pipette_name, b.pipette_full_shape = f"{prefix}.lora_B.default.weight", (fan_out, lora.rank)  # type: ignore[attr-defined]
            if kind == "column":
                b.pipette_rows = (tp_index * shape[1], (tp_index + 1) * shape[1])  # type: ignore[attr-defined]
            else:
                a.pipette_cols = (tp_index * shape[0], (tp_index + 1) * shape[0])  # type: ignore[attr-defined]
            parent.add_module(f"{name}_lora", adapter)
            added.append((parent, name))
    return added


def attach_tp_lora(added: list[tuple[nn.Module, str]], group: Any) -> None:
    """After AutoTP has sharded the layers: hook each adapter onto its (replaced) layer."""
    for parent, name in added:
        adapter = getattr(parent, f"{name}_lora")
        adapter.group = group
        layer = getattr(parent, name)
        weight = layer.weight
        local_out, local_in = weight.ds_shape if hasattr(weight, "ds_shape") else weight.shape
        want = (adapter.lora_A.shape[1], adapter.lora_B.shape[0])
        if hasattr(adapter.lora_A, "ds_shape"):
            want = (adapter.lora_A.ds_shape[1], adapter.lora_B.ds_shape[0])
        if (local_in, local_out) != want:
            raise PipetteError(
                f"AutoTP sharded {name} to {local_in}x{local_out}, the adapter expects {want[0]}x{want[1]}",
                field="config.tp", fix="use a tp that divides the heads and the MLP width evenly",
            )

        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor, adapter: nn.Module = adapter) -> Any:
            return output + adapter(args[0])

        layer.register_forward_hook(hook)
