"""Run one rank of a trial: build the model and the DeepSpeed engine for the candidate, warm
up, time steps until the step time is known well enough, and report what was measured.

Reports are JSON lines on stdout prefixed with ``EVENT_PREFIX`` (the executor reads them
as they come): ``step`` after every step, then ``done``, or ``oom`` with the bytes asked for.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from scipy import stats

from pipette.contract import OOM_EXIT, event_line
from pipette.stacks import rank_layout
from workers.phases import PHASES, Phases
from workers.rank.devices import (
    backend_for,
    collective_device,
    init_distributed,
    rank_device,
    set_matmul_precision,
    to_device,
)
from workers.rank.memory import (
    PeakTensorBytes,
    allocator_record,
    apply_memory_cap,
    oom_bytes,
    oom_where,
    peak_rss_bytes,
)
from workers.spec import TrialSpec
from workers.support import backend_name, check_runnable


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(event_line(event))
    sys.stdout.flush()


def _selective_attention() -> str:
    """Register an SDPA attention that recomputes its core in the backward pass: the
    selective recomputation of Korthikanti et al. 2022 (sec. 4.2), softmax and attention
    over values recomputed, the projections kept."""
    from torch.utils.checkpoint import checkpoint
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def selective(module: Any, q: Any, k: Any, v: Any, mask: Any, **kwargs: Any) -> Any:
        return checkpoint(sdpa_attention_forward, module, q, k, v, mask, use_reentrant=False, **kwargs)

    AttentionInterface.register("pipette_selective", selective)
    return "pipette_selective"


class Engine:
    """The DeepSpeed engine of one rank and how to run one training step on it."""

    def __init__(self, trial: TrialSpec, ds_config: dict[str, Any], rank: int, phases: Phases | None = None):
        import deepspeed

        from workers.rank.autoep import autoep_ds_config
        from workers.rank.build import build_rank_model, held_bytes
        from workers.rank.data import Batches
        from workers.rank.hf_model import TORCH_DTYPES
        from workers.rank.lora import attach_tp_lora
        from workers.rank.tp_shard import set_groups

        c, t = trial.config, trial.training
        dp_index = rank_layout(c, trial.stack).index(rank, "dp")
        self.trial, self.config = trial, c
        self.device = rank_device(trial.device_kind)
        set_matmul_precision(t.dtype, self.device)
        self.batches = Batches(trial.model.vocab, t.seq_len, c.mbs, dp_index, trial.seed, trial.data)
        # The runner shards tensor-parallel layers itself (workers.rank.tp_shard, as pipette.memory
        # counts them), inside a pipeline or not; AutoTP's block is for the user's own scripts.
        ds_config = {k: v for k, v in ds_config.items() if k != "tensor_parallel"}
        built = build_rank_model(trial, rank, self.device, TORCH_DTYPES[t.dtype], ds_config)
        module, hf, self.pipeline, self.loss_fn = built.module, built.hf, built.pipeline, built.loss_fn
        if c.recompute == "selective":
            hf.config._attn_implementation = _selective_attention()
        elif c.recompute == "full" and not self.pipeline:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tp_group: Any = None
        mpu = None
        if c.tp > 1:
            if self.pipeline:
                tp_group = module.mpu().get_slice_parallel_group()  # type: ignore[operator]
            else:
                from deepspeed.utils import groups

                # DeepSpeed sizes the batch by the data-parallel world only when it is given the
                # TP mesh (dp, tp): tp varies fastest, so TP groups are consecutive ranks, as in
                # pipette.layout's rank layout.
                groups._init_tp_mesh_device(tensor_model_parallel_size=c.tp)
                mpu = groups
                tp_group = groups.get_tensor_model_parallel_group()
                set_groups(module, tp_group, built.vocab_loss)
        if built.tp_lora:
            mine = {id(m) for m in module.modules()}  # a pipeline stage holds only its own layers
            attach_tp_lora([(parent, name) for parent, name in built.tp_lora if id(parent) in mine], tp_group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.held_bytes = held_bytes(module)
        if phases is not None:
            phases.mark("build")
        ds_config = autoep_ds_config(ds_config, t.is_lora)
        self.engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=ds_config, mpu=mpu)
        if "expert_parallel" in ds_config:  # AutoEP replaced the MoE blocks: the experts trained are its own
            params = [p for p in self.engine.module.parameters() if p.requires_grad]
        self.trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
        if torch.device(self.engine.device) != self.device:
            raise RuntimeError(f"DeepSpeed put the engine on {self.engine.device}, this rank computes on {self.device}")
        if phases is not None:
            phases.mark("engine")

    def step(self) -> float:
        """One optimizer step (all micro-batches); returns the mean loss of this replica.

        The batch goes to the engine's device first (DeepSpeed's pipeline engine moves its
        micro-batches itself); the losses stay there until the step's one read."""
        if self.pipeline:
            return float(self.engine.train_batch(data_iter=iter(self.batches)))
        total: torch.Tensor | None = None
        for _ in range(self.config.grad_accum):
            ids, labels = to_device(self.batches.next(), self.device)
            logits = self.engine(input_ids=ids).logits
            loss = self.loss_fn(logits, labels)
            self.engine.backward(loss)
            self.engine.step()
            total = loss.detach() if total is None else total + loss.detach()
        if total is None:
            raise RuntimeError("a step of no micro-batches")
        return float(total) / self.config.grad_accum


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tight(times: list[float], rel_ci: float) -> bool:
    if len(times) < 2:
        return False
    mean = statistics.fmean(times)
    half = stats.t.ppf(0.975, len(times) - 1) * statistics.stdev(times) / math.sqrt(len(times))
    return bool(half <= rel_ci * mean)


def _agree(flag: bool, compute: torch.device) -> bool:
    """Rank 0's decision, so every rank runs the same number of steps (broadcast on the
    backend's device: a CUDA tensor under NCCL)."""
    device = collective_device(dist.get_backend(), compute)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def train(trial: TrialSpec, ds_config: dict[str, Any], rank: int, report: Callable[[dict[str, Any]], None]) -> None:
    """Run the trial's steps on this rank (distributed is initialized); reports every step."""
    engine = Engine(trial, ds_config, rank, PHASES)
    gpu = engine.device.type == "cuda"
    times: list[float] = []
    #: this rank's CPU seconds in each timed step (all its threads): beside the wall time, what
    #: the machine's other load took from it
    cpu_times: list[float] = []
    losses: list[float] = []
    peak_tensor = 0
    step = 0
    while True:
        warm = step < trial.warmup_steps
        tracker = PeakTensorBytes() if step == trial.warmup_steps - 1 and not gpu else None
        _sync(engine.device)
        start = time.perf_counter()
        cpu = time.process_time()
        if tracker is not None:
            with tracker:
                loss = engine.step()
            peak_tensor = tracker.peak_bytes
        else:
            loss = engine.step()
        _sync(engine.device)
        elapsed = time.perf_counter() - start
        PHASES.mark("warmup" if warm else "steps", then="steps" if step + 1 >= trial.warmup_steps else None)
        losses.append(loss)
        if not warm:
            times.append(elapsed)
            cpu_times.append(time.process_time() - cpu)
        report({"event": "step", "rank": rank, "step": step, "time": elapsed, "loss": loss, "warmup": warm})
        step += 1
        if not warm:
            done = len(times) >= trial.max_steps or (len(times) >= trial.min_steps and _tight(times, trial.rel_ci))
            agreed = _agree(done, engine.device)
            PHASES.mark("steps")
            if agreed:
                break
    device: dict[str, Any] = {"device": str(engine.device)}
    if gpu:
        # Live tensors (what the estimator predicts) and what the caching allocator held:
        # an allocation fails on the second, so both are reported.
        peak_tensor = int(torch.cuda.max_memory_allocated(engine.device))
        props = torch.cuda.get_device_properties(engine.device)
        device |= {**allocator_record(engine.device),
                   "device_name": props.name, "device_memory_bytes": int(props.total_memory),
                   "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    PHASES.mark("end")
    report({
        "event": "done", "rank": rank, "step_times": times, "losses": losses, "phases": PHASES.seconds,
        "peak_tensor_bytes": peak_tensor, "peak_rss_bytes": peak_rss_bytes(), "step_cpu_times": cpu_times,
        "trainable_params": engine.trainable, "held_param_bytes": engine.held_bytes,
        "backend": backend_name(trial), **device,
    })


def run_rank(trial: TrialSpec, ds_config: dict[str, Any], rank: int, world: int, store: dist.Store) -> int:
    """The whole life of one rank process; returns its exit status."""
    check_runnable(trial)
    if world != trial.config.world:
        raise ValueError(f"{world} processes for a candidate of world {trial.config.world}")
    backend = backend_for(trial.device_kind)
    device = init_distributed(trial.device_kind, rank, world, store)
    PHASES.mark("rendezvous")
    from workers.ops import ensure_ops

    ensure_ops(trial.device_kind, emit)  # before DeepSpeed's comm needs its op (workers.ops)
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend)  # adopts the process group above
    PHASES.mark("ops")
    try:
        code = train_or_oom(lambda: train(trial, ds_config, rank, emit), trial, rank, device, emit)
        if code:
            return code
        dist.barrier()
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_or_oom(train: Callable[[], None], trial: TrialSpec, rank: int, device: torch.device,
                 report: Callable[[dict[str, Any]], None]) -> int:
    """Run ``train`` under the trial's memory cap; 0, or ``OOM_EXIT`` after an ``oom`` event (the
    rank, the bytes asked for, where and in which phase, the allocator's figures on a GPU) when
    memory ran out. Either runner's ranks (DeepSpeed's, the PyTorch-native one) end this way."""
    if trial.memory_cap_bytes is not None:
        apply_memory_cap(trial.memory_cap_bytes, device)
    try:
        train()
    except (RuntimeError, MemoryError) as e:
        asked = oom_bytes(e)
        if asked is None:
            raise
        allocator = allocator_record(device) if device.type == "cuda" else {}
        report({"event": "oom", "rank": rank, "bytes": asked, "where": oom_where(e), "phase": PHASES.current(),
                "error": str(e)[:2000], **allocator})
        return OOM_EXIT
    return 0
