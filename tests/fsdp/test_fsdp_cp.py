"""Context parallelism in the PyTorch-native runner's trials (``workers.rank.fsdp_rank`` with
``FsdpPlan.cp > 1``): the split is the same training. On 4 gloo ranks, in one set of rank
processes (``tests.fsdp.cases.run_batch``), a cp = 1 trial (FSDP2 over dp = 4, itself one
device's training: ``tests/fsdp/test_fsdp.py``) and cp = 2 and 4 trials of the same model on the
same tokens: cp x dp (FSDP2 over ``dp_shard x cp``), cp x tp (ring on TP-local heads), cp x dp
under NO_SHARD (gradients averaged over cp by the rank), HSDP x cp (replicate x ``dp_shard_cp``),
cp = 4 with LoRA and per-op checkpointing, pp x cp, and cp x dp in bf16 mixed precision. Each cp
trial's losses and gradient norms are the cp = 1 trial's within fp32 tolerance (bf16: bf16's, against
the bf16 cp = 1 trial) over 3 steps; attention restricted to a rank's own chunks, local RoPE positions
or unshifted labels would move the first loss by far more (the loss is of the whole sequence).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fsdp import cases as fc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 3
#: the cp = 1 trials every cp trial is held to, by method and dtype
REFERENCE = {"full": "fp32", "lora": "fp32", "full-bf16": "bf16", "full-fp32-qwen3": "fp32", "lora-fp32-qwen3": "fp32"}
CP1 = {"dp": 4, "mbs": 2, "zero_stage": 3}
#: name -> (ParallelConfig fields, method, what the backend name says)
CP_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "cp2-dp2": ({"dp": 2, "cp": 2, "mbs": 2, "zero_stage": 3}, "full", "fsdp2-full-shard+cp2-ring"),
    "cp2-tp2": ({"cp": 2, "tp": 2, "mbs": 2, "zero_stage": 3}, "full", "fsdp2-full-shard+tp-sp+cp2-ring"),
    "cp2-dp2-noshard": ({"dp": 2, "cp": 2, "mbs": 2, "zero_stage": 0}, "full", "fsdp2-replicate+cp2-ring"),
    "cp4-sac": ({"cp": 4, "mbs": 4, "zero_stage": 2, "recompute": "selective"}, "lora",
                "fsdp2-no-reshard+cp4-ring+ac-selective+peft-lora"),
    "pp2-cp2": ({"pp": 2, "cp": 2, "mbs": 2, "zero_stage": 3}, "lora", "fsdp2-full-shard+cp2-ring+pp-1f1b+peft-lora"),
    "hsdp-cp2": ({"dp": 2, "dp_shard": 1, "cp": 2, "mbs": 2, "zero_stage": 3}, "full", "fsdp2-hsdp2x2+cp2-ring"),
    "cp2-dp2-bf16": ({"dp": 2, "cp": 2, "mbs": 2, "zero_stage": 3}, "full-bf16", "fsdp2-full-shard+cp2-ring+mp-bf16"),
    # Qwen3's attention (per-head q/k norms, heads of 24) through the same ring, on TP-local heads too
    "qwen3-cp2-dp2": ({"dp": 2, "cp": 2, "mbs": 2, "zero_stage": 3, "model": "qwen3"}, "full-fp32-qwen3",
                      "fsdp2-full-shard+cp2-ring"),
    "qwen3-cp2-tp2": ({"cp": 2, "tp": 2, "mbs": 2, "zero_stage": 3, "model": "qwen3"}, "lora-fp32-qwen3",
                      "fsdp2-full-shard+tp-sp+cp2-ring+peft-lora"),
}


def _trial(mode: dict[str, Any], method: str) -> Any:
    """``method`` is ``kind[-dtype[-model]]``: ``full``, ``full-bf16``, ``lora-fp32-qwen3``."""
    parts = method.split("-")
    kind, dtype, model = [*parts, *("fp32", "llama")[len(parts) - 1:]]
    return fc.trial(mode | {"model": model}, kind, dtype=dtype, steps=STEPS)


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    trials = {f"cp1/{m}": _trial(CP1, m) for m in REFERENCE}
    trials |= {name: _trial(mode, method) for name, (mode, method, _) in CP_CASES.items()}
    out = fc.run_batch(trials, 4, "cpu", 280)
    print(f"\n4-rank cp batch: {len(trials)} cases in {out['wall_s']:.1f} s")
    assert not any(out["codes"]), f"exit codes {out['codes']}\n" + "\n".join(out["tails"])[-6000:]
    return out


@pytest.mark.parametrize("name", list(CP_CASES))
def test_a_cp_trial_trains_as_the_cp1_trial(batch: dict[str, Any], name: str) -> None:
    _, method, backend = CP_CASES[name]
    refs = {"cases": {f"cp1/{m}": batch["cases"][f"cp1/{m}"] for m in REFERENCE}}
    done = fc.check_case(batch, refs, name, f"cp1/{method}", REFERENCE[method])
    assert done["backend"] == backend
    loss, norm = fc.deltas(done, refs["cases"][f"cp1/{method}"]["done"][0])
    print(f"| {name} | {backend} | {max(map(abs, loss)):.1e} | {max(norm):.1e} |")


def test_fsdp_shards_over_dp_shard_x_cp_and_noshard_keeps_whole_replicas(batch: dict[str, Any]) -> None:
    """FSDP2 over the flattened ``dp_shard x cp`` (torchtitan's ``dp_shard_cp``): cp 2 x dp 2 holds
    what dp 4 holds; under NO_SHARD each rank holds the whole model, 4 times that."""
    held = {name: batch["cases"][name]["done"][0]["held_param_bytes"] for name in ("cp1/full", "cp2-dp2",
                                                                                   "cp2-dp2-noshard")}
    assert held["cp2-dp2"] == held["cp1/full"]
    assert held["cp2-dp2-noshard"] == 4 * held["cp1/full"]
