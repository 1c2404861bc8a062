"""The attention's QKV split and token order, and the projection's folded bias (one process, tp = 1).

- ``split_qkv`` against autograd's own slicing of the same tensor: forward views and the input
  gradient are pure copies of the same numbers, so both must be bitwise equal (GQA and MHA, both
  token orders).
- ``ParallelAttention`` on batch-first tokens (the CPU default) against the sequence-first path
  of the same module: the GEMMs see the same rows in another order and ATen's attention the same
  tiles, so outputs and gradients agree to fp32 rounding (assert_close's fp32 defaults, rtol
  1.3e-6 / atol 1e-5, are a few ulps of these O(1) values; a wrong head or token order is O(1)).
- ``RowParallelLinear(..., fold_bias=True)`` at tp = 1 against ``nn.Linear`` (``addmm`` either
  way: the same rounding) and against the unfolded ``(y, bias)`` pair summed (one rounding of the
  bias add in another order: fp32 defaults again).
"""
import pytest
import torch
from torch import nn

from tpfuse.tp_layers import ParallelAttention, RowParallelLinear
from tpfuse.tp_layers import attention as attention_module
from tpfuse.tp_layers.qkv_layout import split_qkv

S, B, D = 6, 3, 16


def _reference_split(qkv, groups, hpg, batch_first):
    """Autograd's slicing: the views the attention took before split_qkv."""
    t0, t1 = qkv.shape[:2]
    parts = qkv.view(t0, t1, groups, hpg + 2, D)
    q = parts[:, :, :, :hpg].reshape(t0, t1, groups * hpg, D)
    k, v = parts[:, :, :, hpg], parts[:, :, :, hpg + 1]
    order = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)
    return tuple(t.permute(*order) for t in (q, k, v))


@pytest.mark.parametrize("groups,hpg", [(4, 1), (2, 3)])
@pytest.mark.parametrize("batch_first", [False, True])
def test_split_qkv_matches_autograd_slicing(groups, hpg, batch_first):
    torch.manual_seed(0)
    tokens = (B, S) if batch_first else (S, B)
    base = torch.randn(*tokens, groups * (hpg + 2) * D)
    grads = [torch.randn(B, n, S, D) for n in (groups * hpg, groups, groups)]
    results = []
    for split in (split_qkv, None):
        qkv = base.clone().requires_grad_()
        parts = (split(qkv, groups, hpg, D, batch_first) if split is not None
                 else _reference_split(qkv, groups, hpg, batch_first))
        sum((p * g).sum() for p, g in zip(parts, grads)).backward()
        results.append(([p.detach() for p in parts], qkv.grad))
    (mine, my_grad), (ref, ref_grad) = results
    for a, b in zip(mine, ref):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(my_grad, ref_grad)


def _attention_run(batch_first, monkeypatch):
    monkeypatch.setattr(attention_module, "batch_first_attention", lambda *args: batch_first)
    torch.manual_seed(1)
    layer = ParallelAttention(64, 4, num_query_groups=2)
    x = torch.randn(S * 4, B, 64, requires_grad=True)
    out, bias = layer(x)
    assert bias is None                      # tp = 1: the projection GEMM added it
    out.backward(torch.ones_like(out) + torch.linspace(0, 1, out.numel()).view(out.shape))
    return out.detach(), x.grad, [p.grad for p in layer.parameters()]


def test_batch_first_attention_equals_sequence_first(monkeypatch):
    out_bf, dx_bf, grads_bf = _attention_run(True, monkeypatch)
    out_sf, dx_sf, grads_sf = _attention_run(False, monkeypatch)
    assert out_bf.shape == out_sf.shape == (S * 4, B, 64)
    torch.testing.assert_close(out_bf, out_sf)
    torch.testing.assert_close(dx_bf, dx_sf)
    for a, b in zip(grads_bf, grads_sf):
        torch.testing.assert_close(a, b)


def test_row_parallel_fold_bias_at_tp1():
    torch.manual_seed(2)
    dense = nn.Linear(32, 16)
    x = torch.randn(S, B, 32)
    folded = RowParallelLinear.from_dense(dense, skip_bias_add=True)
    y, bias = folded(x, fold_bias=True)
    assert bias is None
    torch.testing.assert_close(y, dense(x), rtol=0, atol=0)
    unfolded_y, unfolded_bias = folded(x)
    assert unfolded_bias is folded.bias
    torch.testing.assert_close(y, unfolded_y + unfolded_bias)
    y.sum().backward()
    torch.testing.assert_close(folded.bias.grad, torch.full((16,), float(S * B)))
