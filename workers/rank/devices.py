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

import torch

#: the ``torch.distributed`` backend of each device kind
BACKENDS = {"gpu": "nccl", "cpu": "gloo"}


def backend_for(device_kind: str) -> str:
    try:
        return BACKENDS[device_kind]
    except KeyError:
        raise ValueError(f"device kind {device_kind!r} is not one of {', '.join(BACKENDS)}") from None


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
