"""One rank of the context-parallel checks (``tests/fsdp/test_context_parallel.py``): ring
attention and Ulysses on cp sub-meshes of one gloo process group, each against the whole
causal attention every rank computes on one process, and the tiny Llama with its attention
routed through the cp hook against the same Llama on the whole sequence.

    python -m tests.fsdp.cp_ranks        # 4 gloo ranks
    python -m tests.fsdp.cp_ranks gpu    # NCCL, cp over the world (one GPU: a world of 1)

Each check emits one event (``workers.rank.trial.emit``) with its largest differences; the
test asserts on them. A check that raises ends the process (its peers would wait on it).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

#: GQA shapes: 8 query heads on 4 key/value heads (Ulysses 4 needs 4 | kv_heads); 32 tokens
#: make 8 chunks at cp=4
BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 8, 4, 32, 8
CASES = (("ring", 2), ("ring", 4), ("ulysses", 2), ("ulysses", 4))
#: the Llama through the hook: (kind, degree, activation checkpointing)
MODEL_CASES = (("ring", 2, "none"), ("ulysses", 4, "none"), ("ring", 4, "selective"), ("ulysses", 2, "full"))


def _mesh(degree: int, world: int, device: str = "cpu") -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (world // degree, degree), mesh_dim_names=("dp", "cp"))["cp"]


def attention_check(kind: str, degree: int, world: int, device: str = "cpu", dtype: str = "float32",
                    path: str | None = None) -> dict[str, Any]:
    """Outputs and q/k/v gradients of ``kind`` at ``degree`` against one process's SDPA (in fp32
    on the same inputs); ``path`` "ring" forces this module's ring where the device picks torch's."""
    import torch
    import torch.nn.functional as F

    from workers.rank.context_parallel import ContextParallel, attention_path, balanced_plan
    from workers.rank.ring_attention import ring_attention

    torch.manual_seed(1)
    kind_of = getattr(torch, dtype)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device).to(kind_of).float().requires_grad_(True)
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, device=device).to(kind_of).float().requires_grad_(True)
            for _ in range(2))
    weight = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device)  # a loss whose gradient differs per element
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (ref * weight).sum().backward()
    context = ContextParallel(kind, _mesh(degree, world, device), SEQ)  # type: ignore[arg-type]
    parts = [context.shard(t.detach(), dim=2).to(kind_of).requires_grad_(True) for t in (q, k, v)]
    start = time.perf_counter()
    if path == "ring":
        out = ring_attention(*parts, context.mesh.get_group(), balanced_plan(degree), HEAD_DIM**-0.5)
    else:
        out = context.attend(*parts, scale=HEAD_DIM**-0.5)
    (out * context.shard(weight, dim=2)).sum().backward()
    seconds = time.perf_counter() - start
    assert q.grad is not None and k.grad is not None and v.grad is not None
    errors = {"out": (out.float() - context.shard(ref.detach(), dim=2)).abs().max().item()}
    for name, part, whole in zip("qkv", parts, (q.grad, k.grad, v.grad), strict=True):
        assert part.grad is not None
        errors[f"d{name}"] = (part.grad.float() - context.shard(whole, dim=2)).abs().max().item()
    scale = {"out": ref.abs().max().item(), "dq": q.grad.abs().max().item(), "dk": k.grad.abs().max().item()}
    return {"check": f"{kind}{degree}", "errors": errors, "scale": scale, "seconds": seconds,
            "positions": context.positions().tolist(), "dtype": str(out.dtype),
            "path": path or attention_path(parts[0].device)}


def model_check(kind: str, degree: int, world: int, recompute: str = "none") -> dict[str, Any]:
    """The tiny Llama (GQA) with its attention through the cp hook: loss and every weight's
    gradient (summed over the cp group) against the same model on the whole sequence; with
    ``recompute``, both under the runner's activation checkpointing (``fsdp_parallel.apply_ac``)."""
    import torch
    import torch.distributed as dist

    from pipette.model import ModelSpec
    from workers.rank.context_parallel import ContextParallel, apply_context_parallel
    from workers.rank.fsdp_model import LlamaStage, lm_loss
    from workers.rank.fsdp_parallel import apply_ac
    from workers.rank.hf_model import build_llama

    spec = ModelSpec(name="tiny-cp", layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128,
                     max_seq=SEQ, tied_embeddings=False, arch="llama")
    hf = build_llama(spec, seed=3)
    stage = LlamaStage(hf, range(spec.layers), True, True, SEQ)
    apply_ac(stage, recompute)
    torch.manual_seed(4)
    tokens = torch.randint(0, spec.vocab, (BATCH, SEQ + 1))
    x, labels = tokens[:, :-1], tokens[:, 1:]
    ref_loss = lm_loss(stage(x), labels)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    stage.zero_grad()
    context = ContextParallel(kind, _mesh(degree, world), SEQ)  # type: ignore[arg-type]
    routed = apply_context_parallel(stage, context)
    logits = stage(context.shard(x))
    # the mean over the whole sequence: this rank's sum over the number of all tokens
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab), context.shard(labels).reshape(-1),
                                             reduction="sum") / labels.numel()
    loss.backward()
    group = context.mesh.get_group()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    worst = 0.0
    for name, p in stage.named_parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad, group=group)
        worst = max(worst, ((p.grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item())
    suffix = "" if recompute == "none" else f"-ac-{recompute}"
    return {"check": f"model-{kind}{degree}{suffix}", "routed": routed,
            "loss_error": abs(total.item() - ref_loss.item()), "grad_rel_error": worst}


def refusal_checks(world: int) -> dict[str, Any]:
    """What the hook says of a bad split, and what PyTorch's own API does on a CPU rank."""
    import torch

    from pipette.errors import SpecError
    from workers.rank.context_parallel import ContextParallel, torch_ring_attention

    said: dict[str, Any] = {}
    for name, make in (("ring-seq", lambda: ContextParallel("ring", _mesh(world, world), 36)),
                       ("ulysses-seq", lambda: ContextParallel("ulysses", _mesh(world, world), 30))):
        try:
            make()
            said[name] = None
        except SpecError as e:
            said[name] = str(e)
    context = ContextParallel("ulysses", _mesh(world, world), SEQ)
    q = torch.randn(1, 6, SEQ // world, HEAD_DIM)  # 6 heads: not divisible by 4
    try:
        context.attend(q, q[:, :2], q[:, :2], scale=1.0)
        said["ulysses-heads"] = None
    except SpecError as e:
        said["ulysses-heads"] = str(e)
    part = torch.randn(1, 2, SEQ // world, HEAD_DIM)
    try:
        torch_ring_attention(part, part, part, _mesh(world, world), 1.0)
        said["torch-api-on-cpu"] = None
    except Exception as e:  # what torch raises is the record
        said["torch-api-on-cpu"] = f"{type(e).__name__}: {e}"[:300]
    return {"check": "refusals", "said": said}


def main() -> int:
    from workers.rank.devices import init_distributed
    from workers.rank.store import rendezvous_store
    from workers.rank.trial import emit

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = sys.argv[1:] == ["gpu"]
    store = rendezvous_store(world, is_master=rank == 0, timeout=timedelta(seconds=60))
    init_distributed("gpu" if gpu else "cpu", rank, world, store, timeout=timedelta(seconds=60))
    if gpu:  # one GPU: PyTorch's API path (fp32: efficient kernel, bf16: flash) and this ring, cp = world
        for dtype, path in (("float32", None), ("bfloat16", None), ("float32", "ring")):
            check = attention_check("ring", world, world, "cuda", dtype, path)
            emit({"event": "cp", "rank": rank, **check, "check": f"gpu-{check['path']}-{dtype}"})
    for kind, degree in CASES if not gpu else ():
        emit({"event": "cp", "rank": rank, **attention_check(kind, degree, world)})
    for kind, degree, recompute in MODEL_CASES if not gpu else ():
        emit({"event": "cp", "rank": rank, **model_check(kind, degree, world, recompute)})
    if not gpu:
        emit({"event": "cp", "rank": rank, **refusal_checks(world)})
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
