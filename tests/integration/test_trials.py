"""Real trials: real Ray, real DeepSpeed, a tiny Llama, 2 and 4 CPU devices with gloo."""

from __future__ import annotations

import math
import os
import signal
import statistics
import time
from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError
from pipette.measurement import Measurement
from pipette.model import ModelSpec
from pipette.training import LORA_TARGETS, LoraSpec, TrainingSpec
from workers.host.executor import StepReport, run_trial
from workers.rank.data import PERIOD
from workers.spec import TrialSpec
from workers.support import refusals, refusals_for

MODEL = ModelSpec.preset("tiny-llama")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def trial(tp: int = 1, pp: int = 1, dp: int = 1, zero: int = 0, recompute: str = "none", method: str = "full",
          mbs: int = 1, batch: int = 4, seq: int = 32, model: ModelSpec = MODEL, **options: object) -> TrialSpec:
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype="fp32", method=method)  # type: ignore[arg-type]
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, mbs=mbs, global_batch=batch, zero_stage=zero, recompute=recompute)
    kwargs: dict = {"warmup_steps": 2, "min_steps": 3, "max_steps": 4} | options
    return TrialSpec(model, training, config, **kwargs)


CASES = {
    "dp2-zero1-full": (trial(dp=2, zero=1), "deepspeed+engine+zero1"),
    "dp2-zero2-lora": (trial(dp=2, zero=2, method="lora"), "deepspeed+engine+zero2+peft-lora"),
    "dp2-zero3-recompute-full": (trial(dp=2, zero=3, recompute="full"), "deepspeed+engine+zero3"),
    "tp2-full": (trial(tp=2), "deepspeed+engine+zero0+megatron-tp"),
    "tp2-lora-zero1-selective": (trial(tp=2, zero=1, method="lora", recompute="selective"),
                                 "deepspeed+engine+zero1+megatron-tp+tp-lora"),
    "pp2-zero1-recompute-full": (trial(pp=2, zero=1, recompute="full"), "deepspeed+pipeline+zero1"),
    "tp2xpp2-lora": (trial(tp=2, pp=2, method="lora"), "deepspeed+pipeline+zero0+megatron-tp+tp-lora"),
    # crashed in every job (IndexError attaching AutoTP's adapters to ZeRO-3 partitions): issue 17
    "tp2-zero3-lora": (trial(tp=2, zero=3, method="lora", mbs=4), "deepspeed+engine+zero3+megatron-tp+tp-lora"),
    # the frozen embedding feeds stage 0's first checkpointed layer an input without grad
    "pp2-lora-recompute-full": (trial(pp=2, method="lora", recompute="full"), "deepspeed+pipeline+zero0+peft-lora"),
}


#: the trials this module ran, by spec, with the steps they streamed: a test that needs a trial
#: another test ran reads it (the equivalence test's tp=2 is the case "tp2-full")
_RAN: dict[TrialSpec, tuple[Measurement, list[StepReport]]] = {}


def _measured(spec: TrialSpec) -> tuple[Measurement, list[StepReport]]:
    """A trial of ``spec`` that ran (once in this module) and the steps it streamed as they happened."""
    if spec not in _RAN:
        seen: list[StepReport] = []
        m = run_trial(spec, timeout_s=240, on_step=seen.append)
        assert m.status == "ok", m.error
        _RAN[spec] = (m, seen)
    return _RAN[spec]


@pytest.mark.parametrize("name", list(CASES))
def test_candidate_runs_and_is_measured(name: str) -> None:
    spec, backend = CASES[name]
    m, seen = _measured(spec)
    assert m.extra["backend"] == backend
    assert spec.min_steps <= len(m.step_times) <= spec.max_steps
    assert all(t > 0 for t in m.step_times)
    assert len(m.peak_memory) == spec.config.world and min(m.peak_memory) > 0
    assert len(m.extra["peak_rss_bytes"]) == spec.config.world
    assert m.tokens_per_s is not None and m.tokens_per_s > 0
    assert len(m.losses) == spec.warmup_steps + len(m.step_times)
    assert [s.step for s in seen] == list(range(len(m.losses)))  # streamed as they happened
    trainable_full = MODEL.total_params()
    if spec.training.is_lora:
        assert 0 < m.extra["trainable_params"] < trainable_full // 10
    print(name, m.extra["backend"], [round(t, 4) for t in m.step_times])


def _losses(spec: TrialSpec) -> list[float]:
    return list(_measured(spec)[0].losses)


def test_tensor_and_pipeline_parallel_train_the_same_model_as_one_device() -> None:
    """tp and pp split the same computation: the first losses match a single device's."""
    one = _losses(trial())
    assert _losses(trial(tp=2))[:3] == pytest.approx(one[:3], rel=1e-4)
    # Trials time steps until the step time is known well enough, so their lengths may differ.
    both, pipe = _losses(trial(tp=2, pp=2)), _losses(trial(pp=2))
    n = min(len(both), len(pipe))
    assert n >= 3 and both[:n] == pytest.approx(pipe[:n], rel=1e-4)


LEARNERS: dict[str, dict] = {
    "full-dp2": {"dp": 2},
    "peft-lora-dp2": {"dp": 2, "method": "lora"},
    "tp-lora-tp2": {"tp": 2, "method": "lora"},  # the sharding-aware adapters under AutoTP
}


@pytest.mark.parametrize("name", list(LEARNERS))
def test_training_learns_the_synthetic_task(name: str) -> None:
    """The loss falls from an untrained ln V to well below ln PERIOD: the run learned which
    token follows which, not only which tokens occur. Frozen adapters or an optimizer that
    does not step leave it near ln V (6.2 nats), so they fail here."""
    spec = trial(**LEARNERS[name], mbs=2, lr=1e-2, min_steps=10, max_steps=10)  # 12 steps with the warm-up
    if spec.training.is_lora:  # adapters on the MLP too: the task is a token-to-token map
        spec = replace(spec, training=replace(spec.training, lora=LoraSpec(rank=16, alpha=32.0, targets=LORA_TARGETS)))
    losses = _losses(spec)
    assert losses[0] > math.log(MODEL.vocab) - 0.5, losses  # it starts untrained
    # ln PERIOD (2.8 nats) is knowing the cycle's tokens but not their order.
    assert statistics.fmean(losses[-3:]) < min(1.0, math.log(PERIOD)), losses


def test_tied_embeddings_stay_one_matrix_across_pipeline_stages() -> None:
    """pp=2 on a tied model: the first stage's embedding and the last stage's LM head are one
    parameter (DeepSpeed's TiedLayerSpec), so the run follows one device's losses and learns.
    Untied copies (each stage training its own) measured 7% off at step 2; tied, 1.5e-4."""
    tied = ModelSpec.preset("tiny-llama-tied")
    assert tied.tied_embeddings and tied.arch == "llama"
    one = run_trial(trial(model=tied, lr=1e-2, min_steps=1, max_steps=1), timeout_s=240)
    two = run_trial(trial(model=tied, pp=2, lr=1e-2, min_steps=8, max_steps=8), timeout_s=240)
    assert one.status == "ok" and two.status == "ok", (one.error, two.error)
    assert two.extra["backend"] == "deepspeed+pipeline+zero0+tied-embedding"
    assert list(two.losses[:3]) == pytest.approx(list(one.losses[:3]), rel=1e-3)
    assert statistics.fmean(two.losses[-3:]) < 1.0, two.losses


def test_memory_cap_makes_an_oom_result() -> None:
    spec = trial(dp=2, batch=32, mbs=16, seq=256, memory_cap_bytes=150 * 1024**2)
    m = run_trial(spec, timeout_s=120)
    assert m.status == "oom", (m.status, m.error)
    assert m.extra["oom_rank"] in (0, 1) and m.extra["oom_bytes"] > 0
    assert f"rank {m.extra['oom_rank']}" in m.error


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_killed_rank_fails_the_trial() -> None:
    pids: list[int] = []

    def kill_rank_1(s: StepReport) -> None:
        if s.step == 2 and not pids:
            pids.extend(s.pids)
            os.kill(s.pids[1], signal.SIGKILL)

    m = run_trial(trial(dp=2, min_steps=200, max_steps=200), timeout_s=120, on_step=kill_rank_1)
    assert m.status == "failed", (m.status, m.error)
    assert m.error.startswith("rank 1 (node 0, ") and ") was killed by SIGKILL" in m.error.splitlines()[0]
    assert all(_gone(p) for p in pids)


def test_hang_is_caught_by_the_timeout() -> None:
    pids: list[int] = []

    def freeze_rank_1(s: StepReport) -> None:
        if s.step == 1 and not pids:
            pids.extend(s.pids)
            os.kill(s.pids[1], signal.SIGSTOP)  # rank 0 now waits forever in a collective

    start = time.monotonic()
    m = run_trial(trial(dp=2, min_steps=10_000, max_steps=10_000), timeout_s=30, on_step=freeze_rank_1)
    assert m.status == "timeout", (m.status, m.error)
    assert time.monotonic() - start < 60
    assert all(_gone(p) for p in pids)


def test_pruned_trial_stops_within_seconds() -> None:
    asked: list[float] = []

    def prune_at_3(s: StepReport) -> bool:
        if s.step == 3:
            asked.append(time.monotonic())
            return True
        return False

    m = run_trial(trial(dp=2, min_steps=10_000, max_steps=10_000), timeout_s=120, on_step=prune_at_3)
    assert m.status == "pruned"
    assert time.monotonic() - asked[0] < 5
    assert len(m.step_times) >= 1


def test_unrunnable_candidate_is_refused_before_any_process() -> None:
    with pytest.raises(InfeasibleError, match="ZeRO-2"):
        run_trial(trial(pp=2, zero=2), timeout_s=5)
    interleaved = replace(trial(pp=2), config=replace(trial(pp=2).config, schedule="interleaved", virtual_stages=2))
    with pytest.raises(InfeasibleError, match="only 1F1B") as e:
        run_trial(interleaved, timeout_s=5)
    assert e.value.field == "config" and e.value.fix


def test_refusals_for_is_the_runners_check_without_a_trial() -> None:
    """What a tuner calls to skip candidates: the same reasons as the runner's own check."""
    t = TrainingSpec(global_batch=4, seq_len=32, dtype="fp32")
    pp2 = ParallelConfig(tp=1, pp=2, dp=1, mbs=1, global_batch=4)
    interleaved = replace(pp2, schedule="interleaved", virtual_stages=2)
    (reason,) = refusals_for(MODEL, t, interleaved, "cpu")
    assert "'interleaved' with 2 virtual stages" in reason and "use 1f1b" in reason
    assert refusals(TrialSpec(MODEL, t, interleaved)) == [reason]
    assert refusals_for(ModelSpec.preset("tiny-llama-tied"), t, pp2, "cpu") == []  # tied pp > 1 runs now
    assert refusals_for(MODEL, t, pp2, "cpu") == []
    fp16 = replace(t, dtype="fp16")
    assert any("fp16" in r for r in refusals_for(MODEL, fp16, pp2, "cpu"))
    assert refusals_for(MODEL, fp16, pp2, "gpu") == []
    assert any("tp=3" in r for r in refusals_for(MODEL, t, replace(pp2, tp=3), "gpu"))
    assert any("device kind 'tpu'" in r for r in refusals_for(MODEL, t, pp2, "tpu"))
    assert any("tiny-gpt is gpt" in r for r in refusals_for(ModelSpec.preset("tiny-gpt"), t, pp2, "cpu"))
