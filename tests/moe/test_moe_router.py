"""Router, routing, capacity and the router losses against plain-torch references (single process;
the multi-rank partial sums are covered by test_moe_layer.py).

Tolerances: the references run in float64 on the same inputs; routing is compared exactly (same
experts chosen), probabilities and losses to 1e-12 where our code runs in float64 too, and to the
fp32 band of _tp_testing.py (1e-5) where it runs in fp32.
"""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from support.moe_reference import load_balancing_loss, route_token, z_loss
from support.tp_testing import ATOL, RTOL
from tpfuse.models.config import TransformerConfig
from tpfuse.moe import RouterLossTracker, TopKRouter, apply_capacity, topk_routing
from tpfuse.moe.groups import MoEGroups

T, E = 12, 6


def _logits(seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("score,pre_softmax,topk,scaling", [
    ("softmax", False, 2, None), ("softmax", True, 3, None), ("sigmoid", False, 2, 2.5),
    ("sigmoid", False, 1, None)])
def test_topk_routing_matches_per_token_reference(score, pre_softmax, topk, scaling):
    logits = _logits()
    probs, routing_map = topk_routing(logits, topk, score, pre_softmax, scaling_factor=scaling)
    for t in range(T):
        expected = route_token(logits[t], topk, score, pre_softmax, scaling)
        assert set(routing_map[t].nonzero().flatten().tolist()) == {e for e, _ in expected}
        for e, p in expected:
            assert probs[t, e].item() == pytest.approx(p.item(), rel=1e-12)
    assert (probs[~routing_map] == 0).all()


def test_group_limited_routing_picks_inside_the_best_groups():
    """3 groups of 2 experts, 2 groups per token, top-2: a group's score is its best expert's."""
    logits = _logits(1)
    _, routing_map = topk_routing(logits, 2, "softmax", True, num_groups=3, group_topk=2)
    scores = torch.softmax(logits, dim=-1)
    for t in range(T):
        group_best = [max(scores[t, 2 * g], scores[t, 2 * g + 1]) for g in range(3)]
        groups = sorted(range(3), key=lambda g: -group_best[g])[:2]
        allowed = [e for g in groups for e in (2 * g, 2 * g + 1)]
        chosen = sorted(allowed, key=lambda e: -scores[t, e])[:2]
        assert set(routing_map[t].nonzero().flatten().tolist()) == set(chosen)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_the_best_or_first_tokens_of_each_expert(policy):
    logits = _logits(2)
    probs, routing_map = topk_routing(logits, 2)
    kept_probs, kept, capacity = apply_capacity(probs, routing_map, 2, 0.5, policy)
    assert capacity == 2                                    # ⌈12·2/6 · 0.5⌉
    for e in range(E):
        routed = routing_map[:, e].nonzero().flatten().tolist()
        if policy == "probs":
            routed.sort(key=lambda t: -probs[t, e].item())
        expected = set(routed[:capacity])
        assert set(kept[:, e].nonzero().flatten().tolist()) == expected
    assert torch.equal(kept_probs, probs * kept)
    _, untouched, _ = apply_capacity(probs, routing_map, 2, 3.0, policy)
    assert torch.equal(untouched, routing_map), "capacity ≥ tokens drops nothing"


def _router(balancing, score="softmax", z=1e-2):
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, seq_length=4,
        vocab_size=32, num_moe_experts=E, moe_router_topk=2, moe_router_score_function=score,
        moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.3, moe_z_loss_coeff=z)
    tracker = RouterLossTracker()
    return TopKRouter(config, MoEGroups(), 5, tracker), tracker


@pytest.mark.parametrize("balancing,score", [("aux_loss", "softmax"), ("seq_aux_loss", "softmax"),
                                             ("aux_loss", "sigmoid")])
def test_router_losses_and_their_gradients_match_the_definitions(balancing, score):
    """probs·g summed, plus the router losses scaled by the tracker's loss_scale (0.25 as for
    four micro-batches), against the same objective built from the reference definitions."""
    router, tracker = _router(balancing, score)
    tracker.set_loss_scale(0.25)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 3, 8, generator=gen, requires_grad=True)       # (s, b, h): T = 12
    g = torch.randn(T, E, generator=gen)
    probs, _ = router(hidden)
    (probs * g).sum().backward()

    w = router.weight.detach().double().requires_grad_()
    x = hidden.detach().double().requires_grad_()
    logits = x.reshape(T, 8) @ w.t()
    cfg = {"score_function": score, "balancing": balancing, "aux_coeff": 0.3}
    ref_probs = torch.zeros(T, E, dtype=torch.float64)
    for t in range(T):
        for e, p in route_token(logits[t], 2, score):
            ref_probs[t, e] = p
    aux, zl = load_balancing_loss(logits, 2, cfg, batch=3), z_loss(logits, 1e-2)
    ((ref_probs * g.double()).sum() + 0.25 * (aux + zl)).backward()
    torch.testing.assert_close(probs.double(), ref_probs.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(router.weight.grad.double(), w.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(hidden.grad.double(), x.grad, rtol=RTOL, atol=ATOL)
    assert tracker.values["load_balancing_loss"][5].item() == pytest.approx(aux.item() / 0.3,
                                                                            rel=1e-5)
    assert tracker.values["z_loss"][5].item() == pytest.approx(zl.item() / 1e-2, rel=1e-5)


def test_no_losses_outside_training():
    router, tracker = _router("aux_loss")
    router.eval()
    router(torch.randn(4, 3, 8))
    assert tracker.values == {}
    router.train()
    with torch.no_grad():
        router(torch.randn(4, 3, 8))
    assert tracker.values == {}


def test_recomputed_forward_is_recorded_once():
    """Activation recompute re-runs the router inside backward: the losses (recorded when their
    gradient is injected) and the token counts are recorded once, as without recompute."""
    router, tracker = _router("aux_loss")
    hidden = torch.randn(4, 3, 8, requires_grad=True)
    probs, _ = checkpoint(router, hidden, use_reentrant=False)
    probs.sum().backward()
    reference, ref_tracker = _router("aux_loss")
    reference.load_state_dict(router.state_dict())
    reference(hidden.detach().requires_grad_())[0].sum().backward()
    for name in ("z_loss", "load_balancing_loss"):
        assert tracker.values[name][5].item() == pytest.approx(ref_tracker.values[name][5].item())
    assert torch.equal(tracker.tokens_per_expert[5], ref_tracker.tokens_per_expert[5])
