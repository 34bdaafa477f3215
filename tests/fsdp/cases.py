"""The PyTorch-native runner's cases, shared by the CPU test (``tests/fsdp/test_fsdp.py``,
4 gloo ranks) and the GPU test (``tests/gpu/test_gpu_fsdp.py``, NCCL): the same tiny Llama, the
same modes, the same launch of real rank processes and the same comparison with one device.

A batch of cases runs in one set of rank processes (``python -m tests.fsdp.ranks``): the ranks
import torch once and train each case in turn on the same process group, each case on a mesh
of its own, so the CPU file stays within its time (imports are ~6 s of CPU per process).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipette.config import ParallelConfig
from pipette.contract import rank_env, split_event
from pipette.model import ModelSpec
from pipette.training import LoraSpec, TrainingSpec
from workers.spec import TrialSpec

ROOT = Path(__file__).resolve().parents[2]

#: 4 layers (2 pipeline stages x 2 virtual stages), GQA heads that tp=2 divides
MODEL = ModelSpec(name="tiny-fsdp", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                  max_seq=64, tied_embeddings=False, arch="llama")
#: Qwen3's attention on the same shapes (``workers.rank.hf_model``): q/k RMSNorms over each head, and heads of
#: 24 (not hidden / heads = 16), which tensor parallelism shards with the q/k norms over each rank's heads
QWEN3 = ModelSpec.from_hf_config({
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 128, "vocab_size": 256,
    "max_position_embeddings": 64, "tie_word_embeddings": False, "_name_or_path": "tiny-fsdp-qwen3"})
#: Qwen2's: biases on q, k and v (cut with their columns under tensor parallelism)
QWEN2 = ModelSpec.from_hf_config({
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "_name_or_path": "tiny-fsdp-qwen2"})
#: the model of a case's ``model`` key
MODELS = {"llama": MODEL, "qwen3": QWEN3, "qwen2": QWEN2}
GLOBAL_BATCH, SEQ = 8, 32
#: the modes of issue 31 on 4 ranks (ParallelConfig fields); extra: FsdpPlan fields set over the plan
MODES: dict[str, dict[str, Any]] = {
    "fsdp": {"dp": 4, "mbs": 2, "zero_stage": 3},
    "no-reshard": {"dp": 4, "mbs": 2, "zero_stage": 2},
    "hsdp-2x2": {"dp": 4, "mbs": 2, "zero_stage": 3, "dp_shard": 2},
    "fsdp-tp2": {"dp": 2, "tp": 2, "mbs": 2, "zero_stage": 3},
    "pp2-fsdp": {"dp": 2, "pp": 2, "mbs": 2, "zero_stage": 3},
}
#: further compositions, trained once each (full fine-tuning unless named lora)
EXTRA: dict[str, dict[str, Any]] = {
    "replicate": {"dp": 4, "mbs": 1, "zero_stage": 0},
    "fsdp-ac-full": {"dp": 4, "mbs": 2, "zero_stage": 3, "recompute": "full"},
    "fsdp-ac-selective": {"dp": 4, "mbs": 2, "zero_stage": 3, "recompute": "selective"},
    "pp2-interleaved-fsdp": {"dp": 2, "pp": 2, "mbs": 1, "zero_stage": 3, "schedule": "interleaved",
                             "virtual_stages": 2},
    "pp2-gpipe-fsdp": {"dp": 2, "pp": 2, "mbs": 2, "zero_stage": 2, "extra": {"schedule": "gpipe"}},
    "tp2-pp2": {"tp": 2, "pp": 2, "mbs": 2, "zero_stage": 3},
    "fsdp-offload": {"dp": 4, "mbs": 2, "zero_stage": 3, "offload": True},
    "tp2-pp2-lora-ac": {"tp": 2, "pp": 2, "mbs": 2, "zero_stage": 3, "recompute": "full", "lora": True},
}
#: other families' attention under FSDP2 x TP2, each against one device's run of its own model: Qwen3's
#: (full and LoRA) and Qwen2's (full)
FAMILY_CASES: dict[str, dict[str, Any]] = {
    "fsdp-tp2-qwen3/full": {"dp": 2, "tp": 2, "mbs": 2, "zero_stage": 3, "model": "qwen3"},
    "fsdp-tp2-qwen3/lora": {"dp": 2, "tp": 2, "mbs": 2, "zero_stage": 3, "model": "qwen3"},
    "fsdp-tp2-qwen2/full": {"dp": 2, "tp": 2, "mbs": 2, "zero_stage": 3, "model": "qwen2"},
}


#: How far a run may be from one device's, and why. fp32: the ranks sum the same products in
#: another order (FSDP2's reduce-scatter over dp, TP's partial sums, the micro-batches), which
#: moves the last bits of a gradient (~1e-7 relative); AdamW's normalised step carries that
#: relative error into the weights, and four steps at lr 1e-2 moved the loss by at most 3.1e-6
#: on this machine: 1e-4 leaves 30x of room, and is 500x below what the bugs this caught did
#: (the frozen norms that trained under TP + LoRA: 5e-2 after one step). The gradient norm
#: (before clipping) is compared too: AdamW with clipping hides a gradient scaled by a constant
#: from the losses (its step is scale-free), not from the norm.
FP32_LOSS_TOL, FP32_NORM_RTOL = 1e-4, 1e-4
#: bf16 (FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 master weights and reduction): a
#: matmul's rounding depends on its shapes (mbs 2 against 8), so two correct bf16 runs differ
#: by up to 3.2e-3 nats over the four steps (measured on CPU): 2e-2 is 6x that.
BF16_LOSS_TOL, BF16_NORM_RTOL = 2e-2, 5e-2


def training(method: str, dtype: str = "fp32") -> TrainingSpec:
    lora = LoraSpec(rank=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    return TrainingSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype=dtype, method=method,  # type: ignore[arg-type]
                        lora=lora if method == "lora" else None)


def trial(mode: dict[str, Any], method: str, device_kind: str = "cpu", dtype: str = "fp32", steps: int = 4,
          **options: Any) -> TrialSpec:
    """The trial of one mode: ``steps`` steps in all (one warm-up), every one compared."""
    fields = {k: v for k, v in mode.items() if k not in ("extra", "lora", "model")}
    config = ParallelConfig(tp=fields.pop("tp", 1), pp=fields.pop("pp", 1), dp=fields.pop("dp", 1),
                            mbs=fields.pop("mbs"), global_batch=GLOBAL_BATCH, **fields)
    return TrialSpec(MODELS[mode.get("model", "llama")], training(method, dtype), config, warmup_steps=1,
                     min_steps=steps - 1, max_steps=steps - 1, device_kind=device_kind, lr=1e-2, **options)


def reference(method: str, device_kind: str = "cpu", dtype: str = "fp32", steps: int = 4,
              model: str = "llama") -> TrialSpec:
    """The same job on one device: the whole global batch in one micro-batch."""
    return trial({"mbs": GLOBAL_BATCH, "zero_stage": 0, "model": model}, method, device_kind, dtype, steps)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(argv: list[str], world: int, device_kind: str, timeout_s: float,
           env: dict[str, str] | None = None) -> tuple[list[list[dict[str, Any]]], list[int], list[str]]:
    """Start ``world`` rank processes of ``python argv`` with the environment every transport
    gives a rank (``pipette.contract.rank_env``: on GPUs each rank sees only its own, GPU
    ``rank``); returns each rank's events, exit status and output tail. CPU ranks of
    ``-m MODULE`` fork from one warm process (``tests.fsdp.forkranks``), as the product's CPU
    ranks fork from a node's zygote; GPU ranks start a fresh interpreter each."""
    master = ("127.0.0.1", free_port())
    work = Path(tempfile.mkdtemp(prefix="pipette-ranks-"))
    logs = [work / f"rank{rank}.log" for rank in range(world)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    envs = [os.environ | rank_env(device_kind, rank, world, master, gpu=str(rank)) | {"PYTHONPATH": path} | (env or {})
            for rank in range(world)]
    codes_path = work / "codes.json"
    procs: list[subprocess.Popen[bytes]] = []
    forked = device_kind == "cpu" and argv[0] == "-m"
    if forked:
        spec = {"module": argv[1], "args": argv[2:], "envs": envs, "logs": [str(p) for p in logs],
                "codes": str(codes_path)}
        (work / "spec.json").write_text(json.dumps(spec))
        with open(work / "fork.err", "wb") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.fsdp.forkranks", str(work / "spec.json")],
                                          cwd=ROOT, env=envs[0], stdout=subprocess.DEVNULL, stderr=err,
                                          start_new_session=True))
    else:
        for rank in range(world):
            with open(logs[rank], "wb") as out:
                procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=envs[rank], stdout=out,
                                              stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                if forked:  # the launcher's process group: its ranks (a rank that left it dies with it)
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
                p.wait()
    codes = [int(p.returncode) for p in procs]
    if forked:  # each rank's status, or the launcher's for all when it ended first
        codes = json.loads(codes_path.read_text()) if codes_path.exists() else codes * world
    events, tails = [], []
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        split = [split_event(line) for line in text.splitlines()]
        events.append([json.loads(e) for e, _ in split if e is not None])
        tails.append("\n".join(text for e, text in split if e is None)[-6000:])
    if (work / "fork.err").exists() and (said := (work / "fork.err").read_text(errors="replace")):
        tails[0] = f"{tails[0]}\nthe fork launcher: {said[-2000:]}"
    shutil.rmtree(work, ignore_errors=True)
    return events, codes, tails


def run_batch(cases: dict[str, TrialSpec], world: int, device_kind: str, timeout_s: float,
              extra: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train every case in one set of ``world`` rank processes; returns, per case, the ``done``
    event of every rank (or the failure's output), and the batch's wall time."""
    work = Path(tempfile.mkdtemp(prefix="pipette-fsdp-"))
    spec = [{"name": n, "candidate": t.candidate(), "extra": (extra or {}).get(n, {})} for n, t in cases.items()]
    (work / "cases.json").write_text(json.dumps(spec))
    start = time.monotonic()
    events, codes, tails = launch(["-m", "tests.fsdp.ranks", str(work / "cases.json")], world, device_kind, timeout_s)
    out: dict[str, Any] = {"wall_s": time.monotonic() - start, "codes": codes, "tails": tails, "cases": {}}
    for name in cases:
        done = {e["rank"]: e for rank_events in events for e in rank_events
                if e.get("case") == name and e["event"] == "done"}
        seconds = [e["seconds"] for rank_events in events for e in rank_events
                   if e.get("case") == name and e["event"] == "case"]
        out["cases"][name] = {"done": done, "seconds": max(seconds) if seconds else None}
    return out


def cases(device_kind: str, dtype: str) -> dict[str, tuple[TrialSpec, dict[str, Any], str]]:
    """Every case of a batch: name -> (trial, FsdpPlan fields set over its plan, reference key)."""
    out: dict[str, tuple[TrialSpec, dict[str, Any], str]] = {}
    for name, mode in MODES.items():
        for method in ("full", "lora"):
            out[f"{name}/{method}"] = (trial(mode, method, device_kind, dtype), {}, ref_key(method, dtype))
    for name, mode in EXTRA.items():
        method = "lora" if mode.get("lora") else "full"
        extra = mode.get("extra", {})
        out[f"{name}/{method}"] = (trial(mode, method, device_kind, dtype), extra, ref_key(method, dtype))
    for name, mode in FAMILY_CASES.items():
        method = name.rsplit("/", 1)[1]
        out[name] = (trial(mode, method, device_kind, dtype), {}, ref_key(method, dtype, mode["model"]))
    return out


def ref_key(method: str, dtype: str, model: str = "llama") -> str:
    return f"{method}-{dtype}" + ("" if model == "llama" else f"-{model}")


#: one rank under ``fully_shard`` (a one-rank mesh: FSDP2 for its mixed precision and offload)
ONE_RANK: dict[str, dict[str, Any]] = {
    "one-rank-offload/full": {"mbs": 2, "zero_stage": 3, "offload": True},
    "one-rank-offload-sac/lora": {"mbs": 4, "zero_stage": 3, "offload": True, "recompute": "selective"},
}


def references(device_kind: str, dtypes: tuple[str, ...], one_rank: bool = True) -> dict[str, Any]:
    """One device's runs of the job (one rank process), full and LoRA in each dtype; then, in
    bf16, the ``ONE_RANK`` cases (compared with these by ``check_case``)."""
    runs = {("full", "llama"), ("lora", "llama")}
    runs |= {(n.rsplit("/", 1)[1], m["model"]) for n, m in FAMILY_CASES.items()}
    refs = {ref_key(m, d, model): reference(m, device_kind, d, model=model)
            for m, model in sorted(runs) for d in dtypes}
    if one_rank:
        refs |= {n: trial(mode, n.rsplit("/", 1)[1], device_kind, "bf16") for n, mode in ONE_RANK.items()}
    return run_batch(refs, 1, device_kind, 300)


def deltas(run: dict[str, Any], ref: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(loss - reference loss, relative gradient-norm difference) per step."""
    loss = [a - b for a, b in zip(run["losses"], ref["losses"], strict=True)]
    norm = [abs(a - b) / b for a, b in zip(run["grad_norms"], ref["grad_norms"], strict=True)]
    return loss, norm


def check_case(batch: dict[str, Any], refs: dict[str, Any], name: str, key: str, dtype: str) -> dict[str, Any]:
    """Assert that case ``name`` trained on every rank as one device did; returns its rank 0's done."""
    done = batch["cases"][name]["done"]
    tail = "\n".join(batch["tails"])[-4000:]
    assert len(done) == len(batch["codes"]), f"{name}: {len(done)} ranks reported; exit codes {batch['codes']}\n{tail}"
    ref = refs["cases"][key]["done"][0]
    loss_tol, norm_rtol = (FP32_LOSS_TOL, FP32_NORM_RTOL) if dtype == "fp32" else (BF16_LOSS_TOL, BF16_NORM_RTOL)
    for rank, event in done.items():
        assert event["losses"] == done[0]["losses"], f"{name}: rank {rank} reported other losses"
    loss, norm = deltas(done[0], ref)
    assert max(map(abs, loss)) <= loss_tol, f"{name}: loss - one device's = {loss} (tolerance {loss_tol})"
    assert max(norm) <= norm_rtol, f"{name}: gradient norm off by {norm} (relative tolerance {norm_rtol})"
    assert done[0]["losses"][-1] < done[0]["losses"][0] - 0.5, f"{name}: it did not learn: {done[0]['losses']}"
    return dict(done[0])
