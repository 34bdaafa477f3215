"""The MoE feed-forward on one device (``workers.rank.moe_layer``): routing, capacity dropping
and the load-balancing loss against hand-worked examples, the layer against a token-by-token
sum of its experts, and the loss's gradient as ``MoEAuxLossAutoScaler`` gives it. The
expert-parallel layer is compared with this one in ``tests/fsdp/test_expert_parallel.py``."""

from __future__ import annotations

import math

import pytest
import torch

from pipette.errors import SpecError
from workers.rank.moe_layer import (
    MoeFeedForward,
    MoeOptions,
    SwiGLU,
    load_balancing_loss,
    route,
    within_capacity,
)


def test_route_keeps_the_top_k_renormalised() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 1.0, -1.0]])
    routing = route(logits, MoeOptions(experts=4, top_k=2, expert_hidden=4))
    assert routing.experts.tolist() == [[3, 2], [0, 2]]
    e, e2 = math.e, math.e**2  # softmax ratios of the two kept logits: e^1 and e^2
    assert routing.weights[0].tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)])
    assert routing.weights[1].tolist() == pytest.approx([e2 / (e2 + 1), 1 / (e2 + 1)])
    assert routing.kept.all()


def test_the_load_balancing_loss_is_switch_transformers() -> None:
    """alpha E sum_i f_i P_i (Fedus et al. 2021, eq. 4): for uniform probabilities it is alpha
    whatever the routing; for one-hot routing matching its probabilities, alpha E."""
    options = MoeOptions(experts=4, top_k=1, expert_hidden=4, aux_loss_coeff=0.1)
    uniform = torch.full((6, 4), 0.25)
    skewed = torch.tensor([[0], [0], [0], [1], [1], [2]])
    assert load_balancing_loss(uniform, skewed, options).item() == pytest.approx(0.1)
    one_hot = torch.eye(4)[[0, 0, 0, 0]]
    assert load_balancing_loss(one_hot, torch.zeros(4, 1, dtype=torch.long), options).item() == pytest.approx(0.4)
    # f = (3/6, 2/6, 1/6, 0), P = (1/4,)*4 scaled: top-2 counts each assignment with 1/(T k)
    two = MoeOptions(experts=4, top_k=2, expert_hidden=4, aux_loss_coeff=1.0)
    experts = torch.tensor([[0, 1], [0, 1], [0, 2]])
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1], [0.6, 0.1, 0.2, 0.1]])
    f = torch.tensor([3, 2, 1, 0]) / 6
    p = probs.mean(dim=0)
    assert load_balancing_loss(probs, experts, two).item() == pytest.approx(4 * float((f * p).sum()))


def test_capacity_keeps_the_heaviest_or_the_first_assignments() -> None:
    # 4 tokens, 2 experts, top-1: capacity ceil(4 / 2 * 0.5) = 1 per expert
    experts = torch.tensor([[0], [0], [1], [0]])
    weights = torch.tensor([[0.6], [0.9], [0.7], [0.8]])
    probs = MoeOptions(experts=2, top_k=1, expert_hidden=4, capacity_factor=0.5, drop_policy="probs")
    first = MoeOptions(experts=2, top_k=1, expert_hidden=4, capacity_factor=0.5, drop_policy="position")
    assert probs.capacity(4) == 1
    assert within_capacity(weights, experts, probs).view(-1).tolist() == [False, True, True, False]
    assert within_capacity(weights, experts, first).view(-1).tolist() == [True, False, True, False]
    roomy = MoeOptions(experts=2, top_k=1, expert_hidden=4, capacity_factor=2.0)
    assert within_capacity(weights, experts, roomy).all()


def test_the_layer_is_the_weighted_sum_of_its_kept_experts() -> None:
    torch.manual_seed(0)
    options = MoeOptions(experts=4, top_k=2, expert_hidden=8, shared_hidden=6, capacity_factor=0.75)
    layer = MoeFeedForward(5, options)
    x = torch.randn(2, 6, 5)
    out = layer(x)
    flat = x.reshape(-1, 5)
    routing = route(layer.gate(flat), options)
    assert not routing.kept.all(), "capacity 0.75 should drop some assignment"
    assert layer.shared_expert is not None
    for t in range(flat.shape[0]):
        want = layer.shared_expert(flat[t])
        for slot in range(2):
            if routing.kept[t, slot]:
                expert = layer.experts[str(int(routing.experts[t, slot]))]
                want = want + routing.weights[t, slot] * expert(flat[t])
        torch.testing.assert_close(out.reshape(-1, 5)[t], want, rtol=1e-5, atol=1e-6)


def test_one_expert_top_one_is_the_dense_mlp() -> None:
    torch.manual_seed(0)
    layer = MoeFeedForward(5, MoeOptions(experts=1, top_k=1, expert_hidden=7))
    dense = SwiGLU(5, 7)
    dense.load_state_dict(layer.experts["0"].state_dict())
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(layer(x), dense(x))


def test_the_aux_loss_gets_its_gradient_through_the_output() -> None:
    torch.manual_seed(0)
    options = MoeOptions(experts=4, top_k=2, expert_hidden=8, aux_loss_coeff=0.5)
    layer = MoeFeedForward(5, options)
    x, probe = torch.randn(10, 5), torch.randn(10, 5)
    grads = {}
    for scale in (0.0, 1.0, 2.0):
        layer.zero_grad()
        layer.aux_loss_scale = scale
        (layer(x) * probe).sum().backward()
        assert layer.gate.weight.grad is not None
        grads[scale] = layer.gate.weight.grad.clone()
    layer.zero_grad()
    aux: torch.Tensor = route(layer.gate(x), options).aux_loss
    aux.backward()  # type: ignore[no-untyped-call]  # torch.Tensor.backward is unannotated here
    aux_grad = layer.gate.weight.grad
    assert aux_grad is not None and aux_grad.abs().max() > 0
    torch.testing.assert_close(grads[1.0] - grads[0.0], aux_grad)
    torch.testing.assert_close(grads[2.0] - grads[0.0], 2 * aux_grad)


@pytest.mark.parametrize("fields", [
    {"experts": 0, "top_k": 1}, {"experts": 4, "top_k": 5}, {"experts": 4, "top_k": 2, "capacity_factor": 0.0},
    {"experts": 4, "top_k": 2, "drop_policy": "random"}, {"experts": 4, "top_k": 2, "aux_loss_coeff": -1.0},
])
def test_bad_options_say_what_and_the_fix(fields: dict[str, object]) -> None:
    with pytest.raises(SpecError) as error:
        MoeOptions(expert_hidden=4, **fields)  # type: ignore[arg-type]
    assert error.value.field and error.value.field.startswith("moe.") and error.value.fix
