"""Run one rank of a trial: build the model and the DeepSpeed engine for the candidate, warm
up, time steps until the step time is known well enough, and report what was measured.

Reports are JSON lines on stdout prefixed with ``EVENT_PREFIX`` (the executor reads them
as they come): ``step`` after every step, then ``done``, or ``oom`` with the bytes asked for.
"""

from __future__ import annotations

import json
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

from pipette.config import ParallelConfig
from workers.memory import PeakTensorBytes, apply_memory_cap, oom_bytes, peak_rss_bytes
from workers.spec import TrialSpec
from workers.support import backend_name, check_runnable

EVENT_PREFIX = "@@pipette "
OOM_EXIT = 3


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
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

    def __init__(self, trial: TrialSpec, ds_config: dict[str, Any], rank: int):
        import deepspeed

        from workers.data import Batches
        from workers.hf_model import build_llama
        from workers.lora import add_peft_lora, add_tp_lora, attach_tp_lora
        from workers.pipe_model import lm_loss, pipeline_module

        c, t = trial.config, trial.training
        _, dp_index, _ = c.coords(rank)
        self.trial, self.config = trial, c
        self.batches = Batches(trial.model.vocab, t.seq_len, c.mbs, dp_index, trial.seed, trial.data)
        self.loss_fn = lm_loss
        model = build_llama(trial.model, seed=trial.seed, checkpoint=trial.checkpoint)
        if c.recompute == "selective":
            model.config._attn_implementation = _selective_attention()
        hf: Any = model
        added: list[Any] = []
        tp_group: Any = None
        module: Any = model
        if t.is_lora and t.lora is not None:
            if c.tp > 1:
                added = add_tp_lora(model, t.lora, c.tp)
            else:
                module = add_peft_lora(model, t.lora)
                hf = module.base_model.model
        self.pipeline = c.pp > 1
        if self.pipeline:
            module = pipeline_module(hf, c.pp, c.dp, c.tp, recompute_layers=c.recompute == "full")
            if c.tp > 1:
                from workers.tp_shard import shard_layers

                grid = module.mpu()
                tp_group = grid.get_slice_parallel_group()
                shard_layers(module, c.tp, grid.get_slice_parallel_rank(), tp_group)
                ds_config = {k: v for k, v in ds_config.items() if k != "tensor_parallel"}
        elif c.recompute == "full":
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in module.parameters() if p.requires_grad]
        mpu = None
        if c.tp > 1 and not self.pipeline:
            from deepspeed.utils import groups

            # DeepSpeed sizes the batch by the data-parallel world only when it is given the
            # TP mesh (dp, tp): tp varies fastest, so TP groups are consecutive ranks, as in
            # pipette.config's rank layout.
            groups._init_tp_mesh_device(tensor_model_parallel_size=c.tp)
            mpu = groups
        self.engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=ds_config, mpu=mpu)
        if added:
            from deepspeed.utils import groups

            mine = {id(m) for m in module.modules()}  # a pipeline stage holds only its own layers
            added = [(parent, name) for parent, name in added if id(parent) in mine]

            attach_tp_lora(added, tp_group if self.pipeline else groups.get_tensor_model_parallel_group())
        self.trainable = sum(p.numel() for p in params)

    def step(self) -> float:
        """One optimizer step (all micro-batches); returns the mean loss of this replica."""
        if self.pipeline:
            return float(self.engine.train_batch(data_iter=iter(self.batches)))
        losses = []
        for _ in range(self.config.grad_accum):
            ids, labels = self.batches.next()
            logits = self.engine(input_ids=ids).logits
            loss = self.loss_fn(logits, labels)
            self.engine.backward(loss)
            self.engine.step()
            losses.append(float(loss.detach()))
        return sum(losses) / len(losses)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _tight(times: list[float], rel_ci: float) -> bool:
    if len(times) < 2:
        return False
    mean = statistics.fmean(times)
    half = stats.t.ppf(0.975, len(times) - 1) * statistics.stdev(times) / math.sqrt(len(times))
    return bool(half <= rel_ci * mean)


def _agree(flag: bool) -> bool:
    """Rank 0's decision, so every rank runs the same number of steps."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.broadcast(t, src=0)
    return bool(t.item())


def train(trial: TrialSpec, ds_config: dict[str, Any], rank: int, report: Callable[[dict[str, Any]], None]) -> None:
    """Run the trial's steps on this rank (distributed is initialized); reports every step."""
    engine = Engine(trial, ds_config, rank)
    times: list[float] = []
    losses: list[float] = []
    peak_tensor = 0
    step = 0
    while True:
        warm = step < trial.warmup_steps
        tracker = PeakTensorBytes() if step == trial.warmup_steps - 1 and trial.device_kind == "cpu" else None
        _sync()
        start = time.perf_counter()
        if tracker is not None:
            with tracker:
                loss = engine.step()
            peak_tensor = tracker.peak_bytes
        else:
            loss = engine.step()
        _sync()
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if not warm:
            times.append(elapsed)
        report({"event": "step", "rank": rank, "step": step, "time": elapsed, "loss": loss, "warmup": warm})
        step += 1
        if not warm:
            done = len(times) >= trial.max_steps or (len(times) >= trial.min_steps and _tight(times, trial.rel_ci))
            if _agree(done):
                break
    if torch.cuda.is_available():
        peak_tensor = int(torch.cuda.max_memory_allocated())
    report({
        "event": "done", "rank": rank, "step_times": times, "losses": losses,
        "peak_tensor_bytes": peak_tensor, "peak_rss_bytes": peak_rss_bytes(),
        "trainable_params": engine.trainable, "backend": backend_name(trial),
    })


def run_rank(trial: TrialSpec, ds_config: dict[str, Any], rank: int, world: int, store: dist.Store) -> int:
    """The whole life of one rank process; returns its exit status."""
    check_runnable(trial)
    if world != trial.config.world:
        raise ValueError(f"{world} processes for a candidate of world {trial.config.world}")
    backend = "nccl" if trial.device_kind == "gpu" else "gloo"
    if trial.device_kind == "gpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend)  # adopts the process group above
    try:
        if trial.memory_cap_bytes is not None and trial.device_kind == "cpu":
            apply_memory_cap(trial.memory_cap_bytes)
        try:
            train(trial, ds_config, rank, emit)
        except (RuntimeError, MemoryError) as e:
            asked = oom_bytes(e)
            if asked is None:
                raise
            emit({"event": "oom", "rank": rank, "bytes": asked, "error": str(e)[:2000]})
            return OOM_EXIT
        dist.barrier()
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def layout(config: ParallelConfig, rank: int) -> dict[str, int]:
    pp, dp, tp = config.coords(rank)
    return {"pp": pp, "dp": dp, "tp": tp}
