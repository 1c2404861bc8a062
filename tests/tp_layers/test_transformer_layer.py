"""A whole TransformerLayer vs a dense single-process layer built from the same master weights.

gloo world of 4, TP size looping over 1, 2, 4 inside the job (dp = 4 / tp), sequence parallelism
on and off, two configurations: LayerNorm + gelu + learned-absolute MHA with biases, and
RMSNorm + SwiGLU + rotary + grouped-query attention without biases. Outputs, input grads and every
parameter grad (reassembled from the shards) are compared on every rank; replicated parameters
(norm weights, row-parallel biases) must also hold bitwise-identical grads on every TP rank — with
sequence parallelism that is the layer's TP all-reduce of those grads.

Tolerance: the per-op argument of tests/support/tp_testing.py, compounded: a layer chains two norms, four
GEMMs, a softmax and an activation forward and backward, so a gradient's rounding is the sum of
several reordered-sum errors of up to ~1e-5 relative each (observed worst ≈ 2e-5 on a QKV weight
grad). We allow rtol = atol = 5e-5; structural bugs still give errors of order 1e-2 .. 1.
"""
import pytest
import torch

from support.dense_reference import (assembled_grads, dense_transformer_layer, master_params)
from support.tp_testing import assert_close_fp32 as _close
from support.tp_testing import (assembled, chunk_of, expect_value_error, gather_tp, seeded_randn,
                         tp_layouts, tp_state)
from tpfuse.kernels import backend as kernel_backend
from tpfuse.kernels.backend import use_backend
from tpfuse.tp_layers import TransformerLayer

S, B = 8, 2
LAYER_TOL = 5e-5


def assert_close_fp32(actual, expected, what):
    _close(actual, expected, what, rtol=LAYER_TOL, atol=LAYER_TOL)

CONFIGS = {
    "layernorm-gelu": dict(hidden_size=16, num_attention_heads=4, ffn_hidden_size=32),
    "rmsnorm-swiglu-rope-gqa": dict(
        hidden_size=128, num_attention_heads=8, ffn_hidden_size=64, num_query_groups=4,
        normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
        position_embedding_type="rope", rotary_base=10000),
}


def _check_layer(cfg, state, sp, tag):
    layer = TransformerLayer(**cfg, sequence_parallel=sp, state=state)
    masters = master_params(layer, state, seed=200)
    hidden = cfg["hidden_size"]
    x, dy = seeded_randn(1, S, B, hidden), seeded_randn(2, S, B, hidden)
    positions = torch.arange(S).expand(B, S)
    xd = x.clone().requires_grad_()
    expected = dense_transformer_layer(masters, xd, dict(cfg, rotary_base=10000.0), positions)
    expected.backward(dy)
    x_in = (chunk_of(x, state, 0) if sp else x).clone().requires_grad_()
    out = layer(x_in)
    assert out.shape == x_in.shape
    assert_close_fp32(out, chunk_of(expected.detach(), state, 0) if sp else expected.detach(),
                      f"{tag}: output")
    out.backward(chunk_of(dy, state, 0) if sp else dy)
    assert_close_fp32(x_in.grad, chunk_of(xd.grad, state, 0) if sp else xd.grad, f"{tag}: dx")
    for name, grad in assembled_grads(layer, state).items():
        assert_close_fp32(grad, masters[name].grad, f"{tag}: d{name}")
    for name, param in layer.named_parameters():
        if not param.tensor_model_parallel:
            copies = gather_tp(param.grad, state)
            assert all(torch.equal(c, copies[0]) for c in copies), f"{tag}: {name} grad differs"
            assert getattr(param, "sequence_parallel", False) == sp, f"{tag}: {name} flag"


def _layer_against_dense():
    cases = 0
    for tp, state in tp_layouts():
        for sp in (False, True):
            for name, cfg in CONFIGS.items():
                _check_layer(cfg, state, sp, f"{name} tp={tp} sp={sp}")
                cases += 1
    return cases


def test_transformer_layer_matches_dense(run_distributed):
    assert run_distributed(4, _layer_against_dense) == [12] * 4


def _layout_independent_init():
    """Seeded construction at tp 2 and 4 reassembles to exactly the tp 1 weights."""
    reference = None
    for tp, state in tp_layouts():
        torch.manual_seed(3)
        layer = TransformerLayer(**CONFIGS["rmsnorm-swiglu-rope-gqa"], state=state)
        full = {name: p.data if not p.tensor_model_parallel
                else assembled(p.data, state, p.partition_dim, p.partition_stride)
                for name, p in layer.named_parameters()}
        if reference is None:
            reference = full
        for name, tensor in full.items():
            assert torch.equal(tensor, reference[name]), f"tp={tp}: {name} differs from tp=1"
    return sorted(reference)


def _bad_settings():
    with tp_state(4) as state:
        expect_value_error(lambda: TransformerLayer(16, 4, 30, state=state), "ffn_hidden_size=30")
        expect_value_error(lambda: TransformerLayer(16, 4, 32, num_query_groups=2, state=state),
                           "num_query_groups=2", "tp=4")
        expect_value_error(lambda: TransformerLayer(16, 4, 32, normalization="BatchNorm",
                                                    state=state), "BatchNorm")
        layer = TransformerLayer(16, 4, 32, state=state)
        expect_value_error(lambda: layer(torch.randn(S, B, 12)), "hidden_states")
    return True


def test_layout_independent_init_and_bad_settings(run_distributed):
    names = run_distributed(4, _layout_independent_init)[0]
    assert "self_attention.linear_qkv.weight" in names and "mlp.linear_fc2.weight" in names
    assert run_distributed(4, _bad_settings) == [True] * 4


@pytest.mark.parametrize("cfg", [
    dict(hidden_size=32, num_attention_heads=2, ffn_hidden_size=48),
    dict(hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, normalization="RMSNorm",
         activation="swiglu", position_embedding_type="rope", add_bias_linear=False),
], ids=["layernorm-gelu", "rmsnorm-swiglu-rope"])
def test_triton_kernels_match_torch_path(cfg, monkeypatch):
    """Single process (tp=1): the layer on the Triton kernels (interpreter on CPU: fused-gelu GEMM,
    norms, flash attention at head dim 16, bias-dropout-add) equals the torch path. Same fp32
    tolerance argument as above (different accumulation orders only)."""
    torch.manual_seed(0)
    layer = TransformerLayer(**cfg)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)  # non-zero biases, non-trivial norm weights
    x = seeded_randn(3, 5, 3, cfg["hidden_size"])
    launched = []  # proves the "triton" run really went through Triton kernels
    real_launch = kernel_backend.launch

    def counting_launch(kernel, *args, **kwargs):
        launched.append(kernel)
        return real_launch(kernel, *args, **kwargs)

    monkeypatch.setattr(kernel_backend, "launch", counting_launch)
    results = {}
    for backend in ("torch", "triton"):
        x_in = x.clone().requires_grad_()
        with use_backend(backend):
            out = layer(x_in)
            out.backward(torch.ones_like(out))
        results[backend] = [out.detach(), x_in.grad] + [p.grad for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
    assert len(launched) >= 8, f"too few Triton launches: {launched}"
    for i, (got, want) in enumerate(zip(results["triton"], results["torch"])):
        assert_close_fp32(got, want, f"tensor {i} (0 = output, 1 = dx, then parameter grads)")
