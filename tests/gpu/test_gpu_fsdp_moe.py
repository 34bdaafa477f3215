"""Expert parallelism in the PyTorch-native runner on 4 GPUs under NCCL: the cases of the CPU test
(``tests/fsdp/test_fsdp_moe.py``: ep 2 x dp 4, ep 4, ep 2 under HSDP and under pp 2, the shared
expert with LoRA), fp32, against the ep=1 cases of the same batch. On NCCL the experts' gradient
divide factor is a ``PREMUL_SUM`` reduce-scatter (gloo sums and divides after), and the tokens move by
NCCL's all-to-all. Skipped where fewer than 4 GPUs are visible."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fsdp import test_fsdp_moe as moe

WORLD = 4


def _gpus() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    if _gpus() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, {_gpus()} visible: run on a node with {WORLD} or more")
    return moe.run_cases("gpu", 600)


@pytest.mark.parametrize("name", moe.EP_CASES)
def test_expert_parallel_on_four_gpus_trains_as_every_expert_on_every_gpu(batch: dict[str, Any], name: str) -> None:
    run = moe.check_case(batch, name)
    for event in batch["cases"][name]["done"].values():
        assert event["device"] == "cuda:0", event["device"]  # each rank sees its own GPU only (rank_env)
    print(f"{name}: {run['backend']}, step times {[round(t, 4) for t in run['step_times']]}")
