"""Expert parallelism in the PyTorch-native runner (``workers.rank.fsdp_rank``) for real on 4 gloo
ranks: the tiny MoE presets (8 experts, top-2) trained by the product's rank program with ep=2 x
dp=2 and ep=4 x dp=1 expert groups (FSDP2 over dp=4 for the dense layers, over ``efsdp`` for the
experts) give the losses and gradient norms of the same trial at ep=1 (every rank all experts,
FSDP2 over dp=4), step by step; so does ep=2 under a 2-stage 1F1B pipeline (pp=2 x dp=2).

What this holds the runner to: tokens reach the ranks that hold their experts and come back
(``workers.rank.expert_parallel``); an expert's gradient, which the all-to-all's backward already
summed over its ep group, is divided by the dense data ranks and not by its own FSDP mesh
(``set_gradient_divide_factor``: without it an expert's gradient is ep times too large, and the
gradient norm before clipping shows it); the clipping norm sums the experts' squares over the ep
group; the load-balancing loss is averaged over the micro-batches (``aux_loss_scale``; the pipeline
schedule scales it with the rest). Every case runs 2 or more micro-batches per step, all cases in one
set of 4 rank processes (``tests.fsdp.cases.run_batch``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from tests.fsdp import cases as fc
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GLOBAL_BATCH, SEQ, STEPS = 8, 32, 3
#: case -> (preset, ParallelConfig fields, method); each ep > 1 case is held to the ep=1 case of its model
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "ep1-dp4": ("tiny-moe", {"dp": 4}, "full"),
    "ep2-dp4": ("tiny-moe", {"dp": 4, "ep": 2}, "full"),
    "ep4-dp4": ("tiny-moe", {"dp": 4, "ep": 4}, "full"),
    "ep2-hsdp2x2": ("tiny-moe", {"dp": 4, "ep": 2, "dp_shard": 2}, "full"),
    "pp2-dp2-ep2": ("tiny-moe", {"pp": 2, "dp": 2, "ep": 2}, "full"),
    "shared-ep1-dp4": ("tiny-moe-shared", {"dp": 4}, "lora"),
    "shared-ep2-dp4": ("tiny-moe-shared", {"dp": 4, "ep": 2}, "lora"),
}
BASELINE = {"tiny-moe": "ep1-dp4", "tiny-moe-shared": "shared-ep1-dp4"}
#: fp32: the expert-parallel ranks add a token's k expert outputs, and an expert's rows, in another
#: order than one rank holding every expert, and FSDP2 sums the experts' gradients over other
#: groups; AdamW carries those last bits into the weights. fp32 rounding moves a loss by ~1e-6 over
#: these steps; a wrong divide factor moves the gradient norm by a factor near ep.
LOSS_TOL, NORM_RTOL = 1e-4, 1e-4


def _trial(preset: str, fields: dict[str, Any], method: str, device_kind: str = "cpu") -> TrialSpec:
    lora = LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    training = TrainingSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32", method=method,  # type: ignore[arg-type]
                            lora=lora if method == "lora" else None)
    config = ParallelConfig(**({"tp": 1, "pp": 1, "mbs": 1, "global_batch": GLOBAL_BATCH, "zero_stage": 3} | fields))
    return TrialSpec(ModelSpec.preset(preset), training, config, warmup_steps=1, min_steps=STEPS - 1,
                     max_steps=STEPS - 1, device_kind=device_kind, lr=1e-2)


def run_cases(device_kind: str, timeout_s: float) -> dict[str, Any]:
    """Every case in one set of 4 rank processes (shared with ``tests/gpu/test_gpu_fsdp_moe.py``)."""
    trials = {name: _trial(*case, device_kind=device_kind) for name, case in CASES.items()}
    assert all(t.config.grad_accum >= 2 for t in trials.values())
    out = fc.run_batch(trials, 4, device_kind, timeout_s)
    print(f"\n4-rank MoE batch ({device_kind}): {len(trials)} cases in {out['wall_s']:.1f} s")
    return out


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    return run_cases("cpu", 240)


def done_of(batch: dict[str, Any], name: str) -> dict[str, Any]:
    done = batch["cases"][name]["done"]
    assert len(done) == 4, f"{name}: {len(done)} ranks reported; exit codes {batch['codes']}\n" + \
        "\n".join(batch["tails"])[-4000:]
    for rank, event in done.items():
        assert event["losses"] == done[0]["losses"], f"{name}: rank {rank} reported other losses"
    return dict(done[0])


EP_CASES = [n for n, (_, f, _) in CASES.items() if f.get("ep", 1) > 1]


@pytest.mark.parametrize("name", EP_CASES)
def test_expert_parallel_trains_as_every_expert_on_every_rank(batch: dict[str, Any], name: str) -> None:
    check_case(batch, name)


def check_case(batch: dict[str, Any], name: str) -> dict[str, Any]:
    """Case ``name`` trained as its model's ep=1 case did; its rank 0's ``done``."""
    preset, fields, _ = CASES[name]
    run, ref = done_of(batch, name), done_of(batch, BASELINE[preset])
    loss, norm = fc.deltas(run, ref)
    print(f"| {name} | {run['backend']} | {max(map(abs, loss)):.1e} | {max(norm):.1e} |")
    assert run["backend"].startswith("fsdp2-") and f"moe-ep{fields['ep']}" in run["backend"], run["backend"]
    assert len(run["losses"]) == STEPS
    assert max(map(abs, loss)) <= LOSS_TOL, f"{name}: loss - ep=1's = {loss}"
    assert max(norm) <= NORM_RTOL, f"{name}: gradient norm off ep=1's by {norm} (relative)"
    assert run["losses"][-1] < run["losses"][0], f"{name}: it did not learn: {run['losses']}"
    return run


def test_the_trainable_parameters_are_the_whole_models_at_every_ep(batch: dict[str, Any]) -> None:
    """Each ep rank holds its block of experts; the trial reports the whole model's count (its
    stage's under a pipeline, as for a dense model)."""
    for name, (preset, fields, _) in CASES.items():
        if fields.get("pp", 1) == 1:
            ref = done_of(batch, BASELINE[preset])
            assert done_of(batch, name)["trainable_params"] == ref["trainable_params"], name
