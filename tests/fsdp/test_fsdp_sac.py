"""Per-op selective checkpointing (``workers.rank.fsdp_parallel._op_sac_context``): every
checkpointed call decides what to save afresh, as torchtitan's policy does.

A policy whose matmul count runs on across calls saves a different set of matmuls each call
once a layer has an odd number of them (LoRA's adapters on q, k, v, o make Llama's 7 into 15),
and where a recompute's count no longer matches its forward's, the recompute pops another op's
saved output. On an H100 (torch 2.11, PEFT 0.21) that was a shape error in the one-rank FSDP2 +
LoRA + selective checkpointing test; with one policy per call it passed (docs/workers.md,
2026-11-28). This test checks the first half on CPU: the same matmuls saved at every call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import workers.rank.fsdp_parallel as fp


class ThreeMatmuls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False), nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).relu())) + x


def test_each_checkpointed_call_saves_the_same_matmuls(monkeypatch: Any) -> None:
    decisions: list[list[bool]] = []
    make = fp._op_sac_policy

    def recording() -> Any:
        policy = make()
        decisions.append([])

        def record(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            out = policy(ctx, func, *args, **kwargs)
            if func == torch.ops.aten.mm.default and not ctx.is_recompute:
                decisions[-1].append(out == CheckpointPolicy.MUST_SAVE)
            return out

        return record

    monkeypatch.setattr(fp, "_op_sac_policy", recording)
    torch.manual_seed(0)
    layer, reference = ThreeMatmuls(), ThreeMatmuls()
    reference.load_state_dict(layer.state_dict())
    for _ in range(3):
        x = torch.randn(2, 3, 8, requires_grad=True)
        checkpoint(layer, x, use_reentrant=False, context_fn=fp._op_sac_context).sum().backward()
        reference(x.detach()).sum().backward()
    assert decisions == [[True, False, True]] * 3, decisions
    for p, q in zip(layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
