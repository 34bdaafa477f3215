"""What the models predict for a candidate: ``MemoryEstimate`` and ``PerfEstimate``.

Both carry a breakdown a person can read; the keys are fixed so that the CLI, the API
and the dashboard show the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Breakdown keys of a MemoryEstimate, in the order they are shown.
MEMORY_PARTS: tuple[str, ...] = (
    "weights", "gradients", "optimizer", "activations", "logits", "buffers", "overhead",
)
#: Breakdown keys of a PerfEstimate, in the order they are shown.
TIME_PARTS: tuple[str, ...] = (
    "compute", "tp_comm", "pp_comm", "dp_comm", "zero3_gather", "bubble", "optimizer", "embedding_sync",
)


#: The three figures of a memory estimate (``MemoryEstimate``), one of which a stack compares with the
#: device's capacity (``MemoryOptions.capacity_figure``).
CAPACITY_FIGURES: dict[str, str] = {
    "live": "the live tensors (torch.cuda.max_memory_allocated)",
    "reserved": "the caching allocator's reserve (torch.cuda.max_memory_reserved)",
    "device-used": "the allocator's reserve + CUDA context, NCCL buffers and workspaces (what nvidia-smi shows)",
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes on the heaviest rank (the heaviest pipeline stage), as three figures: the live
    tensors (``live_bytes``, what ``torch.cuda.max_memory_allocated`` reports), the caching allocator's
    reserve (``reserved_bytes``: the live tensors, its fragmentation and short-lived blocks; on a CPU rank
    the interpreter's resident memory) and what the device shows used (``device_used_bytes``: the reserve
    and ``outside_bytes``, the CUDA context, NCCL's buffers and library workspaces, which the allocator
    never sees). ``peak_bytes`` is the figure the stack compares with the capacity (``capacity_figure``,
    a key of ``CAPACITY_FIGURES``)."""

    peak_bytes: int
    capacity_bytes: int
    breakdown: dict[str, int]
    stage: int = 0
    notes: tuple[str, ...] = field(default=())
    #: bytes of this rank held in host memory, not the device's (FSDP2's CPU offload); 0: none
    host_bytes: int = 0
    #: the device's bytes outside the caching allocator (CUDA context, NCCL buffers, workspaces)
    outside_bytes: int = 0
    #: which figure ``peak_bytes`` is
    capacity_figure: str = "reserved"

    @property
    def reserved_bytes(self) -> int:
        """The caching allocator's peak reserve."""
        return self.peak_bytes - (self.outside_bytes if self.capacity_figure == "device-used" else 0)

    @property
    def live_bytes(self) -> int:
        """The tensors alone at the peak: the reserve without the ``overhead`` part."""
        return self.reserved_bytes - self.breakdown.get("overhead", 0)

    @property
    def device_used_bytes(self) -> int:
        """What the device shows used at the peak: the reserve and the bytes outside the allocator."""
        return self.reserved_bytes + self.outside_bytes

    def figure(self, name: str) -> int:
        """One of the three figures by its name in ``CAPACITY_FIGURES``."""
        return {"live": self.live_bytes, "reserved": self.reserved_bytes, "device-used": self.device_used_bytes}[name]

    def fits(self, margin: float = 0.0) -> bool:
        """True when ``peak * (1 + margin)`` is within capacity."""
        return self.peak_bytes * (1.0 + margin) <= self.capacity_bytes

    def shortfall(self, margin: float = 0.0) -> int:
        """Bytes missing to fit (0 when it fits)."""
        return max(0, int(self.peak_bytes * (1.0 + margin)) - self.capacity_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "live_bytes": self.live_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "outside_bytes": self.outside_bytes,
            "capacity_figure": self.capacity_figure,
            "capacity_bytes": self.capacity_bytes,
            "stage": self.stage,
            "breakdown": dict(self.breakdown),
            "notes": list(self.notes),
            **({"host_bytes": self.host_bytes} if self.host_bytes else {}),
        }


@dataclass(frozen=True)
class PerfEstimate:
    """Predicted time of one optimizer step on the schedule's critical path.

    ``breakdown`` adds up to ``step_time``: each part is the exposed (not overlapped)
    time on the critical path.
    """

    step_time: float
    breakdown: dict[str, float]
    tokens_per_s: float
    #: model FLOPs utilisation: the FLOPs the step needs (``pipette.flops``: the weight
    #: gradients of what trains, no recomputation) over the devices' peak for the step time
    mfu: float
    #: hardware FLOPs utilisation: the same with the recomputation the devices also run
    hfu: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "breakdown": dict(self.breakdown),
        }
