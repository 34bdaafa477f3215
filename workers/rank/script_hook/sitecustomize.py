"""Loaded first by a script trial's Python (``PYTHONPATH``): times a script that does not use
``pipette.report`` from its DeepSpeed engine, and stops it once the trial has its steps.

When ``deepspeed.utils.timer`` is imported, ``ThroughputTimer.stop`` (called by
``DeepSpeedEngine.step`` after every micro-step) is wrapped: at each optimizer-step boundary it
writes a ``ds_step`` event with the wall time since the last boundary and DeepSpeed's own
synchronized forward-backward-step time (``ThroughputTimer``'s, once it times: from its
``start_step``) and the global batch DeepSpeed runs. A script that reports through
``pipette.report`` is timed by that instead (the executor prefers it); one that does not is
ended here, every rank at the same step, once the trial has its warm-up and timed steps.

Outside a trial (no ``PIPETTE_TRIAL``) it does nothing. Any other ``sitecustomize`` on the
path (a distribution's) still runs: this one loads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _contract() -> Any:
    """``pipette.contract``, loaded by its path: this runs before the script's own imports, in
    whatever Python the script uses, so it imports no package (pipette's ``__init__`` included)."""
    path = os.path.join(_HERE, os.pardir, os.pardir, os.pardir, "pipette", "contract.py")
    spec = importlib.util.spec_from_file_location("_pipette_contract", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"pipette's contract is not at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_event_line = _contract().event_line


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if any."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:  # a broken distribution hook must not fail the trial
            pass


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(_event_line(event))
    sys.stdout.flush()


def _reporting() -> bool:
    report = sys.modules.get("pipette.report")
    return bool(report is not None and getattr(report, "REPORTING", False))


class _Steps:
    def __init__(self, trial: dict[str, Any]) -> None:
        self.total = int(trial.get("warmup_steps", 0)) + int(trial.get("timed_steps", 0))
        self.warmup = int(trial.get("warmup_steps", 0))
        self.rank = int(os.environ.get("RANK", "0"))
        self.step = 0
        self.last = time.perf_counter()
        self.times: list[float] = []

    def boundary(self, timer: Any, ds_seconds: float | None) -> None:
        now = time.perf_counter()
        wall, self.last = now - self.last, now
        warm = self.step < self.warmup
        if not warm:
            self.times.append(wall)
        _emit({"event": "ds_step", "rank": self.rank, "step": self.step, "time": wall, "ds_time": ds_seconds,
               "warmup": warm, "samples": int(getattr(timer, "batch_size", 0) or 0)})
        self.step += 1
        if self.step >= self.total and not _reporting():
            self.done(exit_now=True)

    def done(self, exit_now: bool) -> None:
        peak = None
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = int(torch.cuda.max_memory_allocated())
        _emit({"event": "ds_done", "rank": self.rank, "steps": self.step, "step_times": self.times,
               "peak_memory_bytes": peak,
               "peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024})
        if exit_now:
            sys.stderr.flush()
            os._exit(0)  # every rank ends at this same step; nothing collective is left


def _patch(module: Any, steps: _Steps) -> None:
    timer_class = module.ThroughputTimer
    original = timer_class.stop

    def stop(self: Any, global_step: bool = False, report_speed: bool = True) -> Any:
        before = float(getattr(self, "total_elapsed_time", 0.0))
        result = original(self, global_step=global_step, report_speed=report_speed)
        acc = getattr(self, "_pipette_seconds", 0.0) + float(getattr(self, "total_elapsed_time", 0.0)) - before
        if global_step:
            self._pipette_seconds = 0.0
            steps.boundary(self, acc if acc > 0 else None)
        else:
            self._pipette_seconds = acc
        return result

    timer_class.stop = stop


def _patch_engine(module: Any) -> None:
    """Say which ZeRO stage each DeepSpeed engine the script builds runs: a script that drops
    the candidate's config (Accelerate on CPU with ``use_cpu`` builds no engine at all) measured
    another configuration than the candidate's, unseen (issue 32, item 10)."""
    engine_class = module.DeepSpeedEngine
    original = engine_class.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            stage: int | None = int(self.zero_optimization_stage())
        except Exception:  # an engine of another DeepSpeed version: say nothing rather than fail
            stage = None
        try:
            micro: int | None = int(self.train_micro_batch_size_per_gpu())
        except Exception:  # likewise
            micro = None
        _emit({"event": "ds_engine", "rank": int(os.environ.get("RANK", "0")), "zero_stage": stage,
               "micro_batch": micro})

    engine_class.__init__ = init


def _patch_fully_shard(module: Any) -> None:
    """Say how each FSDP2 ``fully_shard`` call of the script shards (one event a call: the host
    compares most calls, the decoder layers', with the candidate):
    an FSDP script that drops the candidate's settings (Accelerate on CPU drops its FSDP plugin)
    measured another configuration than the candidate's, unseen. ``functools.wraps`` keeps the
    ``state`` accessor ``@contract`` hangs on the function (torch calls ``fully_shard.state``)."""
    import functools

    original = module.fully_shard

    @functools.wraps(original)
    def fully_shard(target: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(target, *args, **kwargs)
        try:
            reshard = kwargs.get("reshard_after_forward")
            offload = type(kwargs.get("offload_policy")).__name__ == "CPUOffloadPolicy"
            mesh = kwargs.get("mesh")
            shape = list(mesh.shape) if mesh is not None else None
            unit = type(target).__name__ if not isinstance(target, list) else "list"
        except Exception:  # a fully_shard of another torch version: say nothing rather than fail
            return result
        _emit({"event": "fsdp_shard", "rank": int(os.environ.get("RANK", "0")),
               "reshard_after_forward": reshard if isinstance(reshard, (bool, int)) else None,
               "offload": offload, "mesh": shape, "unit": unit})
        return result

    module.fully_shard = fully_shard


def _patch_checkpoint(module: Any, name: str) -> None:
    """Say once that the script recomputes activations: its first call of ``module.name``
    (PyTorch's ``torch.utils.checkpoint.checkpoint``, which the HF models' gradient
    checkpointing, FSDP's checkpoint wrapper and torchtitan call; DeepSpeed's own). The host
    compares it with the candidate's recomputation: a script that drops the checkpointing knob
    measured another configuration than the candidate's, unseen (issue 43, item 30). Patched as
    the module is imported, so that ``from torch.utils.checkpoint import checkpoint`` gets it."""
    import functools

    original = getattr(module, name)
    told = False

    @functools.wraps(original)
    def checkpoint(*args: Any, **kwargs: Any) -> Any:
        nonlocal told
        if not told:
            told = True
            _emit({"event": "recompute", "rank": int(os.environ.get("RANK", "0")), "via": module.__name__})
        return original(*args, **kwargs)

    setattr(module, name, checkpoint)


def _bind_store(module: Any) -> None:
    """Rank 0's rendezvous store (``init_process_group``'s ``env://``) listens on ``MASTER_ADDR``
    only, not on every interface, as Pipette's own ranks' does (``workers.rank.store`` says why)."""
    original = module._create_c10d_store

    def create(hostname: str, port: int, rank: int, world_size: int, timeout: Any, use_libuv: bool = True) -> Any:
        if rank != 0 or module._torchelastic_use_agent_store():
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        family, kind, proto, _, address = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(2048)
        except OSError:
            sock.close()
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        return module.TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True, timeout=timeout,
                               multi_tenant=True, master_listen_fd=sock.detach(), use_libuv=use_libuv)

    module._create_c10d_store = create


class _Finder(importlib.abc.MetaPathFinder):
    """Patch each module of ``patches`` (name: function of the module) as it is imported."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, apply = spec.loader, patch

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                apply(module)

        spec.loader = Loader()
        return spec


def _install() -> None:
    raw = os.environ.get("PIPETTE_TRIAL")
    if not raw:
        return
    try:
        trial = json.loads(raw)
    except ValueError:
        return
    steps = _Steps(trial)
    sys.meta_path.insert(0, _Finder({"deepspeed.utils.timer": lambda module: _patch(module, steps),
                                     "torch.distributed.rendezvous": _bind_store,
                                     "deepspeed.runtime.engine": _patch_engine,
                                     "torch.distributed.fsdp._fully_shard._fully_shard": _patch_fully_shard,
                                     "torch.utils.checkpoint": lambda module: _patch_checkpoint(module, "checkpoint"),
                                     "deepspeed.runtime.activation_checkpointing.checkpointing":
                                         lambda module: _patch_checkpoint(module, "checkpoint")}))


_install()
_chain()
