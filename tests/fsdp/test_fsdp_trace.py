"""Traced memory (``workers.rank.fsdp_trace``): one step of the PyTorch-native runner on fake tensors
and a fake process group, checked against a real CPU run of the same candidates, the optimizer's
states counted by hand, and the fsdp stack's estimate term by term."""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import pytest

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.memory import estimate_memory
from pipette.model import MODEL_PRESETS, ModelSpec
from pipette.stacks import FSDP, rank_layout
from pipette.training import TrainingSpec
from workers.rank.fsdp_trace import trace_heaviest, trace_rank
from workers.spec import TrialSpec

MiB = 1024**2
GiB = 1024**3


def _trial(model: ModelSpec, global_batch: int, seq: int, dtype: str, **fields: int | str) -> TrialSpec:
    training = TrainingSpec(global_batch=global_batch, seq_len=seq, dtype=dtype, method="full")  # type: ignore[arg-type]
    config = ParallelConfig(tp=int(fields.pop("tp", 1)), pp=int(fields.pop("pp", 1)), global_batch=global_batch,
                            **fields)  # type: ignore[arg-type]
    return TrialSpec(model, training, config, warmup_steps=2, min_steps=1, max_steps=1, device_kind="cpu",
                     stack="fsdp")


def _tensors(model: ModelSpec) -> int:
    """Parameter tensors of a Llama (each decoder layer: 7 projections and 2 norms; the embedding,
    the final norm, the head): AdamW keeps one fp32 ``step`` scalar per tensor."""
    return 9 * model.layers + 2 + (0 if model.tied_embeddings else 1)


def _optimizer_by_hand(model: ModelSpec, shards: int) -> int:
    """AdamW's fp32 exp_avg and exp_avg_sq of this rank's shard (2 x 4 bytes a parameter), and its
    step scalars; FSDP2's fp32 sharded parameters are the master weights (no copy)."""
    return 8 * model.total_params() // shards + 4 * _tensors(model)


def test_tiny_optimizer_state_is_two_fp32_moments_of_the_shard() -> None:
    model = MODEL_PRESETS["tiny-llama"]
    trace = trace_rank(_trial(model, 16, 128, "fp32", dp=4, mbs=4, zero_stage=3))
    # the states alive at the peak (the optimizer step's own temporaries count under its maximum)
    assert trace.at_peak["optimizer"] == _optimizer_by_hand(model, 4)
    # the fp32 sharded parameters (dim-0 shards of 1/4)
    assert trace.at_peak["parameters"] >= 4 * model.total_params() // 4
    assert trace.peak_bytes == sum(trace.at_peak.values())


@pytest.mark.slow
def test_llama3_8b_fsdp2_over_8_fake_ranks_in_a_minute() -> None:
    model = MODEL_PRESETS["llama3-8b"]
    cpu = time.process_time()
    trace = trace_rank(_trial(model, 8, 4096, "bf16", dp=8, mbs=1, zero_stage=3, recompute="selective"))
    # this process's CPU seconds, not the wall's: on a loaded machine the wall counts other work
    # too (86 s of wall on the 2-core VM at load 9, tests/fsdp run alone)
    assert time.process_time() - cpu < 60, (time.process_time() - cpu, trace.seconds)
    # 8.03e9 parameters over 8 shards: 7.48 GiB of Adam moments (not the 50 GiB of an unsharded count)
    assert trace.at_peak["optimizer"] == _optimizer_by_hand(model, 8)
    assert 7.4 * GiB < trace.at_peak["optimizer"] < 7.6 * GiB


#: the candidates traced and run for real (4 CPU ranks, tiny-llama, fp32, global batch 16 x 128)
REAL_CASES: dict[str, dict[str, int | str]] = {
    "z3-dp4": {"dp": 4, "mbs": 4, "zero_stage": 3},
    "tp2-dp2": {"tp": 2, "dp": 2, "mbs": 4, "zero_stage": 3},
    "pp2-dp2": {"pp": 2, "dp": 2, "mbs": 2, "zero_stage": 3},
}


@pytest.mark.slow
def test_traced_peak_is_a_real_cpu_runs_but_for_gloos_copies() -> None:
    """The runner's own measure (``PeakTensorBytes``, 4 gloo ranks: the CPU allocator's peak over
    the tensors alive before the step) against the trace of the same step: not under it (1%
    allowed), and over it by what the real gloo group adds. Gloo copies what it reduce-scatters or
    all-gathers into a temporary of the whole buffer (2.00 MiB for a 2 MiB buffer, an all-reduce
    none: tests/benchmarks/gloo_copies.py on 2 gloo ranks), which NCCL and the trace's fake group
    do not; where such a collective runs at the peak the run stands over its trace (2026-12-05:
    z3-dp4 0.0-1.8%, tp2-dp2 5.3-6.6%, pp2-dp2 1.3%). The count of operators' outputs this measure
    replaced stood 3.5-6.3% over, and counted earlier cases' garbage in later ones (up to 2.4x).

    Ranks of one stage hold the same tensors; whether a gloo temporary lands on a rank's peak is timing,
    so the run's figure is each stage's lowest rank, the heaviest stage's: the heaviest rank alone stood
    1.3-13.5% over its trace from run to run (tp2-dp2, pp2-dp2; at 20bd7c7 and after, 2026-12-05), and
    failed the bound in a suite run at 8.9%."""
    from tests.fsdp.cases import run_batch

    model = MODEL_PRESETS["tiny-llama"]
    trials = {name: _trial(model, 16, 128, "fp32", **dict(fields)) for name, fields in REAL_CASES.items()}
    batch = run_batch(trials, world=4, device_kind="cpu", timeout_s=600)
    for name, trial in trials.items():
        done = batch["cases"][name]["done"]
        assert len(done) == 4, batch["tails"][0][-2000:]
        layout = rank_layout(trial.config, "fsdp")
        stages: dict[int, list[int]] = {}
        for rank, e in done.items():  # a steady step's (warm-up 2)
            stages.setdefault(layout.index(int(rank), "pp"), []).append(int(e["peak_tensor_bytes"]))
        measured = max(min(peaks) for peaks in stages.values())
        traced = trace_heaviest(trial)[0].peak_bytes
        assert -0.08 < traced / measured - 1 < 0.01, (name, traced / MiB, measured / MiB)


@pytest.mark.parametrize("vocab", [512, 16384], ids=["tiny-llama", "vocab-16k"])
def test_traced_peak_is_the_cpu_allocators_peak_of_the_real_step(vocab: int) -> None:
    """The same step on real tensors (one rank of a fake process group, tp2-dp2: DTensor and FSDP2),
    its peak read from the CPU allocator's own allocations and frees (the runner's own measure,
    ``PeakTensorBytes``) on top of the tensors alive before it: the trace on fake tensors gives the same bytes.
    With a large vocabulary the loss's logits make the peak: DTensor's shape propagation, which
    runs each op again on fake tensors of the whole (global) shape, must not be counted (it was:
    the trace stood 13% over the allocator here, 2% with tiny-llama's, and counted 7.8 GiB of whole
    logits at Llama 70B tp8)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from workers.fsdp_spec import plan_for
    from workers.rank.fsdp_rank import FsdpRank
    from workers.rank.fsdp_trace import _fake_world
    from workers.rank.memory import PeakTensorBytes, live_tensor_bytes

    trial = _trial(replace(MODEL_PRESETS["tiny-llama"], vocab=vocab), 16, 128, "fp32", **dict(REAL_CASES["tp2-dp2"]))
    traced = trace_rank(trial).peak_bytes
    plan = plan_for(trial.model, trial.training, trial.config, "cpu", 4)
    _fake_world(4, 0)
    gc.collect()
    before = live_tensor_bytes()  # earlier tests' tensors this process still holds: not the step's
    try:
        runner = FsdpRank(trial, plan, 0, mesh=init_device_mesh("cpu", plan.mesh.sizes, mesh_dim_names=plan.mesh.names))
        first, second = runner.batches.next(), runner.batches.next()
        runner.train_step(*first)
        with PeakTensorBytes() as step:  # the CPU allocator's own peak, over the tensors alive
            runner.train_step(*second)
    finally:
        dist.destroy_process_group()
    base, peak = step.base - before, step.peak
    assert traced == pytest.approx(base + peak, rel=0.01), (traced / MiB, (base + peak) / MiB)


def test_traced_states_match_the_estimate_term_by_term() -> None:
    """Parameters, gradients and optimizer of the fsdp stack's estimate against the trace's own
    maxima, phase by phase (``pipette.memory_fsdp2``): each category's most is at the phase that
    gathers the most of it."""
    from pipette.memory import FSDP_OPTIONS, stage_breakdowns

    model = MODEL_PRESETS["tiny-llama"]
    trial = _trial(model, 16, 128, "fp32", dp=4, mbs=4, zero_stage=3)
    trace = trace_rank(trial)
    est = estimate_memory(model, trial.training, trial.config, 4 * GiB, device_kind="cpu", stack=FSDP)
    phases = {ph: stage_breakdowns(model, trial.training, trial.config, device_kind="cpu", options=FSDP_OPTIONS,
                                   phase=ph)[0] for ph in ("loss", "head", "layer")}
    assert trace.at_peak["optimizer"] == pytest.approx(est.breakdown["optimizer"], rel=0.01)
    # the sharded fp32 gradients FSDP2 reduce-scatters into: a quarter of the model's fp32 bytes
    # each; at the peak (the loss's backward, one micro-batch, no pipeline) there are none yet,
    # and the estimate counts none there
    assert trace.kinds_max["Sharded Grad"] == pytest.approx(model.total_params() * 4 / 4, rel=0.01)
    assert trace.at_peak["gradients"] == est.breakdown["gradients"] == 0
    # tiny-llama's peak is a layer's backward in both (its logits are small): the sharded parameters,
    # the root held since the head's backward, the layer and the next one prefetched
    assert phases["layer"]["weights"] > phases["head"]["weights"] > phases["loss"]["weights"]
    assert trace.at_peak["parameters"] == pytest.approx(est.breakdown["weights"], rel=0.01)
    assert trace.at_peak["parameters"] == pytest.approx(phases["layer"]["weights"], rel=0.01)
    assert trace.category_max["parameters"] == pytest.approx(phases["layer"]["weights"], rel=0.01)
    # the layer's backward's own temporaries (its activations' gradients, 2.7 MiB) are not counted:
    # the estimate is 9.5% under the trace here (docs/results.md, "Traced memory")
    traced_transient = trace.at_peak["activations"] + trace.at_peak["temporaries"]
    assert traced_transient == pytest.approx(est.breakdown["activations"] + est.breakdown["logits"], rel=0.25)
    assert -0.12 < est.live_bytes / trace.peak_bytes - 1 < 0


def test_a_rank_outside_the_world_is_refused_in_one_line() -> None:
    trial = _trial(MODEL_PRESETS["tiny-llama"], 16, 128, "fp32", dp=4, mbs=4, zero_stage=3)
    with pytest.raises(SpecError, match="rank 4 is not in a world of 4"):
        trace_rank(replace(trial), 4)


def test_a_cp_rank_traces_half_the_sequences_activations() -> None:
    """Context parallelism in the trace (issue 48): the cp ring's point-to-point exchange runs on the
    fake process group, and a cp = 2 rank of a 4096-token step holds about half the activations of
    a cp = 1 rank, its model states sharded over dp_shard x cp (traced on the 2-core dev VM: 50.4 ->
    26.2 MiB live peak; 41.8 -> 21.9 MiB of activations; the real trials measured 46.8 -> 24.8 MiB)."""
    model = ModelSpec(name="tiny-long", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                      max_seq=4096, tied_embeddings=False, arch="llama")
    one = trace_rank(_trial(model, 2, 4096, "fp32", dp=2, mbs=1, zero_stage=3))
    two = trace_rank(_trial(model, 2, 4096, "fp32", dp=2, cp=2, mbs=1, zero_stage=3))
    assert two.world == 4 and 0.45 < two.at_peak["activations"] / one.at_peak["activations"] < 0.55
    assert two.at_peak["optimizer"] < one.at_peak["optimizer"]  # shards over dp_shard x cp = 4, not 2


def test_qwen3s_q_and_k_norms_are_in_the_estimate_as_traced() -> None:
    """Qwen3's per-head q/k RMSNorms keep their fp32-cast input and their output (``qk_norm_bytes``): traced,
    the same shapes with and without the norms differ by what the estimate adds, within 10%; with them the
    estimate is as close to the trace as without (before: 2.78 against 3.34 GiB traced at 8 layers, hidden
    1024, 2 x 2048 tokens in bf16, 16.8% under, where the same shapes without the norms were 8.9% under;
    now 8.1%; 2026-12-05)."""
    from pipette.stacks import FSDP

    config = {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 512, "vocab_size": 1024,
              "max_position_embeddings": 512, "tie_word_embeddings": False, "_name_or_path": "tiny-qwen3-trace"}
    qwen3 = ModelSpec.from_hf_config(config)
    plain = ModelSpec.from_hf_config({**config, "model_type": "llama", "attention_bias": False})
    assert plain.attention is not None and not plain.attention.qk_norm and qwen3.attention is not None
    runs = {}
    for model in (qwen3, plain):
        trial = _trial(model, 4, 512, "bf16", dp=2, mbs=2, zero_stage=3)
        est = estimate_memory(model, trial.training, trial.config, 4 * GiB, device_kind="cpu", stack=FSDP)
        runs[model.attention.qk_norm] = (trace_rank(trial).peak_bytes, est.live_bytes)
    (traced_q, est_q), (traced_p, est_p) = runs[True], runs[False]
    assert est_q - est_p == pytest.approx(traced_q - traced_p, rel=0.10), (traced_q - traced_p, est_q - est_p)
    # and Qwen3's estimate is as close to its trace as the same shapes' without the norms (9.3% and 10.9% under)
    assert abs(est_q / traced_q - 1) <= abs(est_p / traced_p - 1) + 0.01
