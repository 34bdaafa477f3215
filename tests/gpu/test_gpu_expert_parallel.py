"""The expert-parallel MoE layer on GPUs under NCCL (``tests.fsdp.expert_ranks``, the cases of the
CPU test ``tests/fsdp/test_expert_parallel.py``).

On one GPU the honest case is a world of one NCCL rank with ep=1: the layer takes the
all-to-all path (counts exchanged and rows dispatched and combined by NCCL's
``all_to_all_single``, the regrouping on CUDA) over a one-rank group and must equal the one-GPU
reference layer; no token leaves the GPU (NCCL refuses two ranks on one device). With 4 GPUs
every CPU case runs as on gloo: ep=4, ep=2 x edp=2, with and without capacity, tokens moving
between GPUs in uneven splits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fsdp import expert_ranks as er

#: fp32 on CUDA with TF32 off (PyTorch's default "highest" matmul precision): the same sums in
#: another order, as on the CPU (tests/fsdp/test_expert_parallel.py's RTOL, same reasoning)
RTOL = 1e-5


def _gpus() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _check(results: dict[str, Any], name: str) -> None:
    got = results[name]
    assert results["backend"] == "nccl"
    assert got["out"] <= RTOL and got["x_grad"] <= RTOL, (got["out"], got["x_grad"])
    worst = max(got["param_grad"].items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL, worst
    assert got["aux"] <= 1e-6 * got["aux_value"]
    assert got["rows_sent"] == got["ref_kept"] == sum(got["rows_per_local_expert"])


def test_one_gpu_runs_the_nccl_all_to_all_path_as_the_reference(tmp_path: Path) -> None:
    results = er.spawn(1, "nccl", tmp_path, ["ep1-all-to-all"])[0]
    _check(results, "ep1-all-to-all")
    assert results["ep1-all-to-all"]["experts_held"] == list(range(8))


def test_four_gpus_move_tokens_between_them_as_four_gloo_ranks_do(tmp_path: Path) -> None:
    if _gpus() < 4:
        pytest.skip(f"needs 4 GPUs, {_gpus()} visible: run on a node with 4 or more")
    ranks = er.spawn(4, "nccl", tmp_path, list(er.CASES))
    for name in er.CASES:
        for results in ranks:
            _check(results, name)
