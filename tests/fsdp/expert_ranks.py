"""The ranks of the expert-parallel tests (``tests/fsdp/test_expert_parallel.py`` on gloo,
``tests/gpu/test_gpu_expert_parallel.py`` on NCCL): each rank runs each case's expert-parallel
MoE layer on its own tokens and the one-device reference layer (same weights) on every rank's
tokens, and writes what differs as JSON for the test process to judge.

Each case has a mesh ``(edp, ep)`` over the world, ep fastest (torchtitan's ``dp_shard_mod_ep``
x ``dp_shard_in_ep``): the ep group exchanges tokens; the expert data-parallel group (edp: the
ranks that hold the same experts) sums the experts' gradients, the world sums the router's and
the shared expert's. The loss of rank r is ``<layer(x_r), probe_r>`` (a fixed random direction),
plus the load-balancing loss the layer attaches; the reference's is the sum over the ranks of
the same, so the summed gradients must be equal. Each rank holds a different number of tokens,
so the split sizes of every exchange are uneven.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipette.model import ModelSpec
from workers.rank.moe_layer import MoeFeedForward, MoeOptions, route

HIDDEN = 16
#: tokens on rank r: all different, so every exchange has uneven splits
BASE_TOKENS, TOKENS_STEP = 20, 7
#: the cases: ep degree and the layer's options (8 experts, top-2)
CASES: dict[str, dict[str, Any]] = {
    "ep4-dropless-shared": {"ep": 4, "shared_hidden": 24},
    "ep2xdp2-dropless": {"ep": 2},
    "ep2xdp2-capacity-probs": {"ep": 2, "capacity_factor": 1.0, "drop_policy": "probs"},
    "ep4-capacity-position": {"ep": 4, "capacity_factor": 1.25, "drop_policy": "position", "shared_hidden": 8},
    "ep1-all-to-all": {"ep": 1, "capacity_factor": 1.0},
    # the runner's tiny Llama with MoE layers (workers.rank.fsdp_model), one stage, experts sharded
    "llama-ep2xdp2": {"ep": 2, "model": True, "shared_hidden": 16},
}
#: the Llama of the model case: 2 layers, its tokens a sequence of SEQ per rank
LLAMA = ModelSpec(name="tiny-moe", layers=2, hidden=HIDDEN, heads=4, kv_heads=2, ffn_hidden=32, vocab=64,
                  max_seq=16, tied_embeddings=False, arch="llama")
SEQ = 16


def options_of(case: dict[str, Any]) -> MoeOptions:
    fields = {k: v for k, v in case.items() if k not in ("ep", "model")}
    return MoeOptions(experts=8, top_k=2, expert_hidden=32, **fields)


def batches(world: int, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's tokens and loss direction (the same on every rank: seeded by rank)."""
    xs, probes = [], []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        n = BASE_TOKENS + TOKENS_STEP * r
        xs.append(torch.randn(n, HIDDEN, generator=g).to(device))
        probes.append(torch.randn(n, HIDDEN, generator=g).to(device))
    return xs, probes


def reference(options: MoeOptions, xs: list[torch.Tensor], probes: list[torch.Tensor],
              device: torch.device) -> dict[str, Any]:
    """The one-device layer on each rank's tokens, the summed loss's gradients."""
    torch.manual_seed(0)
    layer = MoeFeedForward(HIDDEN, options).to(device)
    inputs = [x.clone().requires_grad_() for x in xs]
    outs = [layer(x) for x in inputs]
    sum(((o * p).sum() for o, p in zip(outs, probes, strict=True)), torch.zeros((), device=device)).backward()
    with torch.no_grad():
        kept = [int(route(layer.gate(x), options).kept.sum()) for x in xs]
    return {"layer": layer, "outs": [o.detach() for o in outs], "x_grads": [x.grad for x in inputs],
            "aux": [float(a) for a in _aux_losses(layer, xs)], "kept": kept}


def _aux_losses(layer: MoeFeedForward, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [route(layer.gate(x), layer.options).aux_loss for x in xs]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _mesh(device: torch.device, ep: int) -> Any:
    """``(edp, ep)`` over the world, ep fastest."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size() // ep, ep), mesh_dim_names=("edp", "ep"))


def expert_parallel(options: MoeOptions, ep: int, ref: dict[str, Any], xs: list[torch.Tensor],
                    probes: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """This rank's expert-parallel layer against the reference (see the module docstring)."""
    rank = dist.get_rank()
    mesh = _mesh(device, ep)
    layer = MoeFeedForward(HIDDEN, options, ep_group=mesh.get_group("ep")).to(device)
    full = ref["layer"].state_dict()
    layer.load_state_dict({name: full[name] for name in layer.state_dict()})
    x = xs[rank].clone().requires_grad_()
    out = layer(x)
    (out * probes[rank]).sum().backward()
    grads = _summed_grads(layer, mesh.get_group("edp"))
    ref_grads = dict(ref["layer"].named_parameters())
    dispatch = layer.last_dispatch
    assert dispatch is not None and layer.last_aux_loss is not None
    return {
        "out": _relative(out.detach(), ref["outs"][rank]),
        "x_grad": _relative(x.grad, ref["x_grads"][rank]),  # type: ignore[arg-type]  # set by backward
        "param_grad": {name: _relative(g, ref_grads[name].grad) for name, g in grads.items()},
        "aux": abs(float(layer.last_aux_loss) - ref["aux"][rank]), "aux_value": ref["aux"][rank],
        "experts_held": sorted(int(k) for k in layer.experts),
        "rows_sent": sum(dispatch.input_splits), "ref_kept": ref["kept"][rank],
        "tokens": x.shape[0], **asdict(dispatch),
    }


def _summed_grads(layer: nn.Module, edp: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Each gradient summed over the ranks that hold the parameter: an expert's over the expert
    data-parallel group, the router's and the shared expert's over the world."""
    out = {}
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        grad = p.grad.clone()
        dist.all_reduce(grad, group=edp if ".experts." in f".{name}" else None)
        out[name] = grad
    return out


def _llama_stage(options: MoeOptions, device: torch.device, ep_group: dist.ProcessGroup | None) -> nn.Module:
    """The runner's one-stage Llama with MoE layers, built on meta, its experts sharded over
    ``ep_group`` (None: all), its values drawn by parameter name (``workers.rank.fsdp_model``)."""
    from pipette.training import TrainingSpec
    from workers.rank.fsdp_model import build_stages, materialize, meta_model, parameter_names
    from workers.rank.moe_layer import shard_experts

    training = TrainingSpec(global_batch=dist.get_world_size(), seq_len=SEQ, dtype="fp32", method="full")
    meta = meta_model(LLAMA, training, moe=options)
    (stage,) = build_stages(meta, [0], 1, SEQ)
    names = parameter_names(stage)
    if ep_group is not None:
        shard_experts(stage, ep_group)
    materialize(stage, names, device, device, seed=5, std=meta.std)
    return stage


def llama_case(options: MoeOptions, ep: int, device: torch.device) -> dict[str, Any]:
    """The expert-parallel stage on this rank's sequence against the whole stage on every rank's."""
    from workers.rank.fsdp_model import lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh(device, ep)
    tokens = [torch.randint(0, LLAMA.vocab, (1, SEQ), generator=torch.Generator().manual_seed(200 + r)).to(device)
              for r in range(world)]
    ref = _llama_stage(options, device, None)
    ref_loss: torch.Tensor = torch.stack([lm_loss(ref(t)[:, :-1], t[:, 1:]) for t in tokens]).sum()
    ref_loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch 2.13
    stage = _llama_stage(options, device, mesh.get_group("ep"))
    logits = stage(tokens[rank])
    lm_loss(logits[:, :-1], tokens[rank][:, 1:]).backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        ref_logits = ref(tokens[rank])
    ref_grads = dict(ref.named_parameters())
    grads = _summed_grads(stage, mesh.get_group("edp"))
    mlp = stage.get_submodule("layers.0.mlp")
    assert isinstance(mlp, MoeFeedForward) and mlp.last_dispatch is not None
    return {"out": _relative(logits.detach(), ref_logits),
            "param_grad": {name: _relative(g, ref_grads[name].grad) for name, g in grads.items()},  # type: ignore[arg-type]
            "experts_held": sorted(int(k) for k in mlp.experts), **asdict(mlp.last_dispatch)}


def run(rank: int, world: int, backend: str, init: str, out_dir: str, names: list[str]) -> None:
    """One rank (``torch.multiprocessing.spawn``'s entry): every case in ``names``."""
    # each rank its own GPU (the spawned ranks see them all)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    results: dict[str, Any] = {"backend": dist.get_backend()}
    xs, probes = batches(world, device)
    for name in names:
        case = CASES[name]
        options = options_of(case)
        if case.get("model"):
            results[name] = llama_case(options, case["ep"], device)
            continue
        ref = reference(options, xs, probes, device)
        results[name] = expert_parallel(options, case["ep"], ref, xs, probes, device)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def spawn(world: int, backend: str, tmp: Path, names: list[str]) -> list[dict[str, Any]]:
    """``world`` ranks of ``run``; each rank's results. On gloo they fork from one warm process
    (``tests.fsdp.cases.launch``: each rank would import torch and transformers itself), on NCCL
    ``torch.multiprocessing`` spawns them."""
    if backend == "gloo":
        from tests.fsdp.cases import launch

        _, codes, tails = launch(["-m", "tests.fsdp.expert_ranks", "rank", str(tmp), *names], world, "cpu", 300)
        assert not any(codes), f"exit codes {codes}\n" + "\n".join(tails)[-6000:]
    else:
        from torch.multiprocessing.spawn import spawn as spawn_ranks

        init = f"file://{tmp / 'store'}"
        spawn_ranks(run, args=(world, backend, init, str(tmp), names), nprocs=world, join=True)  # type: ignore[no-untyped-call]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


if __name__ == "__main__":
    import os

    if sys.argv[1] == "rank":  # python -m tests.fsdp.expert_ranks rank OUT_DIR CASE...: one rank (launch's env)
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "gloo", "env://", sys.argv[2], sys.argv[3:])
        sys.stdout.flush()
        os._exit(0)
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # python -m tests.fsdp.expert_ranks WORLD BACKEND: print the results
        print(json.dumps(spawn(int(sys.argv[1]), sys.argv[2], Path(d), list(CASES)), indent=1))
