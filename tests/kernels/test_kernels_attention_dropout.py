"""Attention dropout inside the flash kernels (Triton interpreter) equals the torch path's mask for
the same global coordinates, forward and backward: the kernels regenerate the Philox mask of
(sample, head, query position, key position) per tile; the torch path materialises it
(``AttentionDropout.factor``) on the explicit softmax. Compared against the explicit float64
softmax with that mask (``explicit_forward`` / ``explicit_backward``).

Tolerance: the fp32 kernels and the float64 reference differ by rounding only — each output is a
sum of ≤ s_k terms of size ≤ max|v|/(1 − p), so fp32 accumulation keeps it within s_k·u32 of
that magnitude (the 1e-5 used below is above 37·2⁻²⁴·(1/0.7)·|v|max ≈ 1e-5 for |v| ≤ 4). A mask
differing in one element moves an output by ~P/(1−p) ≈ 0.05 ≫ 1e-5.
"""
import pytest
import torch
from support.attention_cases import make_inputs, mask_case, run_with_grads

from tpfuse.kernels.flash_attention import attention_backward, attention_forward, flash_attention
from tpfuse.kernels.flash_attention_reference import explicit_backward, explicit_forward
from tpfuse.kernels.philox import AttentionDropout, dropout_key

B = 2
CASES = {  # name: (heads, kv_heads, s_q, s_k, mask keywords)
    "causal": (4, 2, 37, 37, dict()),
    "window_documents": (2, 1, 37, 37, dict(documents=True, window_size=6)),
    "chunk_after_keys": (4, 2, 13, 29, dict(q_offset=40, k_offset=20)),
}


def _dropout(first_sample=5, head_offset=2):
    return AttentionDropout(0.3, dropout_key(11, 4 * 3 + 3), first_sample, head_offset)


def _reference(qkv, grad_out, kw, dropout):
    """out, dq, dk, dv of the explicit float64 softmax with the dropout factor of the coordinates."""
    q, k, v = (t.double() for t in qkv)
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    from tpfuse.kernels.flash_attention_mask import build_mask
    mask = build_mask(q, k, **kw)
    visible = mask.visible(s_q, s_k, q.device)
    drop = dropout.factor(b, h, s_q, s_k, mask.q_offset, mask.k_offset, q.device, torch.float64)
    scale = d ** -0.5
    out, lse = explicit_forward(q, k, v, scale, visible, drop)
    grads = explicit_backward(grad_out.double(), q, k, v, out, lse, scale, visible, drop)
    return (out, *grads)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_flash_dropout_equals_reference_mask(name, backend):
    heads, kv_heads, s_q, s_k, spec = CASES[name]
    qkv, grad_out = make_inputs(B, heads, kv_heads, s_q, s_k, 24, torch.float32, seed=1)
    kw = mask_case(B, s_q, s_k, seed=1, **spec)
    dropout = _dropout()
    got = run_with_grads(lambda q, k, v: flash_attention(q, k, v, backend=backend, dropout=dropout,
                                                         **kw), qkv, grad_out)
    for g, e, what in zip(got, _reference(qkv, grad_out, kw, dropout), ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5, msg=what)


def test_deterministic_backward_and_blocks_with_dropout():
    """The deterministic dQ kernel and the building blocks (attention_forward / _backward, as ring
    attention calls them) regenerate the same mask."""
    heads, kv_heads, s_q, s_k, spec = CASES["chunk_after_keys"]
    qkv, grad_out = make_inputs(B, heads, kv_heads, s_q, s_k, 24, torch.float32, seed=2)
    kw = mask_case(B, s_q, s_k, seed=2, **spec)
    dropout = _dropout(first_sample=0, head_offset=0)
    out, lse = attention_forward(*qkv, backend="triton", dropout=dropout, **kw)
    dq, dk, dv = attention_backward(grad_out, *qkv, out, lse, deterministic=True, backend="triton",
                                    dropout=dropout, **kw)
    expected = _reference(qkv, grad_out, kw, dropout)
    for g, e, what in zip((out, dq, dk, dv), expected, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5, msg=what)


def test_dropout_changes_the_output():
    qkv, grad_out = make_inputs(B, 4, 2, 37, 37, 24, torch.float32, seed=1)
    plain = flash_attention(*qkv, backend="triton")
    dropped = flash_attention(*qkv, backend="triton", dropout=_dropout())
    assert (plain - dropped).abs().max() > 1e-2
