"""The PyTorch-native runner (``workers.rank.fsdp``) on GPUs under NCCL, in bf16 (FSDP2's
``MixedPrecisionPolicy``: bf16 compute, fp32 master weights and gradient reduction).

Every mode of the CPU test (``tests/fsdp/test_fsdp.py``) on 4 GPUs against one GPU's run, with
the same cases, launch and tolerances (``tests.fsdp.cases``): FSDP2 full shard, no reshard,
HSDP 2x2, FSDP2 x TP2, PP2 x FSDP2, full and LoRA, and the other compositions; skipped where
fewer than 4 GPUs are visible. On one GPU: ``fully_shard`` on a one-rank mesh with CPU offload,
per-op checkpointing and LoRA, against the same reference. The CPU test runs the same code with
gloo and checks the GPU answers of the device rule (``rank_devices``) without a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fsdp import cases as fc

WORLD = 4


def _gpus() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def refs() -> dict[str, Any]:
    out = fc.references("gpu", ("bf16",))
    assert not any(out["codes"]), "\n".join(out["tails"])
    return out


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    if _gpus() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, {_gpus()} visible: run on a node with {WORLD} or more")
    cases = fc.cases("gpu", "bf16")
    out = fc.run_batch({n: c[0] for n, c in cases.items()}, WORLD, "gpu", 900, {n: c[1] for n, c in cases.items()})
    out["keys"] = {n: c[2] for n, c in cases.items()}
    return out


def _check_gpu(batch: dict[str, Any], refs: dict[str, Any], name: str, key: str) -> None:
    done = fc.check_case(batch, refs, name, key, "bf16")
    for event in batch["cases"][name]["done"].values():
        assert event["device"] == "cuda:0", event["device"]  # each rank sees its own GPU only (rank_env)
        assert 0 < event["peak_tensor_bytes"] == event["peak_allocated_bytes"] <= event["peak_reserved_bytes"]
    loss, _ = fc.deltas(done, refs["cases"][key]["done"][0])
    print(f"{name}: {done['backend']}, {batch['cases'][name]['seconds']:.1f} s, step times "
          f"{[round(t, 4) for t in done['step_times']]}, max |loss delta| {max(map(abs, loss)):.1e}")


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("mode", list(fc.MODES))
def test_each_mode_on_four_gpus_trains_as_one_gpu_does(batch: dict[str, Any], refs: dict[str, Any], mode: str,
                                                       method: str) -> None:
    _check_gpu(batch, refs, f"{mode}/{method}", fc.ref_key(method, "bf16"))


@pytest.mark.parametrize("name", [f"{n}/{'lora' if m.get('lora') else 'full'}" for n, m in fc.EXTRA.items()])
def test_each_composition_on_four_gpus_trains_as_one_gpu_does(batch: dict[str, Any], refs: dict[str, Any],
                                                              name: str) -> None:
    _check_gpu(batch, refs, name, batch["keys"][name])


@pytest.mark.parametrize("name", list(fc.FAMILY_CASES))
def test_qwen_attention_on_four_gpus_trains_as_one_gpu_does(batch: dict[str, Any], refs: dict[str, Any],
                                                           name: str) -> None:
    """Qwen3's per-head q/k norms and Qwen2's biases under FSDP2 x TP2 on NCCL (tests/fsdp/test_fsdp.py on gloo)."""
    _check_gpu(batch, refs, name, batch["keys"][name])


@pytest.mark.parametrize("name", list(fc.ONE_RANK))
def test_one_gpu_shards_on_a_one_rank_mesh_with_offload(refs: dict[str, Any], name: str) -> None:
    """FSDP2 on one GPU: mixed precision, CPU offload (parameters and AdamW on the host), per-op
    checkpointing and LoRA; the loss of the plain one-GPU run (trained with the references)."""
    done = fc.check_case(refs, refs, name, fc.ref_key(name.rsplit("/", 1)[1], "bf16"), "bf16")
    assert done["device"] == "cuda:0" and done["backend"].startswith("fsdp2-one-rank+")
    assert "cpu-offload" in done["backend"] and done["peak_allocated_bytes"] > 0 and done["alloc_retries"] == 0
