"""The device rule of every rank: where its tensors live and where its collectives run.

One rule for the whole runner (trials and the probe):

* a rank computes on its **rank device**: ``cuda:<LOCAL_RANK>`` on a GPU device (the launcher
  or the executor makes the rank's GPU visible), ``cpu`` on a CPU device;
* every tensor the rank feeds its model goes to that device first (``to_device``);
* a collective runs on a tensor on its **backend's device** (``collective_device``): NCCL only
  knows CUDA tensors ("No backend type associated with device type cpu" otherwise), gloo
  runs on host tensors.

These were the two bugs that failed every trial on the first H100 run: the batch stayed on
the host ("index is on cpu, different from other tensors on cuda:0"), and the step-count
agreement was broadcast as a host tensor under NCCL.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: the ``torch.distributed`` backend of each device kind
BACKENDS = {"gpu": "nccl", "cpu": "gloo"}


def backend_for(device_kind: str) -> str:
    try:
        return BACKENDS[device_kind]
    except KeyError:
        raise ValueError(f"device kind {device_kind!r} is not one of {', '.join(BACKENDS)}") from None


def set_matmul_precision(dtype: str, device: torch.device) -> str | None:
    """The fp32 matmul precision of a rank training in ``dtype`` on ``device``; returns what it set.

    ``tf32`` on a GPU: TF32 tensor cores for fp32 matmuls (``torch.set_float32_matmul_precision("high")``,
    which PyTorch 2.9+ keeps in step with ``torch.backends.cuda.matmul.fp32_precision``; setting the legacy
    ``allow_tf32`` flag beside the new one makes PyTorch refuse to read either). Any other dtype on a GPU:
    full fp32 (``"highest"``, PyTorch's default), so a previous trial in the same process cannot leak TF32
    into an fp32 one. A CPU rank is left alone (None): TF32 is a tensor-core mode, and ``"high"`` lets a
    backend treat each fp32 as the sum of two bf16 numbers where it has such matmuls (PyTorch's
    ``set_float32_matmul_precision`` docs), which is not what ``tf32`` means."""
    if device.type != "cuda":
        return None
    precision = "high" if dtype == "tf32" else "highest"
    torch.set_float32_matmul_precision(precision)
    return precision


def rank_device(device_kind: str) -> torch.device:
    """The device this rank computes on. On a GPU it is the one ``LOCAL_RANK`` names among
    the visible ones (the executor shows each rank only its own, so index 0 there)."""
    if device_kind == "gpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device_kind == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device kind {device_kind!r} is not one of {', '.join(BACKENDS)}")


def collective_device(backend: str, compute: torch.device) -> torch.device:
    """The device of a tensor handed to a collective of ``backend`` by a rank computing on
    ``compute``: the rank's GPU under NCCL, the host under gloo."""
    if backend == "nccl":
        if compute.type != "cuda":
            raise ValueError(f"NCCL collectives need a CUDA tensor; this rank computes on {compute}")
        return compute
    return torch.device("cpu")


def to_device(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The batch on the rank's device (pinned host memory copies asynchronously)."""
    non_blocking = device.type == "cuda"
    return tuple(t.to(device, non_blocking=non_blocking) for t in tensors)


def process_group_backend(device_kind: str, host_collectives: bool) -> str:
    """gloo on a CPU device, NCCL on a GPU; with ``host_collectives`` (CPU offload: the gradient
    norm of host gradients, FSDP2's host tensors) a GPU rank's group runs gloo for host tensors
    too, as torchtitan's ``init_distributed`` asks (``cuda:nccl,cpu:gloo``)."""
    backend = backend_for(device_kind)
    return f"cuda:{backend},cpu:gloo" if device_kind == "gpu" and host_collectives else backend


def init_distributed(device_kind: str, rank: int, world: int, store: dist.Store,
                     timeout: timedelta | None = None, host_collectives: bool = False) -> torch.device:
    """The default process group (``process_group_backend``), bound to the rank's GPU on a GPU."""
    device = rank_device(device_kind)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"a GPU trial, but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        torch.cuda.set_device(device)
    options: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if timeout is not None:
        options["timeout"] = timeout
    backend = process_group_backend(device_kind, host_collectives)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **options)
    return device
