"""The shared expert (``SharedExpertMLP``) against a dense float64 torch reference written here:
``y = σ(x w_gᵀ) · (act(x W1ᵀ + b1) W2ᵀ + b2)`` (ungated: without the σ factor), at tp = 1 and at
tp = 2 with sequence parallelism (each rank holds s/2 tokens and the TP shards of W1, W2; the gate
weight replicated). Output, input gradient and every parameter's full gradient (shards joined;
the gate's all-reduced over TP inside autograd) must match.

Tolerance: fp32 against float64 on O(1) tensors with dot products of length ≤ 32, summed in
another order under TP: rtol = atol = 1e-5 (the band derived in support/tp_testing.py). A missing
gate, a gate over the wrong tokens or a missing TP reduction of its gradient is off by ~1e-1.
"""
import pytest
import torch
import torch.distributed as dist

from support.moe_reference import draw_masters, shared_mlp
from support.tp_testing import ATOL, RTOL
from tpfuse.models.config import TransformerConfig
from tpfuse.moe import SharedExpertMLP
from tpfuse.moe.groups import MoEGroups
from tpfuse.parallel.state import ParallelState
from tpfuse.tp_layers.init import shard, unshard

SEQ, BATCH, HIDDEN, SHARED = 8, 2, 16, 32


def _config(tp, activation, gate, bias):
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, vocab_size=64,
        ffn_hidden_size=32,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, num_moe_experts=2,
        moe_router_topk=1, activation=activation, add_bias_linear=bias,
        moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=gate)


def _gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


MASTER_OF = {"gate_weight": "shared_gate", "linear_fc1.weight": "shared_fc1",
             "linear_fc1.bias": "shared_fc1_bias", "linear_fc2.weight": "shared_fc2",
             "linear_fc2.bias": "shared_fc2_bias"}


def _check(tp, activation, gate, bias):
    state = ParallelState.initialize(tp=tp) if tp > 1 else None
    try:
        cfg = {"hidden": HIDDEN, "ffn": 4, "experts": 2, "activation": activation, "bias": bias,
               "shared": SHARED, "shared_gate": gate}
        m = {k: v for k, v in draw_masters(cfg, seed=3).items() if k.startswith("shared")}
        gen = torch.Generator().manual_seed(7)
        x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
        dy_full = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
        x_ref = x_full.clone().requires_grad_()
        y_ref = shared_mlp(x_ref, m, activation)
        (y_ref * dy_full).sum().backward()

        groups = MoEGroups.from_state(state)
        layer = SharedExpertMLP(_config(tp, activation, gate, bias), groups,
                                output_layer_init_std=0.01)
        stride = 2 if activation == "swiglu" else 1
        rank = groups.tp and dist.get_rank(groups.tp) or 0
        values = {"gate_weight": m.get("shared_gate"),
                  "linear_fc1.weight": shard(m["shared_fc1"], 0, tp, rank, stride),
                  "linear_fc2.weight": shard(m["shared_fc2"], 1, tp, rank)}
        if bias:
            values["linear_fc1.bias"] = shard(m["shared_fc1_bias"][:, None], 0, tp, rank,
                                              stride)[:, 0]
            values["linear_fc2.bias"] = m["shared_fc2_bias"]
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(values[name].detach())
        rows = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp)
        x = x_full[rows].float().requires_grad_()
        y = layer(x)
        y.backward(dy_full[rows].float())
        what = f"tp{tp} {activation} gate={gate} bias={bias}"
        torch.testing.assert_close(y.double(), y_ref[rows].detach(), rtol=RTOL, atol=ATOL,
                                   msg=f"{what}: output")
        torch.testing.assert_close(x.grad.double(), x_ref.grad[rows], rtol=RTOL, atol=ATOL,
                                   msg=f"{what}: input gradient")
        for name, param in layer.named_parameters():
            grad = param.grad
            if param.tensor_model_parallel and tp > 1:
                grad = unshard(_gather(grad, groups.tp), param.partition_dim,
                               param.partition_stride)
            torch.testing.assert_close(grad.double(), m[MASTER_OF[name]].grad, rtol=RTOL,
                                       atol=ATOL, msg=f"{what}: gradient of {name}")
        assert (layer.gate_weight is not None) == gate
    finally:
        if state is not None:
            state.destroy()


CASES = [("swiglu", True, False), ("gelu", True, True), ("swiglu", False, False)]


@pytest.mark.parametrize("activation,gate,bias", CASES)
def test_shared_expert_equals_the_dense_reference_in_one_process(activation, gate, bias):
    _check(1, activation, gate, bias)


def _check_tp2():
    for activation, gate, bias in CASES:
        _check(2, activation, gate, bias)


def test_shared_expert_at_tp2_with_sequence_parallelism_equals_the_dense_reference(
        run_distributed):
    run_distributed(2, _check_tp2)


def test_gate_draw_comes_after_the_mlp_and_is_layout_independent():
    """The gate is drawn last (N(0, init_method_std²)): the MLP's weights are those of an ungated
    shared expert built after the same seed, and the gate is the next (1, h) normal draw."""
    torch.manual_seed(5)
    gated = SharedExpertMLP(_config(1, "swiglu", True, False), MoEGroups(),
                            output_layer_init_std=0.01)
    torch.manual_seed(5)
    plain = SharedExpertMLP(_config(1, "swiglu", False, False), MoEGroups(),
                            output_layer_init_std=0.01)
    expected_gate = torch.empty(1, HIDDEN).normal_(0.0, 0.02)
    for name, param in plain.named_parameters():
        assert torch.equal(param, dict(gated.named_parameters())[name]), name
    assert torch.equal(gated.gate_weight, expected_gate)
    assert gated.gate_weight.sequence_parallel is False
    assert not gated.gate_weight.tensor_model_parallel
