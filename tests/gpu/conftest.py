"""The GPU suite: the trial runner, the probe's rank program and the emitted launch on one
real GPU, without Ray. Every test here is marked ``gpu`` and skipped where CUDA is absent (CI
collects it, so it cannot rot unnoticed, and skips it); it never runs on a CPU.

On a GPU machine with nothing but this checkout and the wheels ``scripts/gpu-wheels`` fetched
(the machine needs no package index): ``scripts/gpu-suite`` (see docs/workers.md).
"""

from __future__ import annotations

import pytest


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(__file__).rsplit("/", 1)[0]
    skip = pytest.mark.skip(reason="no CUDA device here: the GPU suite runs on a GPU machine (scripts/gpu-suite)")
    cuda = _cuda()
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(skip)
