"""``TrainingSpec``: the recipe (batch, sequence, precision, optimizer, full or LoRA)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from pipette.errors import SpecError
from pipette.routing import parse_routing

#: The training precision. ``bf16`` and ``fp16`` are mixed precision (low-precision weights, activations
#: and gradients for the compute, an fp32 master copy for the optimizer); ``fp32`` trains in fp32 with
#: fp32 matmuls; ``tf32`` trains in fp32 too (fp32 weights, activations, gradients and states: the
#: same memory as ``fp32``) with its matmuls on TF32 tensor cores (PyTorch's
#: ``torch.set_float32_matmul_precision("high")``, HF ``TrainingArguments(tf32=True)``), which NVIDIA
#: GPUs have since Ampere; a device without them (a CPU, V100, T4) runs ``tf32`` as ``fp32``.
Dtype = Literal["bf16", "fp16", "fp32", "tf32"]
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "tf32")
#: The mixed-precision dtypes (an fp32 master copy beside the low-precision weights).
MIXED_DTYPES: tuple[str, ...] = ("bf16", "fp16")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd")
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved")

#: Bytes per element of each dtype.
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}

#: Default LoRA targets: every attention projection (the MLPerf Llama-2-70B LoRA recipe).
DEFAULT_LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


@dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters (Hu et al. 2021): W + (alpha / r) B A on each target module."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise SpecError(
                f"must be a positive integer, got {self.rank!r}",
                field="training.lora.rank",
                fix="use a rank such as 8, 16 or 64",
            )
        if not self.alpha > 0:
            raise SpecError(
                f"must be positive, got {self.alpha!r}", field="training.lora.alpha",
                fix="use an alpha such as 2 x rank",
            )
        if not self.targets:
            raise SpecError(
                "no target modules", field="training.lora.targets",
                fix=f"name some of {', '.join(LORA_TARGETS)}",
            )
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise SpecError(
                f"unknown target module(s) {', '.join(bad)}",
                field="training.lora.targets",
                fix=f"use names from {', '.join(LORA_TARGETS)}",
            )


@dataclass(frozen=True)
class TrainingSpec:
    """What to train and how: the search space is built inside these limits.

    ``recompute``, ``zero_stages``, ``schedules`` and ``micro_batches`` are the options
    the user allows; ``micro_batches=()`` means every power of two that divides the
    per-replica batch.
    """

    global_batch: int
    seq_len: int
    dtype: Dtype = "bf16"
    optimizer: str = "adamw"
    method: Literal["full", "lora"] = "full"
    lora: LoraSpec | None = None
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = SCHEDULES
    micro_batches: tuple[int, ...] = ()
    max_virtual_stages: int = 4
    #: an MoE model's routings the search may plan (``pipette.routing``): ``dropless`` and capacity factors
    #: (``1.0``, ``cf1.25``); dropping tokens changes what the model learns, so the search plans only what is
    #: listed here; empty: the model's own routing alone
    moe_routing: tuple[str, ...] = ()
    #: packed sequences: the documents packed into each sequence hold about this many tokens (the
    #: token-weighted mean, E[L^2] / E[L]), and a stack whose attention keeps to each document
    #: (``PerfConstants.varlen_attention``) attends over them alone; None: one document a sequence
    document_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "max_virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(
                    f"must be a positive integer, got {value!r}",
                    field=f"training.{name}",
                    fix="give a whole number of at least 1",
                )
        _one_of("training.dtype", self.dtype, DTYPES)
        _one_of("training.optimizer", self.optimizer, OPTIMIZERS)
        _one_of("training.method", self.method, ("full", "lora"))
        if self.method == "lora" and self.lora is None:
            object.__setattr__(self, "lora", LoraSpec())
        if self.method == "full" and self.lora is not None:
            raise SpecError(
                "LoRA settings given but method is 'full'",
                field="training.lora",
                fix="set method: lora, or drop the lora block",
            )
        _subset("training.recompute", self.recompute, RECOMPUTE_MODES)
        _subset("training.zero_stages", self.zero_stages, (0, 1, 2, 3))
        _subset("training.schedules", self.schedules, SCHEDULES)
        routings = tuple(parse_routing(r) for r in self.moe_routing)
        if len(set(routings)) != len(routings):
            raise SpecError(f"lists a routing twice: {list(self.moe_routing)}", field="training.moe_routing",
                            fix="give each routing once (1 and cf1 are the same capacity factor)")
        object.__setattr__(self, "moe_routing", routings)
        d = self.document_len
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= self.seq_len):
            raise SpecError(f"must be a whole number from 1 to seq_len ({self.seq_len}), got {d!r}",
                            field="training.document_len",
                            fix="give the packed documents' length in tokens, or leave it out (one a sequence)")
        for m in self.micro_batches:
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise SpecError(
                    f"micro-batch sizes must be positive integers, got {m!r}",
                    field="training.micro_batches",
                    fix="list sizes such as [1, 2, 4]",
                )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def mixed_precision(self) -> bool:
        """Whether the dtype is mixed precision (bf16, fp16); fp32 and tf32 keep fp32 everywhere."""
        return self.dtype in MIXED_DTYPES

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def attention_span(self) -> int:
        """The keys a query's document holds: ``document_len`` for packed sequences, else ``seq_len``."""
        return self.document_len if self.document_len is not None else self.seq_len

    @property
    def is_lora(self) -> bool:
        return self.method == "lora"

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["lora"] = None if self.lora is None else {
            "rank": self.lora.rank, "alpha": self.lora.alpha, "targets": list(self.lora.targets)
        }
        for key in ("recompute", "zero_stages", "schedules", "micro_batches", "moe_routing"):
            out[key] = list(out[key])
        if self.document_len is None:
            del out["document_len"]  # unpacked jobs keep the keys (and job keys) they had
        if not self.moe_routing:
            del out["moe_routing"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(
                f"unknown key(s) {', '.join(unknown)}",
                field="training",
                fix=f"use only {', '.join(sorted(known))}",
            )
        # The values given are checked first (with stand-ins for the missing required ones), so
        # a wrong one is reported before a missing one.
        missing = [r for r in ("global_batch", "seq_len") if r not in data]
        kwargs = {**dict.fromkeys(missing, 1), **data}
        lora = kwargs.pop("lora", None)
        if lora is not None:
            if not isinstance(lora, dict):
                raise SpecError(
                    "must be a mapping", field="training.lora", fix="give rank, alpha, targets"
                )
            bad = sorted(set(lora) - {"rank", "alpha", "targets"})
            if bad:
                raise SpecError(
                    f"unknown key(s) {', '.join(bad)}", field="training.lora",
                    fix="use only rank, alpha, targets",
                )
            if "targets" in lora:
                lora = {**lora, "targets": tuple(lora["targets"])}
            kwargs["lora"] = LoraSpec(**lora)
        for key in ("recompute", "zero_stages", "schedules", "micro_batches", "moe_routing"):
            if key in kwargs:
                value = kwargs[key]
                kwargs[key] = tuple(value) if isinstance(value, list | tuple) else (value,)
        spec = cls(**kwargs)
        if missing:
            raise SpecError("is required", field=f"training.{missing[0]}",
                            fix=f"give training.{missing[0]} (a positive integer)")
        return spec


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(f"unknown value {value!r}", field=name, fix=f"use one of {', '.join(allowed)}")


def _subset(name: str, values: tuple[Any, ...], allowed: tuple[Any, ...]) -> None:
    if not values:
        raise SpecError("allows nothing", field=name, fix=f"allow some of {allowed}")
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SpecError(
            f"unknown value(s) {', '.join(map(repr, bad))}",
            field=name,
            fix=f"use values from {', '.join(map(str, allowed))}",
        )


__all__ = ["DTYPES", "DTYPE_BYTES", "LoraSpec", "TrainingSpec"]
