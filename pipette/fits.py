"""The fits boundary: a candidate's chance to fit in device memory, not a yes/no.

The memory estimator (``pipette.memory``) predicts a peak; what a trial needs of the device
differs from it by an error that is measured per stack on calibration runs. With
``e = log(needed / predicted peak)`` distributed ``N(mu, sd^2)`` for the stack (a log-normal
error, fitted by maximum likelihood with the runs that ran out of memory as right-censored
observations, ``e > log(capacity / predicted)``: Tobin 1958), the chance that a candidate fits
a device of ``capacity`` bytes is

    p_fit = Phi((log(capacity / predicted) - mu) / sd)

"Needed" is what the device must hold: the caching allocator's reserved bytes plus the memory
outside it (the CUDA context, library workspaces) on a GPU; the process's resident set on a
CPU device. How each prior was fitted, and how it scores on runs it was not fitted on, is in
docs/models.md ("The fits boundary"); ``tests/benchmarks/fits_boundary.py`` refits and checks.

The plan keeps every candidate with ``p_fit >= KEEP_THRESHOLD`` and ranks by the expected
step time of trying it (``expected_step_time``); ``SURE_TO_FIT`` is the chance above which a
candidate is shown as sure to fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipette.errors import SpecError
from pipette.estimates import MemoryEstimate

#: A candidate whose chance to fit is below this is dropped from the plan.
KEEP_THRESHOLD = 0.02
#: At or above this chance a candidate is called sure to fit.
SURE_TO_FIT = 0.9
#: What an out-of-memory trial costs, in step times of the candidate it falls back to. Chosen,
#: not fitted: such a trial ends at its first failing allocation, well before a full trial's time
#: (the H100's OOM trials: docs/results.md, "The chance to fit: each stack's prior").
FAILED_TRIAL_COST = 0.05


@dataclass(frozen=True)
class FitsPrior:
    """The estimator's error ``log(needed / predicted peak)`` for one stack and device kind."""

    name: str
    mu: float
    sd: float
    #: the calibration runs it was fitted on, for the output and docs/models.md
    source: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and math.isfinite(self.sd) and self.sd > 0):
            raise SpecError(f"mu {self.mu!r}, sd {self.sd!r}", field="fits_prior",
                            fix="give a finite mean and a positive sd of the log error")

    def chance_to_fit(self, memory: MemoryEstimate, capacity_bytes: int | None = None) -> float:
        """The chance that the candidate's need is within ``capacity_bytes`` (default: the
        estimate's own capacity)."""
        capacity = memory.capacity_bytes if capacity_bytes is None else capacity_bytes
        if memory.peak_bytes <= 0:
            return 1.0
        if capacity <= 0:
            return 0.0
        z = (math.log(capacity / memory.peak_bytes) - self.mu) / self.sd
        return 0.5 * math.erfc(-z / math.sqrt(2.0))

    def headroom_bytes(self, memory: MemoryEstimate) -> int:
        """Capacity less the expected need (``peak * exp(mu)``): negative when it is expected short."""
        return int(memory.capacity_bytes - memory.peak_bytes * math.exp(self.mu))

    def to_dict(self) -> dict[str, float | str]:
        return {"name": self.name, "mu": self.mu, "sd": self.sd, "source": self.source}


#: Pipette's own runner (DeepSpeed + Hugging Face Llama, bf16) on a GPU. Fitted on the
#: ``h100_single_gpu.csv`` runs re-run with the allocator's figures on an H100 (9 ran and 4 out of
#: memory); checked on the Llama-3-8B LoRA allocator table (docs/models.md). Fitted on the device-used
#: figure it is compared on (reserve + CUDA context + NCCL buffers, ``memory_options.capacity_figure``);
#: its earlier fits: docs/results.md, "The chance to fit: each stack's prior".
PIPETTE_GPU = FitsPrior("pipette-gpu", mu=-0.055, sd=0.100,
                        source="h100_single_gpu.csv re-run, reserved + outside the allocator, H100 2026-11-23")
#: nanotron (the Ultra-Scale H100 set: rank 0's logged peak against the nanotron stack's estimate,
#: ``NANOTRON_OPTIONS``; 1620 runs that ran), fitted by ``fits_boundary.py --fit``. Each prior's
#: earlier fits: docs/results.md, "The chance to fit: each stack's prior".
NANOTRON_GPU = FitsPrior("nanotron-gpu", mu=0.060, sd=0.180, source="ultrascale_h100_1b_3b_8b.csv, 1620 runs")
#: Megatron-LM (SimuMax's B200 runs: peak reserved, max over ranks, against the megatron stack's
#: estimate; 24 runs with memory, none out of memory; fitted by ``fits_boundary.py --fit``). One
#: set of one framework's runs (Llama3 70B and 405B shapes, 8 B200s): until a second Megatron-LM
#: set with memory is in, its sd is in-sample. Fitted on the estimate with Megatron-Core's fused SwiGLU
#: and the allocator's reserve as a share of the live bytes (``memory_options.MEGATRON_RESERVED_SHARE``);
#: checked on Megatron-Bridge's runs, which ran and give no memory figure. Its earlier fits: docs/results.md.
MEGATRON_GPU = FitsPrior("megatron-gpu", mu=-0.003, sd=0.038,
                         source="simumax_b200_megatron.csv, 24 runs (peak reserved, 2026-12-04)")
#: PyTorch FSDP2 (torchtitan's H100 runs: peak reserved, max over ranks, against the estimate
#: with the ``fsdp`` stack's options; 14 runs with memory, none out of memory), fitted by
#: ``fits_boundary.py --fit`` on the estimate as it is now (per-op recomputation, FSDP2 under
#: pipelining with every unit's fp32 accumulators, the compiled loss, DTensor TP, the reserve over
#: FSDP2's phases: ``pipette.memory_fsdp2.reserve``). The fsdp stack's fragmentation factors were
#: fitted on 4 of these 14 runs, so the sd is partly in-sample. Its earlier fits: docs/results.md,
#: "The chance to fit: each stack's prior".
FSDP_GPU = FitsPrior("fsdp-gpu", mu=0.033, sd=0.035,
                     source="torchtitan_h100_fsdp2.csv, 14 runs (FSDP2's phases, the embedding's whole "
                            "gradient under TP, reserved, 2026-12-05)")
#: CPU devices: no calibration runs (the runner's RSS is recorded by every CPU trial); the
#: learned memory model's default prior (``pipette.feasibility``), centred.
CPU = FitsPrior("cpu", mu=0.0, sd=0.226, source="no calibration runs: the learned model's default prior")

PRIORS = {p.name: p for p in (PIPETTE_GPU, NANOTRON_GPU, MEGATRON_GPU, FSDP_GPU, CPU)}


def default_prior(device_kind: str) -> FitsPrior:
    """The prior of Pipette's own runner on ``device_kind``."""
    return CPU if device_kind == "cpu" else PIPETTE_GPU


def memory_headroom(memory: MemoryEstimate, prior: FitsPrior, measured_need: int | None = None) -> dict[str, Any]:
    """How close to the memory limit a configuration runs, for the emitted files: what it needs
    (measured by its trial when there was one, else the estimate times ``exp(mu)``), the
    capacity, and the headroom in bytes and as a fraction of the capacity."""
    capacity = memory.capacity_bytes
    need = measured_need if measured_need else int(memory.peak_bytes * math.exp(prior.mu))
    free = capacity - need
    gib = 1024**3
    basis = "measured by its trial" if measured_need else "predicted"
    text = (f"needs {need / gib:.1f} GiB of {capacity / gib:.1f} GiB ({basis}): "
            + (f"{free / gib:.1f} GiB ({free / capacity:.0%}) free" if free >= 0 else
               f"{-free / gib:.1f} GiB ({-free / capacity:.0%}) short"))
    return {"need_bytes": need, "capacity_bytes": capacity, "headroom_bytes": free,
            "headroom_fraction": free / capacity if capacity else 0.0, "basis": basis,
            "chance_to_fit": prior.chance_to_fit(memory), "text": text}


def expected_step_time(step_time: float, p_fit: float, fallback_step_time: float) -> float:
    """The step time one can expect from choosing to try this candidate: its own when it fits,
    else the fallback's (the best sure candidate) after an out-of-memory trial's cost."""
    return p_fit * step_time + (1.0 - p_fit) * fallback_step_time * (1.0 + FAILED_TRIAL_COST)


__all__ = [
    "CPU", "FAILED_TRIAL_COST", "FSDP_GPU", "KEEP_THRESHOLD", "MEGATRON_GPU", "NANOTRON_GPU", "PIPETTE_GPU", "PRIORS",
    "SURE_TO_FIT",
    "FitsPrior", "default_prior", "expected_step_time", "memory_headroom",
]
