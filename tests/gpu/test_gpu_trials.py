"""The trial runner on one GPU: real DeepSpeed steps under NCCL, the batch and every
collective on the GPU, peaks from the caching allocator, out-of-memory ending ``oom``."""

from __future__ import annotations

import math
import statistics

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.host.local import run_local
from workers.rank.data import PERIOD
from workers.spec import TrialSpec

#: The H100 80GB HBM3's memory (NVML, 81559 MiB): larger GPUs are capped to it, so the
#: candidates that ran out of memory on the H100 (h100_single_gpu.csv) do so everywhere.
H100_BYTES = 81559 * 2**20


def trial(model: str, method: str, recompute: str, mbs: int, batch: int, seq: int, **options: object) -> TrialSpec:
    lora = LoraSpec(rank=16, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj")) if method == "lora" else None
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype="bf16", method=method, lora=lora)  # type: ignore[arg-type]
    config = ParallelConfig(tp=1, pp=1, dp=1, mbs=mbs, global_batch=batch, recompute=recompute)  # type: ignore[arg-type]
    kwargs: dict = {"device_kind": "gpu", "memory_cap_bytes": H100_BYTES} | options
    return TrialSpec(ModelSpec.preset(model), training, config, **kwargs)


def check_ok(m, spec: TrialSpec) -> None:  # type: ignore[no-untyped-def]
    assert m.status == "ok", f"{m.error}\n{m.extra.get('output_tail')}"
    assert m.extra["devices"] == ["cuda:0"]
    assert spec.min_steps <= len(m.step_times) <= spec.max_steps and all(t > 0 for t in m.step_times)
    assert all(math.isfinite(x) for x in m.losses)
    peak, reserved = m.peak_memory[0], m.extra["peak_reserved_bytes"][0]
    assert 0 < peak <= reserved


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_tiny_llama_trains_on_the_gpu(method: str, recompute: str) -> None:
    spec = trial("tiny-llama", method, recompute, mbs=2, batch=4, seq=128, lr=1e-2, min_steps=10, max_steps=10)
    m = run_local(spec, timeout_s=300)
    check_ok(m, spec)
    # It learns workers.rank.data's task: from an untrained ln V to below ln PERIOD (the cycle's
    # tokens known), as on CPU (tests/integration/test_trials.py).
    assert m.losses[0] > math.log(spec.model.vocab) - 0.5, m.losses
    assert statistics.fmean(m.losses[-3:]) < math.log(PERIOD), m.losses


def test_an_allocation_past_the_cap_ends_oom() -> None:
    """A cap below what the candidate needs: the allocator's own out-of-memory error, reported
    as ``oom`` with the bytes asked for, and the process gone."""
    spec = trial("tiny-llama", "full", "none", mbs=64, batch=64, seq=256, memory_cap_bytes=24 * 2**20)
    m = run_local(spec, timeout_s=300)
    assert m.status == "oom", f"{m.status}: {m.error}\n{m.extra.get('output_tail')}"
    assert m.extra["oom_bytes"] > 0 and "out of memory" in m.error.lower()
    # the allocator's figures at the OOM (workers.rank.memory.allocator_record): the fits boundary's data
    assert m.extra["allocator_ooms"][0] >= 1 and m.extra["outside_allocator_bytes"][0] > 0


def test_a_gpu_trial_records_what_the_allocator_held() -> None:
    """Reserved >= allocated, the CUDA context outside the allocator (1.6-1.7 GiB on an H100 with
    torch 2.11 / CUDA 13), and the live tensors as the trial's peak memory."""
    spec = trial("tiny-llama", "full", "none", mbs=2, batch=4, seq=128)
    m = run_local(spec, timeout_s=300)
    check_ok(m, spec)
    allocated, reserved = m.extra["peak_allocated_bytes"][0], m.extra["peak_reserved_bytes"][0]
    assert 0 < allocated <= reserved
    assert m.peak_memory[0] == allocated
    assert 100 * 2**20 < m.extra["outside_allocator_bytes"][0] < 8 * 2**30
    assert m.extra["peak_inactive_split_bytes"][0] >= 0 and m.extra["alloc_retries"][0] == 0


# From h100_single_gpu.csv: what ran and what ran out of memory on one H100 80GB.
LLAMA_1B = {
    "full-mbs4-none": (("llama3.2-1b", "full", "none", 4, 16, 2048), "ok"),
    "full-mbs16-none": (("llama3.2-1b", "full", "none", 16, 16, 2048), "oom"),
    "lora-mbs1-none": (("llama3.2-1b", "lora", "none", 1, 16, 4096), "ok"),
    "lora-mbs4-full": (("llama3.2-1b", "lora", "full", 4, 16, 4096), "ok"),
}


@pytest.mark.parametrize("name", list(LLAMA_1B))
def test_llama_1b_runs_or_runs_out_of_memory_as_on_the_h100(name: str) -> None:
    args, want = LLAMA_1B[name]
    spec = trial(*args, max_steps=4)  # type: ignore[arg-type]
    m = run_local(spec, timeout_s=400)
    if want == "oom":
        assert m.status == "oom", f"{m.status}: {m.error}\n{m.extra.get('output_tail')}"
    else:
        check_ok(m, spec)
    print(name, m.status, [round(t, 4) for t in m.step_times], m.extra.get("wall_s"))


def test_tf32_runs_the_matmuls_on_the_tensor_cores() -> None:
    """``dtype: tf32`` on an Ampere-or-newer GPU: fp32 weights (fp32's memory, within the allocator's
    rounding) and matmuls on the TF32 tensor cores, so its steps are faster than plain fp32's (the
    model prices TF32 at 494.5 against fp32's 67 TFLOP/s on an H100)."""
    import torch

    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("no TF32 tensor cores before Ampere")
    runs = {}
    for dtype in ("fp32", "tf32"):
        spec = trial("llama3.2-1b", "lora", "full", mbs=2, batch=4, seq=1024, min_steps=4, max_steps=4)
        spec = TrialSpec(spec.model, TrainingSpec(global_batch=4, seq_len=1024, dtype=dtype, method="lora",  # type: ignore[arg-type]
                                                  lora=spec.training.lora), spec.config, device_kind="gpu",
                         memory_cap_bytes=H100_BYTES, min_steps=4, max_steps=4)
        runs[dtype] = run_local(spec, timeout_s=400)
        check_ok(runs[dtype], spec)
    fp32, tf32 = (statistics.median(runs[d].step_times) for d in ("fp32", "tf32"))
    print(f"llama3.2-1b LoRA, mbs 2 x 1024 tokens: fp32 {fp32:.3f} s, tf32 {tf32:.3f} s a step ({fp32 / tf32:.1f}x)")
    assert tf32 < 0.6 * fp32
    assert runs["tf32"].peak_memory[0] == pytest.approx(runs["fp32"].peak_memory[0], rel=0.05)


def test_an_moe_model_trains_on_the_gpu() -> None:
    """tiny-moe (Mixtral's shape) through the DeepSpeed runner on one GPU (issue 47): the Hugging Face
    Mixtral built on the GPU in bf16, its experts' 3-D weights initialised there (workers.rank.init), the
    step under NCCL; one GPU holds every expert (ep 1: AutoEP's ep > 1 needs 2 GPUs, checked on CPU ranks
    by tests/integration/test_autoep_trials.py)."""
    spec = trial("tiny-moe", "full", "none", mbs=2, batch=4, seq=128, lr=1e-2, min_steps=10, max_steps=10)
    m = run_local(spec, timeout_s=300)
    check_ok(m, spec)
    assert m.extra["trainable_params"] == spec.model.total_params()
    assert m.losses[0] > math.log(spec.model.vocab) - 0.5 and statistics.fmean(m.losses[-3:]) < m.losses[0], m.losses
