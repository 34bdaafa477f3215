"""Traced memory: one training step of a candidate on the PyTorch-native runner (``fsdp_rank``), run
on fake tensors at the real world size, and the live bytes of one rank by category at the step's
peak.

The same code as a trial (``FsdpRank``: the Hugging Face Llama, TP, activation checkpointing,
FSDP2, the pipeline schedule, AdamW, clipping) runs under PyTorch's own tools: a fake process
group (``torch.testing._internal.distributed.fake_pg.FakeStore``: this process is one rank of
``world``, every collective a no-op), ``FakeTensorMode`` (shapes and dtypes, no storage: an 8B
model on 8 ranks traces in about 25 s on a 2-core VM), and ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``), which counts each tensor's storage from its
allocation to its death and labels it by FSDP2's role. Two steps run; the second is traced, so the
optimizer's states exist from its start, as in every step but the first.

What it is: the live tensor bytes of this code (what ``torch.cuda.max_memory_allocated`` reports
on a GPU, less the allocator's rounding), not the allocator's reserve nor the device's use (CUDA
context, NCCL buffers). The kernels are the CPU's (its SDPA keeps what the CUDA flash kernel keeps:
the output and the log-sum-exp), so a GPU's cuBLAS workspaces are not in it.

    python -m workers.rank.fsdp_trace --candidate candidate.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipette.errors import SpecError
from workers.fsdp_spec import FsdpPlan, plan_for
from workers.spec import TrialSpec

#: the categories a trace reports, and ``FSDPMemTracker``'s reference types each gathers
#: (``MemTracker``'s where no FSDP wraps the model: the inputs are its "Other")
CATEGORIES: dict[str, tuple[str, ...]] = {
    "parameters": ("Sharded Param", "Unsharded Param", "All Gather", "Buffer", "Parameter"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs", "Other"),
    "temporaries": ("Temp",),
}
_TOTAL = "Total"


@dataclass(frozen=True)
class TracedMemory:
    """One rank's live bytes in one traced training step."""

    rank: int
    world: int
    #: the pipeline stage index of this rank's first stage
    stage: int
    #: the most bytes alive at once during the step
    peak_bytes: int
    #: CATEGORIES' bytes at that moment (they add up to ``peak_bytes``)
    at_peak: dict[str, int]
    #: each category's own most during the step (not at one moment)
    category_max: dict[str, int]
    #: the most of each of ``FSDPMemTracker``'s reference types (``Sharded Grad``, ``All Gather``, ...)
    kinds_max: dict[str, int]
    #: where the peak was: forward, backward or optimizer
    phase: str
    #: the wall time of the trace, build included
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kinds(snapshot: dict[Any, int]) -> dict[str, int]:
    """A tracker snapshot by the reference types' names (``_FSDPRefType`` values), no total."""
    return {str(getattr(k, "value", k)): v for k, v in snapshot.items() if k != _TOTAL}


def _categories(snapshot: dict[Any, int]) -> dict[str, int]:
    named = _kinds(snapshot)
    return {cat: sum(named.get(kind, 0) for kind in kinds) for cat, kinds in CATEGORIES.items()}


#: how deep this thread is in DTensor's shape propagation (``_untracked_propagation``)
_PROPAGATING = threading.local()


@contextmanager
def _untracked_propagation() -> Iterator[None]:
    """Mark DTensor's sharding propagation, which runs each op once more on fake tensors of the
    *global* shapes to learn its output's. The tracker skips it where the propagation's fake mode is
    its own (in eager), not where the step itself runs on fake tensors (here, in the same mode):
    without this, loss parallelism's log-softmax at Llama 70B tp8 was counted as 7.8 GiB of whole
    fp32 logits, where the rank holds 1/8 of them."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self: Any, op_schema: Any) -> Any:
        _PROPAGATING.depth = getattr(_PROPAGATING, "depth", 0) + 1
        try:
            return original(self, op_schema)
        finally:
            _PROPAGATING.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = marked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


class Peaks:
    """What both trackers add: the maxima and the phase of the peak, and no counting of DTensor's
    shape propagation (``_untracked_propagation``)."""

    category_max: dict[str, int]
    kinds_max: dict[str, int]
    peak_phase: str

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(_PROPAGATING, "depth", 0):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    def _note(self, tracker: Any, before: dict[Any, int]) -> None:
        if tracker._peak_mem != before:
            self.peak_phase = "optimizer" if tracker._in_opt else ("backward" if tracker._mod_tracker.is_bw
                                                                   else "forward")
        for snap in tracker._curr_mem_snap.values():
            for cat, value in _categories(snap).items():
                self.category_max[cat] = max(self.category_max.get(cat, 0), value)
            for kind, value in _kinds(snap).items():
                self.kinds_max[kind] = max(self.kinds_max.get(kind, 0), value)


def _step_tracker(stages: list[nn.Module], optimizer: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...]) -> Any:
    """A tracker of one step that keeps each category's own maximum and where the peak was:
    ``FSDPMemTracker`` over all of this rank's stages (allowing a module's forward once per
    micro-batch), or ``MemTracker`` where no FSDP wraps the model (one rank in fp32)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    class FsdpStepTracker(Peaks, FSDPMemTracker):  # type: ignore[no-untyped-call]  # torch's class is unannotated
        def __init__(self) -> None:
            super().__init__(stages[0], optimizer)
            # the interleaved schedule's stages are several FSDP roots: one container instruments them all
            self._root_mod = nn.ModuleList(stages) if len(stages) > 1 else stages[0]  # type: ignore[assignment]
            self.category_max, self.kinds_max, self.peak_phase = {}, {}, "forward"
            self.track_inputs(inputs)

        def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args: Any, **kwargs: Any) -> Any:
                # the next micro-batch's forward: FSDPMemTracker refuses a root's second forward
                # (it keeps per-module stats of one iteration); only the rank's peak is read here
                if fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                    del self.memory_tracking[fsdp_mod]
                return inner(*args, **kwargs)

            return again

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            self._note(self, before)

    class PlainStepTracker(Peaks, MemTracker):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()
            self.category_max, self.kinds_max, self.peak_phase = {}, {}, "forward"
            self.track_external(*stages, optimizer, *inputs)

        def _pre_fw_hook(self, module: nn.Module, args: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]  # the next micro-batch's forward (as FsdpStepTracker's)
            super()._pre_fw_hook(module, args)

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            self._note(self, before)

    return FsdpStepTracker() if isinstance(stages[0], FSDPModule) else PlainStepTracker()


def stage_shapes(trial: TrialSpec, plan: FsdpPlan, device: torch.device) -> Any:
    """Each pipeline stage's input and output, as ``LlamaStage`` passes them: token ids into the
    first, hidden states in the compute dtype between stages (this rank's part of the sequence under
    TP's sequence parallelism), the logits out of the last; under context parallelism all of them
    hold the cp rank's ``seq_len / cp`` tokens."""
    from workers.rank.hf_model import TORCH_DTYPES

    t, m = trial.training, trial.model
    dtype = TORCH_DTYPES[plan.dtype]
    seq = t.seq_len // plan.cp
    shape = (plan.mbs, seq // plan.tp, m.hidden)

    def hidden() -> torch.Tensor:
        # requires grad: the stage sends its input's gradient back and receives its output's
        return torch.empty(shape, dtype=dtype, device=device, requires_grad=True)

    def shapes(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.zeros(plan.mbs, seq, dtype=torch.long, device=device) if index == 0 else hidden()
        outputs = (torch.empty(plan.mbs, seq, m.vocab, dtype=dtype, device=device, requires_grad=True)
                   if index == plan.stages - 1 else hidden())
        return inputs, outputs

    return shapes


@contextmanager
def _real_device_meshes() -> Iterator[None]:
    """Device meshes made during the trace (FSDP2 joins the dp and tp meshes of a TP-sharded
    parameter) computed on real tensors: a mesh finds this rank's coordinates with ``nonzero``,
    whose output shape a fake tensor cannot know."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


def _static_pipeline(schedule: Any) -> None:
    """Skip the schedule's first-step vote over the pipeline (a tensor each stage sends its
    neighbour, read with ``item``): every stage of a trace was given its shapes (``stage_shapes``),
    which is the vote's static outcome."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


def _fake_world(world: int, rank: int) -> None:
    """This process as ``rank`` of a fake process group of ``world`` (a previous trace's ended)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def trace_rank(trial: TrialSpec, rank: int = 0) -> TracedMemory:
    """Trace one step of ``trial`` as rank ``rank`` of its world (``trial.config.world``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    from workers.rank.fsdp_model import meta_model
    from workers.rank.fsdp_rank import FsdpRank

    start = time.perf_counter()
    world = trial.config.world
    if not 0 <= rank < world:
        raise SpecError(f"rank {rank} is not in a world of {world}", field="rank", fix=f"give 0..{world - 1}")
    if trial.model.moe is not None:  # its all-to-all's split sizes are read from the routing: values
        raise SpecError(f"{trial.model.name} is a Mixture-of-Experts model: its token exchange's sizes come from "
                        "the router's choices, which fake tensors do not have", field="model",
                        fix="run a trial of the candidate to measure its memory")
    trial = replace(trial, device_kind="cpu")  # fake tensors on the host: no device is needed
    plan = plan_for(trial.model, trial.training, trial.config, "cpu", world)
    _fake_world(world, rank)
    try:
        mesh = init_device_mesh("cpu", plan.mesh.sizes, mesh_dim_names=plan.mesh.names)
        meta = meta_model(trial.model, trial.training)  # PEFT cannot add its adapters to fake tensors
        device = torch.device("cpu")
        with FakeTensorMode(allow_non_fake_inputs=True), _real_device_meshes():
            shapes = stage_shapes(trial, plan, device) if plan.pp > 1 else None
            runner = FsdpRank(trial, plan, rank, mesh=mesh, stage_shapes=shapes, meta=meta)
            if runner.schedule is not None:
                _static_pipeline(runner.schedule)
            with unset_fake_temporarily():  # the batch's tokens are drawn for real (a seeded generator)
                first, second = runner.batches.next(), runner.batches.next()
            runner.train_step(*first)  # the first step makes the optimizer's states
            ids, labels = second
            tracker = _step_tracker(list(runner.stages), runner.optimizer, (ids, labels))
            with tracker, _untracked_propagation():
                runner.train_step(ids, labels)
        peak = tracker.get_tracker_snapshot("peak")
        snap = next(iter(peak.values()), {_TOTAL: 0})
        return TracedMemory(
            rank=rank, world=world, stage=runner.stage_ids[0], peak_bytes=int(snap[_TOTAL]),
            at_peak=_categories(snap), category_max=dict(tracker.category_max), kinds_max=dict(tracker.kinds_max),
            phase=tracker.peak_phase,
            seconds=time.perf_counter() - start,
        )
    finally:
        dist.destroy_process_group()


def stage_ranks(trial: TrialSpec) -> list[int]:
    """One rank of each pipeline stage (its first): the ranks of one stage hold equal shards."""
    per_stage = trial.config.world // trial.config.pp
    return [i * per_stage for i in range(trial.config.pp)]


def trace_heaviest(trial: TrialSpec) -> list[TracedMemory]:
    """A trace of one rank per pipeline stage, heaviest first."""
    traces = [trace_rank(trial, r) for r in stage_ranks(trial)]
    return sorted(traces, key=lambda t: -t.peak_bytes)


def describe(trace: TracedMemory) -> str:
    """One line a person reads: the rank, its peak and the categories at the peak, in GiB."""
    unit, size = ("GiB", 1024**3) if trace.peak_bytes >= 1024**3 else ("MiB", 1024**2)
    parts = ", ".join(f"{k} {v / size:.2f}" for k, v in trace.at_peak.items())
    return (f"rank {trace.rank} of {trace.world} (stage {trace.stage}): live peak {trace.peak_bytes / size:.2f} {unit} "
            f"in the {trace.phase} ({parts}); traced in {trace.seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    from workers.rank.fsdp import read_candidate

    parser = argparse.ArgumentParser(prog="workers.rank.fsdp_trace", description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", required=True, help="candidate.json (as a trial or `pipette tune` writes it)")
    parser.add_argument("--rank", type=int, help="trace this rank only (default: one rank of each pipeline stage)")
    parser.add_argument("--json", help="write the traces here too")
    args = parser.parse_args(argv)
    trial = read_candidate(args.candidate)
    traces = [trace_rank(trial, args.rank)] if args.rank is not None else trace_heaviest(trial)
    print("live tensor bytes of this code on fake devices (not the allocator's reserve):")
    for trace in traces:
        print("  " + describe(trace))
    if args.json:
        Path(args.json).write_text(json.dumps([t.to_dict() for t in traces], indent=2))
    return 0


if __name__ == "__main__":
    from pipette.errors import PipetteError

    try:
        raise SystemExit(main())
    except PipetteError as e:
        print(f"pipette: {e}", file=sys.stderr)
        raise SystemExit(2) from None
