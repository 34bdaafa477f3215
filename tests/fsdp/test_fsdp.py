"""The PyTorch-native runner (``workers.rank.fsdp``) for real on 4 CPU devices (gloo): FSDP2 full
shard, no reshard, HSDP 2x2, FSDP2 x TP2 and PP2 x FSDP2, full and LoRA, plus the other
compositions (NO_SHARD, activation checkpointing full and per-op, interleaved 1F1B, GPipe,
TP2 x PP2, CPU offload, bf16 mixed precision), each against one device's run of the same model
on the same tokens (``tests.fsdp.cases``: the cases, the launch and the tolerances, shared with
``tests/gpu/test_gpu_fsdp.py``).

Neither Ray nor DeepSpeed is needed (so not under tests/integration, whose fixtures start Ray and
build DeepSpeed's op). All cases train in one set of 4 rank processes (the ranks import torch once), the references in
one process; then the entry (``python -m workers.rank.fsdp --candidate``) runs once on 2 ranks.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fsdp import cases as fc
from workers.host.outcome import Outcome, measurement

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: bf16 cases on the CPU too (FSDP2's MixedPrecisionPolicy, the GPU's dtype), against bf16 references
BF16 = {"fsdp/full", "fsdp-tp2/lora", "pp2-fsdp/full"}
#: what a ``done`` event of the DeepSpeed runner carries (``workers.rank.trial.train``)
DONE_FIELDS = {"event", "rank", "step_times", "losses", "phases", "peak_tensor_bytes", "peak_rss_bytes",
               "step_cpu_times", "trainable_params", "held_param_bytes", "backend", "device"}


@pytest.fixture(scope="module")
def refs() -> dict[str, Any]:
    out = fc.references("cpu", ("fp32", "bf16"))
    assert not any(out["codes"]), "\n".join(out["tails"])
    return out


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    cases = fc.cases("cpu", "fp32")
    cases |= {f"{name}-bf16": v for name, v in fc.cases("cpu", "bf16").items() if name in BF16}
    out = fc.run_batch({n: c[0] for n, c in cases.items()}, 4, "cpu", 500, {n: c[1] for n, c in cases.items()})
    out["keys"] = {n: c[2] for n, c in cases.items()}
    print(f"\n4-rank batch: {len(cases)} cases in {out['wall_s']:.1f} s")
    return out


def _check(batch: dict[str, Any], refs: dict[str, Any], name: str, key: str | None = None) -> None:
    dtype = "bf16" if "bf16" in name or name in fc.ONE_RANK else "fp32"
    key = key or batch["keys"][name]
    done = fc.check_case(batch, refs, name, key, dtype)
    loss, norm = fc.deltas(done, refs["cases"][key]["done"][0])
    print(f"| {name} | {done['backend']} | {max(map(abs, loss)):.1e} | {max(norm):.1e} | "
          f"{statistics.median(done['step_times']):.3f} | {batch['cases'][name]['seconds']:.1f} |")


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("mode", list(fc.MODES))
def test_each_mode_trains_as_one_device_does(batch: dict[str, Any], refs: dict[str, Any], mode: str,
                                            method: str) -> None:
    _check(batch, refs, f"{mode}/{method}")


@pytest.mark.parametrize("name", [f"{n}/{'lora' if m.get('lora') else 'full'}" for n, m in fc.EXTRA.items()])
def test_each_composition_trains_as_one_device_does(batch: dict[str, Any], refs: dict[str, Any], name: str) -> None:
    _check(batch, refs, name)


@pytest.mark.parametrize("name", list(fc.FAMILY_CASES))
def test_qwen_attention_under_tensor_parallelism_trains_as_one_device_does(
        batch: dict[str, Any], refs: dict[str, Any], name: str) -> None:
    """Qwen3's per-head q/k norms (``workers.rank.fsdp_parallel.QK_NORMS``) and Qwen2's q/k/v biases under
    FSDP2 x TP2: loss and gradient norm as one device's run of the same model (Qwen3's norm weights left plain
    parameters mixed meshes in the gradient norm and failed the step; 2026-12-05)."""
    _check(batch, refs, name)


@pytest.mark.parametrize("name", sorted(BF16))
def test_bf16_mixed_precision_trains_as_one_device_in_bf16(batch: dict[str, Any], refs: dict[str, Any],
                                                          name: str) -> None:
    _check(batch, refs, f"{name}-bf16")


@pytest.mark.parametrize("name", list(fc.ONE_RANK))
def test_one_rank_shards_on_a_one_rank_mesh_with_offload(refs: dict[str, Any], name: str) -> None:
    """What the GPU test runs on one GPU: ``fully_shard`` on a one-rank mesh for bf16 mixed
    precision, with CPU offload, per-op checkpointing and LoRA; the loss of the plain run."""
    _check(refs, refs, name, fc.ref_key(name.rsplit("/", 1)[1], "bf16"))
    done = refs["cases"][name]["done"][0]
    assert done["backend"].startswith("fsdp2-one-rank+") and "cpu-offload" in done["backend"]


def test_done_events_are_the_deepspeed_runners(batch: dict[str, Any]) -> None:
    """Every rank's ``done`` has the DeepSpeed runner's fields; the executor's own reading of
    them (``workers.host.outcome.measurement``) makes an ``ok`` measurement with the backend named."""
    done = batch["cases"]["pp2-fsdp/lora"]["done"]
    for event in done.values():
        assert DONE_FIELDS <= set(event), DONE_FIELDS - set(event)
        assert event["device"] == "cpu" and event["peak_tensor_bytes"] > 0 and event["held_param_bytes"] > 0
    trial = fc.cases("cpu", "fp32")["pp2-fsdp/lora"][0]
    m = measurement(trial, Outcome("ok"), [], done, [], 1.0)
    assert m.status == "ok" and len(m.step_times) == trial.max_steps
    assert m.extra["backend"] == "fsdp2-full-shard+pp-1f1b+peft-lora"
    # a pipeline rank holds its stage's shards: the two stages of pp2 hold different parts
    assert done[0]["held_param_bytes"] != done[2]["held_param_bytes"]


def test_the_entry_trains_a_candidate_as_the_executor_starts_it(refs: dict[str, Any], tmp_path: Path) -> None:
    """``python -m workers.rank.fsdp --candidate candidate.json`` on 2 ranks: the events the
    executor reads, in order, and the loss of one device."""
    trial = fc.trial({"dp": 2, "mbs": 2, "zero_stage": 3}, "lora")
    path = tmp_path / "candidate.json"
    path.write_text(json.dumps(trial.candidate()))
    events, codes, tails = fc.launch(["-m", "workers.rank.fsdp", "--candidate", str(path)], 2, "cpu", 240)
    assert codes == [0, 0], "\n".join(tails)
    kinds = [e["event"] for e in events[0]]
    assert kinds[0] == "phase" and "rank" in kinds and kinds[-1] == "done", kinds
    phases = [e["phase"] for e in events[0] if e["event"] == "phase"]
    assert phases == ["start", "imports", "rendezvous", "ops", "build", "engine", "warmup", "steps", "end"], phases
    steps = [e for e in events[0] if e["event"] == "step"]
    done = {r: next(e for e in events[r] if e["event"] == "done") for r in range(2)}
    m = measurement(trial, Outcome("ok"), steps, done, [], 1.0)
    assert m.status == "ok" and m.extra["backend"] == "fsdp2-full-shard+peft-lora"
    ref = refs["cases"][fc.ref_key("lora", "fp32")]["done"][0]
    assert max(abs(a - b) for a, b in zip(m.losses, ref["losses"], strict=True)) <= fc.FP32_LOSS_TOL
    assert set(done[0]["phases"]) >= {"start", "imports", "rendezvous", "build", "steps"}


def test_a_bad_candidate_ends_before_the_rendezvous_in_one_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from pipette.errors import SpecError
    from workers.rank import fsdp

    path = tmp_path / "candidate.json"
    path.write_text(json.dumps(fc.trial(fc.MODES["fsdp-tp2"], "full").candidate()))
    monkeypatch.setattr("workers.rank.train.own_session", lambda: False)  # not this test process's session
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_PORT", str(fc.free_port()))  # nothing listens: a rendezvous would hang
    with pytest.raises(SpecError) as e:
        fsdp.main(["--candidate", str(path)])
    assert "\n" not in str(e.value) and e.value.field == "config" and "3 processes" in str(e.value)


def test_the_stage_is_the_deepspeed_runners_model() -> None:
    """The whole model as one stage has the DeepSpeed runner's initial values (``workers.rank.build``:
    same names, same seed) and computes Hugging Face's own forward: a DeepSpeed trial and an
    fsdp trial of one job start from the same loss."""
    pytest.importorskip("deepspeed")  # workers.rank.build's pipeline part imports it
    from workers.rank.build import materialize as ds_materialize
    from workers.rank.build import prepare
    from workers.rank.fsdp_data import GlobalBatches
    from workers.rank.fsdp_model import build_stages, materialize, meta_model, parameter_names

    trial = fc.reference("lora")
    prep = prepare(trial, 0, torch.float32)
    ds_materialize([prep.module], torch.device("cpu"), torch.float32, trial.seed, prep.std)
    by_name = {p.pipette_name: p for p in prep.module.parameters()}  # type: ignore[attr-defined]
    meta = meta_model(trial.model, trial.training)
    stage = build_stages(meta, [0], 1, trial.training.seq_len)[0]
    names = parameter_names(stage)
    materialize(stage, names, torch.device("cpu"), torch.device("cpu"), trial.seed, meta.std)
    for fqn, p in stage.named_parameters():
        assert torch.equal(p, by_name[names[fqn].name]), fqn
    assert len(names) == len(by_name)
    ids, _ = GlobalBatches(trial.model.vocab, trial.training.seq_len, 8, 1, 0).next()
    with torch.no_grad():
        torch.testing.assert_close(stage(ids), prep.hf(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_a_checkpoint_gives_the_base_weights(tmp_path: Path) -> None:
    """With a local checkpoint (``save_pretrained``) the base weights are its tensors, whatever the
    seed; LoRA's adapters are drawn as without one (B zero)."""
    from workers.rank.fsdp_model import build_stages, materialize, meta_model, parameter_names
    from workers.rank.hf_model import build_llama

    trial = fc.reference("lora")
    saved = build_llama(trial.model, seed=5)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    meta = meta_model(trial.model, trial.training)
    stage = build_stages(meta, [0], 1, trial.training.seq_len)[0]
    names = parameter_names(stage)
    materialize(stage, names, torch.device("cpu"), torch.device("cpu"), 0, meta.std, str(tmp_path))
    weights = dict(saved.named_parameters())
    for fqn, p in stage.named_parameters():
        name = names[fqn].name
        if "lora_" in name:
            assert "lora_A" in name or not p.any(), fqn
        else:
            assert torch.equal(p, weights[name]), fqn


def test_a_gpu_rank_puts_its_tensors_where_nccl_and_fsdp2_want_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device answers the GPU path runs on (``rank_devices``), checked without a GPU: compute
    on ``cuda:LOCAL_RANK``; the runner's own collectives on that GPU (NCCL knows no host tensor);
    the sharded parameters made on the host only under CPU offload."""
    from workers.rank.devices import process_group_backend
    from workers.rank.fsdp_rank import rank_devices

    monkeypatch.setenv("LOCAL_RANK", "3")
    gpu = rank_devices("gpu", offload=False)
    assert gpu.compute == gpu.collective == gpu.init == torch.device("cuda", 3)
    assert rank_devices("gpu", offload=True).init == torch.device("cpu")
    cpu = rank_devices("cpu", offload=False)
    assert cpu.compute == cpu.collective == cpu.init == torch.device("cpu")
    # offloaded gradients are host tensors: a GPU rank's group then runs gloo for them (torchtitan)
    assert process_group_backend("gpu", host_collectives=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("gpu", host_collectives=False) == "nccl"
    assert process_group_backend("cpu", host_collectives=True) == "gloo"


def test_a_gpu_trial_without_a_gpu_fails_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from workers.rank.devices import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sees no GPU"):
        init_distributed("gpu", 0, 1, dist.HashStore())
    assert not dist.is_initialized()


OOM_ERRORS = ["CUDA out of memory. Tried to allocate 2.00 GiB", "std::bad_alloc: can't allocate memory"]


@pytest.mark.parametrize("error", OOM_ERRORS)
def test_out_of_memory_is_reported_as_the_deepspeed_runner_does(monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    from pipette.contract import OOM_EXIT
    from workers.fsdp_spec import plan_for
    from workers.rank.trial import train_or_oom

    def no_memory() -> None:
        raise RuntimeError(error)

    trial = fc.reference("full")
    events: list[dict[str, Any]] = []
    plan_for(trial.model, trial.training, trial.config)
    assert train_or_oom(no_memory, trial, 0, torch.device("cpu"), events.append) == OOM_EXIT
    (event,) = events
    assert event["event"] == "oom" and event["rank"] == 0 and event["error"] == error
    assert event["bytes"] == (2 * 2**30 if "GiB" in error else 0)
    assert event["where"] == ("device" if "CUDA" in error else "host") and "phase" in event


def test_rank_code_imports_nothing_of_the_host() -> None:
    """The rank program runs where no Ray, host code or DeepSpeed is: it imports none of them
    (``tests/unit/test_trial_path.py`` checks every rank module for the host)."""
    import ast

    host = {"ray", "workers.host", "deepspeed"}
    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "workers" / "rank").glob("fsdp*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad = [n for n in names if any(n == h or n.startswith(h + ".") for h in host)]
                assert not bad, f"{path.name} imports {bad}"


def test_losses_fall_from_ln_vocab(refs: dict[str, Any]) -> None:
    """The references themselves learn the synthetic task from an untrained ln V."""
    for key in ("full-fp32", "lora-fp32"):
        losses = refs["cases"][key]["done"][0]["losses"]
        assert losses[0] > math.log(fc.MODEL.vocab) - 0.5 and losses[-1] < losses[0] - 1.0, (key, losses)
