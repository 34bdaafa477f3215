"""One rank of a PyTorch-native trial: the Hugging Face Llama under FSDP2, tensor and pipeline
parallelism on a ``DeviceMesh``, composed as torchtitan composes them, trained with AdamW
(the process's entry is ``workers.rank.fsdp``).

The events are the DeepSpeed runner's (``workers.rank.trial``): ``phase``, ``step`` after each step on
every rank, ``done`` per rank with the same fields (``backend`` names the parallelisms), or
``oom`` with the bytes asked for.

What a rank does, in torchtitan's order (``torchtitan/train.py``): the mesh (pp, dp_replicate,
dp_shard, tp; ``workers.fsdp_spec``); the model on the meta device with PEFT's LoRA (an MoE
model's layers with their experts: ``moe_layer.moe_options``); its pipeline stages
(``fsdp_model``); under expert parallelism each stage keeps its ep rank's block of experts
(``moe_layer.shard_experts`` over the expert mesh's ep group); TP, activation checkpointing and
FSDP2 on each (``fsdp_parallel``); values for what it holds; AdamW on its shards; the pipeline
schedule (``fsdp_pipeline``). Each step trains on the same global batch every candidate of the job sees
(``fsdp_data``), and reports the mean loss over the whole global batch.

Under context parallelism (cp > 1) the stages' attention runs over the cp ring
(``context_parallel``, after ``build_stages``): the cp ranks of a replica read its rows, each keeps
its ``2 cp``-chunk part of every sequence (labels shifted on the whole sequence first) with RoPE at
the global positions; FSDP2 shards over ``dp_shard x cp`` (``FsdpPlan.shard_cp``), or, under
NO_SHARD, the rank averages its gradients over cp (``average_over_cp``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipette.routing import routed
from pipette.training import MIXED_DTYPES
from workers.fsdp_spec import FsdpPlan, plan_for
from workers.phases import PHASES, Phases
from workers.rank.context_parallel import ContextParallel, apply_context_parallel
from workers.rank.devices import (
    backend_for,
    collective_device,
    init_distributed,
    rank_device,
    set_matmul_precision,
)
from workers.rank.fsdp_data import GlobalBatches, micro_batches
from workers.rank.fsdp_model import (
    MetaModel,
    build_stages,
    held_param_bytes,
    lm_loss,
    loss_context,
    materialize,
    meta_model,
    parameter_names,
)
from workers.rank.fsdp_parallel import parallelize
from workers.rank.fsdp_pipeline import StageShapes, pipeline_schedule, pipeline_step
from workers.rank.memory import (
    PeakTensorBytes,
    allocator_record,
    peak_rss_bytes,
)
from workers.rank.moe_layer import MoeFeedForward, moe_options, shard_experts
from workers.rank.trial import _agree, _tight, emit, train_or_oom
from workers.spec import TrialSpec

#: the gradient norm clipped to: ``pipette.emit``'s DeepSpeed config (``gradient_clipping``)
GRAD_CLIP = 1.0
Report = Callable[[dict[str, Any]], None]


def backend_name(trial: TrialSpec, plan: FsdpPlan) -> str:
    """The parallelisms a trial ran, e.g. ``fsdp2-full-shard+tp-sp+pp-1f1b+ac-full+peft-lora``."""
    shard = plan.dp_shard * (plan.cp if plan.shard_cp else 1)  # FSDP2's shard ranks: dp_shard x cp under shard_cp
    if plan.dp_replicate * shard == 1:
        mode = "one-rank"  # fully_shard on one rank: its mixed precision or offload
    elif plan.dp_replicate > 1 and shard > 1:
        mode = f"hsdp{plan.dp_replicate}x{shard}"
    elif shard == 1:
        mode = "replicate"
    else:
        mode = "full-shard" if plan.reshard_after_forward else "no-reshard"
    parts = [f"fsdp2-{mode}" if plan.fsdp else "torch"]
    if trial.model.moe is not None:
        parts.append(f"moe-ep{plan.ep}")
    if plan.tp > 1:
        parts.append("tp-sp")
    if plan.cp > 1:
        parts.append(f"cp{plan.cp}-{plan.cp_kind}")
    if plan.pp > 1:
        parts.append(f"pp-{plan.schedule}" + (f"{plan.stages_per_rank}" if plan.schedule == "interleaved" else ""))
    parts += [f"ac-{plan.recompute}"] if plan.recompute != "none" else []
    parts += ["cpu-offload"] if plan.offload else []
    parts += [f"mp-{plan.dtype}"] if plan.dtype in MIXED_DTYPES else []
    parts += ["peft-lora"] if trial.training.is_lora else []
    return "+".join(parts)


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads``, DTensors reduced over their mesh (``full_tensor``)."""
    from torch.distributed.tensor import DTensor

    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: Any, ep_group: Any = None,
                   experts: frozenset[int] = frozenset()) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient: DTensor norms are reduced over their mesh
    (``full_tensor``), then the stages' squares summed over the pipeline (torchtitan's
    ``dist_utils.clip_grad_norm_``). Under expert parallelism (``ep_group``) the experts' gradients
    (``experts``: their ids) are DTensors of another mesh and each ep rank holds other experts: their
    squares are summed over the ep group and added to the rest's (torchtitan's
    ``_clip_grad_norm_with_ep``)."""
    if ep_group is None:
        experts = frozenset()  # one mesh for all: the experts are FSDP2's units of their layers
    grads = [p.grad for p in params if p.grad is not None and id(p) not in experts]
    total = _norm(grads)
    if ep_group is not None:
        mine = [p.grad for p in params if p.grad is not None and id(p) in experts]
        squares = _norm(mine) ** 2 if mine else torch.zeros((), device=total.device)
        dist.all_reduce(squares, group=ep_group)
        total = (total**2 + squares.to(total.device)).sqrt()
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    # one call per mesh: a foreach op takes the DTensors of one mesh (torchtitan clips the two apart)
    for group in ([p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]):
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def average_over_cp(params: list[nn.Parameter], cp_group: Any, cp: int) -> None:
    """Average the gradients over the cp group, in one all-reduce, where FSDP does not (cp ranks
    holding whole replicas, NO_SHARD): each cp rank's gradient is that of its tokens' mean loss
    (its ring's backward brought back its keys' and values' part of the others'), so their mean
    is the gradient of the mean loss over the whole sequence."""
    from torch.distributed.tensor import DTensor

    grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=cp_group)  # gloo has no ReduceOp.AVG
    flat /= cp
    for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


@dataclass(frozen=True)
class RankDevices:
    """Where one rank's tensors live: ``workers.rank.devices``' rule, with FSDP2's offload."""

    #: the forward and backward, the batch, the pipeline's messages, the values drawn at build
    compute: torch.device
    #: where ``to_empty`` puts the sharded parameters: the host under CPU offload (torchtitan's
    #: ``init_device``), else the compute device
    init: torch.device
    #: the tensors of this runner's own collectives (the loss, the step agreement)
    collective: torch.device


def rank_devices(device_kind: str, offload: bool) -> RankDevices:
    """The devices of a rank of ``device_kind`` (pure: the GPU answers are tested on a CPU)."""
    compute = rank_device(device_kind)
    init = torch.device("cpu") if offload else compute
    return RankDevices(compute, init, collective_device(backend_for(device_kind), compute))


class FsdpRank:
    """This rank's share of the model, its optimizer and pipeline schedule, and one step."""

    def __init__(self, trial: TrialSpec, plan: FsdpPlan, rank: int, phases: Phases | None = None,
                 mesh: Any = None, stage_shapes: StageShapes | None = None, meta: MetaModel | None = None):
        """``mesh`` and ``meta`` (the model on the meta device): made here when None (a memory trace,
        ``workers.rank.fsdp_trace``, makes them outside its fake tensor mode); ``stage_shapes``: the
        pipeline stages' input and output tensors, which the schedule otherwise learns from its
        neighbours at the first step."""
        from torch.distributed.device_mesh import init_device_mesh

        t = trial.training
        self.trial, self.plan = trial, plan
        self.devices = rank_devices(trial.device_kind, plan.offload)
        self.device = self.devices.compute
        set_matmul_precision(t.dtype, self.device)
        self.mesh = mesh if mesh is not None else init_device_mesh(self.device.type, plan.mesh.sizes,
                                                                   mesh_dim_names=plan.mesh.names)
        self.expert_mesh = None if plan.ep == 1 else init_device_mesh(
            self.device.type, plan.expert_mesh.sizes, mesh_dim_names=plan.expert_mesh.names)
        self.ep_group = None if self.expert_mesh is None else self.expert_mesh.get_group("ep")
        # cp > 1: ring attention over the cp mesh dimension (workers.rank.context_parallel)
        self.context = None if plan.cp == 1 else ContextParallel(
            plan.cp_kind, self.mesh["cp"], t.seq_len)  # type: ignore[arg-type]
        self.batches = GlobalBatches(trial.model.vocab, t.seq_len, t.global_batch, plan.dp,
                                     plan.mesh.index(rank, "dp"), trial.seed, trial.data,
                                     None if self.context is None else self.context.shard)
        experts = moe_options(routed(trial.model, trial.config.routing))  # the candidate's routing, else the model's
        meta = meta if meta is not None else meta_model(trial.model, t, moe=experts)
        self.stage_ids = plan.stage_ids(plan.mesh.index(rank, "pp"))
        self.stages = build_stages(meta, self.stage_ids, plan.stages, t.seq_len)
        for stage in self.stages:
            if self.context is not None:
                apply_context_parallel(stage, self.context)
            names = parameter_names(stage)
            if self.ep_group is not None:
                shard_experts(stage, self.ep_group)
            parallelize(stage, self.mesh, plan, self.device, names, self.expert_mesh)
            materialize(stage, names, self.devices.compute, self.devices.init, trial.seed, meta.std, trial.checkpoint)
        self.params = [p for s in self.stages for p in s.parameters() if p.requires_grad]
        self.experts = frozenset(id(p) for m in self._moe_layers() for p in m.experts.parameters())
        # each ep rank holds an equal block of every layer's experts: the model's count is ep blocks
        self.trainable = sum(p.numel() * (plan.ep if id(p) in self.experts else 1) for p in self.params)
        for moe in self._moe_layers():
            # Megatron-Core's MoEAuxLossAutoScaler scale: the loop below averages its micro-batches'
            # losses by dividing each by their number; a pipeline schedule divides the gradients
            # themselves (scale_grads), so the load-balancing loss gets 1 there
            moe.aux_loss_scale = 1.0 / plan.microbatches if plan.pp == 1 else 1.0
        self.held_bytes = held_param_bytes(list(self.stages))
        if phases is not None:
            phases.mark("build")
        self.optimizer = torch.optim.AdamW(self.params, lr=trial.lr, weight_decay=0.0)
        self.pp_group = self.mesh["pp"].get_group() if plan.pp > 1 else None
        self.cp_group = self.mesh["cp"].get_group() if plan.cp_grad_average else None
        self.schedule: Any = None
        self.grad_norm = 0.0
        if plan.pp > 1:
            self.schedule = pipeline_schedule(list(self.stages), self.stage_ids, plan, self.device, self.pp_group,
                                              lm_loss, stage_shapes)
        if phases is not None:
            phases.mark("engine")

    def _moe_layers(self) -> list[MoeFeedForward]:
        return [m for s in self.stages for m in s.modules() if isinstance(m, MoeFeedForward)]

    def step(self) -> float:
        """One optimizer step over the replica's rows; returns the mean loss of the whole global
        batch (every replica's, averaged: one all-reduce, the step's one read), and keeps the
        gradient's norm before clipping (``grad_norm``): AdamW with clipping hides a gradient
        scaled by a constant from the losses, not from the norm."""
        ids, labels = (t.to(self.device) for t in self.batches.next())
        mine, norm = self.train_step(ids, labels)
        # the last stage's ranks hold the loss; each of their dp x cp x tp ranks adds its replica's
        # (a cp rank: the mean over its part of the sequence, the same number of tokens on each)
        held = mine.detach() if mine is not None else torch.zeros(())
        # under CPU offload the norm of the (host) gradients is on the host, the loss on the GPU
        out = torch.stack([t.float().to(self.devices.collective) for t in (held, norm.detach())])
        dist.all_reduce(out)
        self.grad_norm = float(out[1]) / self.plan.world  # every rank holds the whole norm
        return float(out[0]) / (self.plan.dp * self.plan.cp * self.plan.tp)

    def _forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        if self.schedule is not None:
            return pipeline_step(self.schedule, self.stage_ids, self.plan, ids, labels)
        total = torch.zeros((), device=self.device)
        for mb_ids, mb_labels in micro_batches(ids, labels, self.plan.mbs):
            loss = lm_loss(self.stages[0](mb_ids), mb_labels)
            torch.autograd.backward(loss / self.plan.microbatches)
            total += loss.detach()
        return total / self.plan.microbatches

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's forward, backward, clipping and optimizer update on the replica's rows, with
        no read of a value (so a fake tensor mode can trace it): (this rank's mean micro-batch loss,
        None off the last pipeline stage; the gradient's norm before clipping)."""
        with loss_context(self.plan.tp):
            mine = self._forward_backward(ids, labels)
        if self.cp_group is not None:
            average_over_cp(self.params, self.cp_group, self.plan.cp)
        norm = clip_grad_norm(self.params, GRAD_CLIP, self.pp_group, self.ep_group, self.experts)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mine, norm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(runner: FsdpRank, track: bool) -> tuple[float, float, float, int]:
    """(loss, wall seconds, CPU seconds, peak tensor bytes when tracked) of one step."""
    _sync(runner.device)
    start, cpu = time.perf_counter(), time.process_time()
    peak = 0
    if track:
        with PeakTensorBytes() as tracker:
            loss = runner.step()
        peak = tracker.peak_bytes
    else:
        loss = runner.step()
    _sync(runner.device)
    return loss, time.perf_counter() - start, time.process_time() - cpu, peak


def train(trial: TrialSpec, plan: FsdpPlan, rank: int, report: Report, phases: Phases = PHASES) -> None:
    """Run the trial's steps on this rank (distributed is initialized): warm-up, then timed steps
    until the mean is known to ``rel_ci`` or ``max_steps`` (``workers.rank.trial.train``'s rule)."""
    runner = FsdpRank(trial, plan, rank, phases)
    gpu = runner.device.type == "cuda"
    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[float] = []
    grad_norms: list[float] = []
    peak_tensor, step = 0, 0
    while True:
        warm = step < trial.warmup_steps
        track = step == trial.warmup_steps - 1 and not gpu
        loss, elapsed, cpu, peak = _timed_step(runner, track)
        peak_tensor = peak if track else peak_tensor
        phases.mark("warmup" if warm else "steps", then="steps" if step + 1 >= trial.warmup_steps else None)
        losses.append(loss)
        grad_norms.append(runner.grad_norm)
        if not warm:
            times.append(elapsed)
            cpu_times.append(cpu)
        report({"event": "step", "rank": rank, "step": step, "time": elapsed, "loss": loss, "warmup": warm})
        step += 1
        if not warm:
            done = len(times) >= trial.max_steps or (len(times) >= trial.min_steps and _tight(times, trial.rel_ci))
            if _agree(done, runner.device):
                break
    device = _device_record(runner.device) if gpu else {"device": str(runner.device)}
    peak_tensor = int(torch.cuda.max_memory_allocated(runner.device)) if gpu else peak_tensor
    phases.mark("end")
    report({
        "event": "done", "rank": rank, "step_times": times, "losses": losses, "phases": phases.seconds,
        "peak_tensor_bytes": peak_tensor, "peak_rss_bytes": peak_rss_bytes(), "step_cpu_times": cpu_times,
        "trainable_params": runner.trainable, "held_param_bytes": runner.held_bytes,
        "backend": backend_name(trial, plan), "grad_norms": grad_norms, **device,
    })


def _device_record(device: torch.device) -> dict[str, Any]:
    """A GPU rank's device and what its caching allocator held (``workers.rank.trial.train``'s fields)."""
    props = torch.cuda.get_device_properties(device)
    return {"device": str(device), **allocator_record(device), "device_name": props.name,
            "device_memory_bytes": int(props.total_memory), "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def run_rank(trial: TrialSpec, rank: int, world: int, store: dist.Store) -> int:
    """The whole life of one rank process; returns its exit status."""
    plan = plan_for(trial.model, trial.training, trial.config, trial.device_kind, world)
    device = init_distributed(trial.device_kind, rank, world, store, host_collectives=plan.offload)
    PHASES.mark("rendezvous")
    PHASES.mark("ops")  # no op to build: nothing of DeepSpeed's here
    try:
        status = train_or_oom(lambda: train(trial, plan, rank, emit), trial, rank, device, emit)
        if status == 0:
            dist.barrier()
        return status
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
