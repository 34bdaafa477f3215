"""Ring attention: causal self-attention over a sequence split across a context-parallel (cp)
group, the key/value blocks passed from rank to rank around the ring, with a backward that
passes the key/value gradients around the same ring.

The algorithm is TransformerEngine's ``AttnFuncWithCPAndKVP2P``
(``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``) and
PyTorch's ``_templated_ring_attention`` (``torch/distributed/tensor/experimental/_context_parallel/
_attention.py``, its Note "Context parallelism load balance algorithm for causal masking"):

* each rank holds the chunks of the sequence ``workers.rank.context_parallel.chunk_ids`` names
  (load-balanced: chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp``); at step ``i`` of ``cp`` it holds
  the keys and values of rank ``(rank - i) mod cp`` and sends them on to ``rank + 1`` while it
  computes (``isend``/``irecv``: gloo and NCCL both have point-to-point, and the transfer of the
  next block runs in the backend's thread while this one is computed);
* each (query chunk, key chunk) pair is attended in full, with the causal mask (the same
  chunk), or skipped (a later chunk): ``chunk_relation``; on the load-balanced layout this is
  PyTorch's three cases (step 0 causal; ``i <= rank``: all queries, the first key chunk;
  ``i > rank``: the second query chunk, all keys);
* the partial results are merged with their log-sum-exp (the online softmax of
  FlashAttention, Dao et al. 2022, Algorithm 1; TE's ``flash_attn_fwd_out_correction``):
  ``lse = log(e^lse_a + e^lse_b)``, ``o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse)``;
* each block is one call of the fused kernel PyTorch's SDPA uses on a CPU
  (``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, as PyTorch's ring calls
  the CUDA flash kernel per block), or the same arithmetic in matmuls on another device;
* the backward is FlashAttention-2's (Dao 2023, Algorithm 2) per block with the final output
  and log-sum-exp: ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - D)`` with
  ``D = rowsum(dO * O)``, ``dQ = dS K s``, ``dK = dS^T Q s``; the queries' gradient stays on the
  rank, the keys' and values' gradient travels with its block and reaches its owner after
  ``cp`` hops (TE sends dK/dV the same way, one step behind the key/value block).

GQA: the keys and values travel with their own (fewer) heads; a query head ``h`` attends key
head ``h // (heads / kv_heads)`` (``transformers``' ``repeat_kv``), done by viewing the queries
as (kv_heads, group) rather than by repeating the keys, so the ring carries ``kv_heads`` heads.
Blocks are computed in fp32 (PyTorch's ``_cp_options.convert_to_f32``) and the output cast back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

#: how a query chunk attends a key chunk (global chunk ids: a later chunk is later positions)
FULL, CAUSAL, SKIP = "full", "causal", "skip"


def chunk_relation(q_chunk: int, k_chunk: int) -> str:
    """Full when the key chunk is earlier, causal on the same chunk, skipped when later."""
    if q_chunk > k_chunk:
        return FULL
    return CAUSAL if q_chunk == k_chunk else SKIP


@dataclass(frozen=True)
class RingPlan:
    """Which chunks each rank of the ring holds (every rank the same number, in order)."""

    #: chunk ids held by each cp rank, e.g. ((0, 3), (1, 2)) for cp=2 load-balanced
    chunks: tuple[tuple[int, ...], ...]

    @property
    def cp(self) -> int:
        return len(self.chunks)

    def pairs(self, rank: int, step: int) -> list[tuple[int, int, str]]:
        """(local query chunk, local key chunk, relation) computed by ``rank`` at ``step``: its
        queries against the keys of rank ``(rank - step) mod cp``; skipped pairs left out."""
        source = self.chunks[(rank - step) % self.cp]
        out = []
        for a, qc in enumerate(self.chunks[rank]):
            for b, kc in enumerate(source):
                relation = chunk_relation(qc, kc)
                if relation != SKIP:
                    out.append((a, b, relation))
        return out


def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Scores [b, kv_heads, group, sq, sk] of queries [b, kv_heads, group, sq, d] and keys
    [b, kv_heads, sk, d]; the causal mask hides a key after its query (same chunk: sq == sk)."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        later = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    return s


def _math_forward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q5, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse


def _math_backward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    delta = (d_out * out).sum(-1)
    p = torch.exp(_scores(q5, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), d_out).sum(dim=2)
    ds = p * (torch.matmul(d_out, v.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(dim=2) * scale
    return dq, dk, dv


def _heads(x5: torch.Tensor) -> torch.Tensor:
    """[b, kv_heads, group, s, ...] as [b, heads, s, ...] (query head h = kv head h // group)."""
    return x5.reshape(x5.shape[0], x5.shape[1] * x5.shape[2], *x5.shape[3:])


def block_forward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output [b, kv, g, sq, d] and log-sum-exp [b, kv, g, sq] (fp32). On the CPU
    the fused kernel SDPA uses there (``aten._scaled_dot_product_flash_attention_for_cpu``, which
    returns the log-sum-exp; the keys repeated to the query heads for it), else (or with
    ``fused=False``) the same arithmetic in plain matmuls."""
    if not (q5.device.type == "cpu" if fused is None else fused):
        return _math_forward(q5, k, v, scale, causal)
    g = q5.shape[2]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads(q5), k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), 0.0, causal, scale=scale)
    return out.reshape(q5.shape), lse.reshape(q5.shape[:-1])


def block_backward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool,
                   fused: bool | None = None) -> tuple[torch.Tensor, ...]:
    """dQ (query layout), dK, dV (key layout, summed over each kv head's query group) of one
    block, from the final output and log-sum-exp of its queries (FlashAttention-2's backward:
    the CPU kernel's ``_backward`` takes them as its ``out`` and ``logsumexp``)."""
    if not (q5.device.type == "cpu" if fused is None else fused):
        return _math_backward(q5, k, v, d_out, out, lse, scale, causal)
    b, kv, g = q5.shape[:3]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _heads(d_out), _heads(q5), k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), _heads(out),
        _heads(lse), 0.0, causal, scale=scale)
    return dq.reshape(q5.shape), dk.reshape(b, kv, g, *k.shape[2:]).sum(2), dv.reshape(b, kv, g, *v.shape[2:]).sum(2)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's result into the running (out, lse) in place: the online softmax."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


class Ring:
    """Point-to-point exchange with the ring's neighbours: send to ``rank + 1``, receive from
    ``rank - 1`` (group ranks); ``start`` posts both, ``wait`` returns what arrived."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.works: list[Any] = []

    def start(self, send: torch.Tensor, tag: int) -> torch.Tensor:
        recv = torch.empty_like(send)
        self.works = [dist.isend(send, group=self.group, group_dst=(self.rank + 1) % self.size, tag=tag),
                      dist.irecv(recv, group=self.group, group_src=(self.rank - 1) % self.size, tag=tag)]
        self._recv = recv
        return recv

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works = []
        return self._recv


def _split(q: torch.Tensor, kv_heads: int, n: int) -> list[torch.Tensor]:
    """Queries [b, heads, s, d] as [b, kv_heads, group, s, d], cut into ``n`` chunks of s."""
    b, h, s, d = q.shape
    return list(q.float().reshape(b, kv_heads, h // kv_heads, s, d).chunk(n, dim=3))


class RingAttention(torch.autograd.Function):
    """Causal ring attention of this rank's queries [b, heads, s, d] over the whole sequence;
    keys and values [b, kv_heads, s, d]; ``s`` is this rank's part, its chunks in ``plan`` order."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                plan: RingPlan, scale: float) -> torch.Tensor:
        ring, n = Ring(group), len(plan.chunks[0])
        q5 = _split(q, k.shape[1], n)
        out = [torch.zeros_like(c) for c in q5]
        lse = [torch.full(c.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device) for c in q5]
        kv = torch.stack([k.float(), v.float()])
        for step in range(ring.size):
            if step < ring.size - 1:
                ring.start(kv, tag=0)
            ks, vs = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            for a, b, relation in plan.pairs(ring.rank, step):
                merge(out[a], lse[a], *block_forward(q5[a], ks[b], vs[b], scale, relation == CAUSAL))
            if step < ring.size - 1:
                kv = ring.wait()
        o, m = torch.cat(out, dim=3), torch.cat(lse, dim=3)
        ctx.save_for_backward(q, k, v, o, m)
        ctx.group, ctx.plan, ctx.scale = group, plan, scale
        return o.flatten(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, m = ctx.saved_tensors
        ring, plan, n = Ring(ctx.group), ctx.plan, len(ctx.plan.chunks[0])
        q5, d_out = _split(q, k.shape[1], n), _split(grad, k.shape[1], n)
        o5, lse = o.chunk(n, dim=3), m.chunk(n, dim=3)
        dq = [torch.zeros_like(c) for c in q5]
        kv, dkv = torch.stack([k.float(), v.float()]), torch.zeros(2, *k.shape, dtype=torch.float32, device=k.device)
        for step in range(ring.size):
            if step < ring.size - 1:
                ring.start(kv, tag=0)
            ks, vs = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            dks, dvs = dkv[0].chunk(n, dim=2), dkv[1].chunk(n, dim=2)
            for a, b, relation in plan.pairs(ring.rank, step):
                g = block_backward(q5[a], ks[b], vs[b], d_out[a], o5[a], lse[a], ctx.scale, relation == CAUSAL)
                dq[a] += g[0]
                dks[b].add_(g[1])
                dvs[b].add_(g[2])
            if step < ring.size - 1:
                kv = ring.wait()
            if ring.size > 1:  # the block's gradient follows it; after cp hops it is home
                ring.start(dkv, tag=1)
                dkv = ring.wait()
        dq_full = torch.cat(dq, dim=3).flatten(1, 2).to(q.dtype)
        return dq_full, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, plan: RingPlan,
                   scale: float) -> torch.Tensor:
    """``RingAttention`` as a function: [b, heads, s, d] queries, [b, kv_heads, s, d] keys and
    values of this rank's chunks; returns [b, heads, s, d]."""
    return cast(torch.Tensor, RingAttention.apply(q, k, v, group, plan, scale))  # type: ignore[no-untyped-call]
