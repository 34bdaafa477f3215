"""The PyTorch-native runner as a kind of trial: an ``fsdp`` candidate runs through the product's
path (Ray transport, the monitor, ``RunnerTrial`` with ``workers.rank.fsdp``) and ``pipette tune
--stack fsdp`` tunes with it; a DeepSpeed and an FSDP trial of one job are measured alike."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipette.config import ParallelConfig
from pipette.errors import InfeasibleError
from pipette.model import ModelSpec
from pipette.training import TrainingSpec
from workers.host.executor import run_trial
from workers.spec import TrialSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trials import trial
from test_tune import _env, _no_rank_left, _tune

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _fsdp(spec: TrialSpec) -> TrialSpec:
    return replace(spec, stack="fsdp")


def test_an_fsdp_candidate_is_a_trial_like_a_deepspeed_one() -> None:
    spec = trial(dp=2, zero=3, method="lora")
    ds, fsdp = run_trial(spec, timeout_s=240), run_trial(_fsdp(spec), timeout_s=240)
    for m in (ds, fsdp):
        assert m.status == "ok", f"{m.error}\n{m.extra.get('output_tail')}"
        assert spec.min_steps <= len(m.step_times) <= spec.max_steps and len(m.peak_memory) == 2
        assert m.extra["trainable_params"] == ds.extra["trainable_params"]
    assert ds.extra["backend"].startswith("deepspeed") and fsdp.extra["backend"].startswith("fsdp2-full-shard")
    assert "peft-lora" in fsdp.extra["backend"]
    # the same model at the start (the two runners cut the global batch into ranks differently)
    assert fsdp.losses[0] == pytest.approx(ds.losses[0], rel=0.05)


def test_tensor_parallel_fsdp_trial_runs_and_a_bad_split_is_refused_before_any_rank() -> None:
    m = run_trial(_fsdp(trial(tp=2, dp=2, zero=2)), timeout_s=240)
    assert m.status == "ok", f"{m.error}\n{m.extra.get('output_tail')}"
    assert "tp" in m.extra["backend"]
    with pytest.raises(InfeasibleError) as e:
        run_trial(_fsdp(trial(dp=2, zero=1)), timeout_s=60)  # FSDP has no ZeRO-1
    assert "zero" in str(e.value).lower()


#: 4096 tokens on a 2-layer Llama of hidden 64: attention (4 S^2 h per layer) is ~13x the linear layers'
#: FLOPs and the activations ~50x the parameters, so splitting the sequence is what halves a rank's work
LONG = ModelSpec(name="tiny-long", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                 max_seq=4096, tied_embeddings=False, arch="llama")


def test_a_context_parallel_trial_runs_through_the_trial_path() -> None:
    """cp = 2 through Ray and the monitor (issue 48): a 4096-token sequence split over two ranks
    trains as the cp = 1 trial of the same data-parallel degree does (same rows: the loss of the
    same model), each of its 4 ranks holding half the sequence's activations."""
    training = TrainingSpec(global_batch=2, seq_len=4096, dtype="fp32")

    def spec(cp: int) -> TrialSpec:
        config = ParallelConfig(tp=1, pp=1, dp=2, cp=cp, mbs=1, global_batch=2, zero_stage=3)
        return TrialSpec(LONG, training, config, warmup_steps=1, min_steps=2, max_steps=2, stack="fsdp")

    one, two = run_trial(spec(1), timeout_s=400), run_trial(spec(2), timeout_s=400)
    for m in (one, two):
        assert m.status == "ok", f"{m.error}\n{m.extra.get('output_tail')}"
    assert two.extra["backend"] == "fsdp2-full-shard+cp2-ring" and len(two.peak_memory) == 4
    assert max(abs(a - b) for a, b in zip(two.losses, one.losses, strict=True)) <= 1e-4, (two.losses, one.losses)
    assert one.step_time is not None and two.step_time is not None
    print(f"\ncp1 dp2: step {one.step_time:.2f} s, peak {max(one.peak_memory) / 2**20:.1f} MiB/rank; "
          f"cp2 dp2: step {two.step_time:.2f} s, peak {max(two.peak_memory) / 2**20:.1f} MiB/rank")
    assert max(two.peak_memory) < 0.7 * max(one.peak_memory)


def test_tune_with_the_fsdp_stack_runs_fsdp_trials(tmp_path: Path) -> None:
    done = subprocess.run(_tune(tmp_path, "--stack", "fsdp", "--max-trials", "2", "--json"), capture_output=True,
                          text=True, env=_env(), timeout=850)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["stack"] == "fsdp" and result["trials_run"] == 2
    ran = [t for t in result["trials"] if t["measurement"]["status"] == "ok"]
    # the fsdp runner ran them: FSDP2, or the plain model where dp is 1 in fp32 ("torch+pp-1f1b...",
    # FsdpPlan.fsdp); the fsdp CPU terms rank pp layouts of dp 1 first since the pipeline terms
    assert ran and all(t["measurement"]["extra"]["backend"].startswith(("fsdp2", "torch+")) for t in ran), \
        [t["measurement"]["extra"]["backend"] for t in ran]
    assert all("deepspeed" not in t["measurement"]["extra"]["backend"] for t in ran)
    assert json.loads((tmp_path / "best" / "candidate.json").read_text())["stack"]["name"] == "fsdp"
    assert _no_rank_left()


def test_tune_over_both_families_runs_trials_of_each_and_picks_one(tmp_path: Path) -> None:
    """``--stack pipette,fsdp`` on the embedded default's 4 CPU devices (the cluster file) and recipe:
    one plan of DeepSpeed and FSDP candidates, each trial on its own runner, one pick. The space is
    cut to ZeRO-3, micro-batch 4, no recomputation (3 DeepSpeed candidates, 6 FSDP ones) and the stop
    rule held off, so six trials must reach the FSDP family: on CPU the fsdp stack is priced by its
    own CPU terms, which rank its candidates after DeepSpeed's."""
    cluster = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "cpu-4.yaml"
    argv = [sys.executable, "-m", "cli", "tune", "--cluster", str(cluster), "--dtype", "fp32",
            "--stack", "pipette,fsdp", "--zero", "3", "--micro-batches", "4", "--recompute", "none",
            "--schedules", "1f1b", "--stop-probability", "0.0001", "--max-trials", "6", "--steps", "3",
            "--home", str(tmp_path / "home"),
            "--out", str(tmp_path / "best"), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["stack"] == "pipette,fsdp"
    ran = [t for t in result["trials"] if t["measurement"]["status"] in ("ok", "pruned")]  # both stepped
    assert {t["stack"] for t in ran} == {"pipette", "fsdp"}, [t["label"] for t in result["trials"]]
    # the fsdp runner trains the plain model where dp is 1 in fp32 (FsdpPlan.fsdp): "torch+pp-1f1b..."
    runner = {"pipette": ("deepspeed",), "fsdp": ("fsdp2", "torch")}
    for t in ran:
        assert t["config"]["stack"] == t["stack"] and t["label"].endswith("-" + t["stack"])
        backend = t["measurement"]["extra"].get("backend")  # what ran it (an ok trial reports it)
        assert backend is None or backend.startswith(runner[t["stack"]]), (t["label"], backend)
    assert any(t["measurement"]["status"] == "ok" for t in ran)
    best = result["best"]
    assert best is not None and best["measurement"]["status"] == "ok"
    written = json.loads((tmp_path / "best" / "candidate.json").read_text())
    assert written["stack"]["name"] == best["config"]["stack"]  # the pick's launch files are its own stack's
    assert _no_rank_left()
