"""Shared inputs, mask cases and tolerances of the flash-attention tests.

A mask case describes a query chunk and a key chunk of one packed sequence of documents: queries at
positions ``q_offset + i``, keys at ``k_offset + j``, document ids sliced from the sequence's ids — so
every combination (causal, window, documents, offsets, s_q ≠ s_k) is a consistent piece of a real
sequence, as ring attention and decoding produce.
"""
from __future__ import annotations

import torch

# Unit roundoff u of each dtype (half an ulp at 1: 2^-24 fp32, 2^-11 fp16, 2^-9 bf16).
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -9}
NAMES = ("out", "dq", "dk", "dv")


def tolerance(dtype, reference):
    """Absolute tolerance for a kernel result against the fp32 reference on the same rounded inputs.

    fp32: both sides compute in fp32 and differ only in summation order (online softmax rescaling,
    blocked sums over ≤ 70 terms, atomic dq adds in any order): 1e-5 relative to the largest value
    covers it (observed ~1e-6).
    fp16/bf16: the kernel rounds its output (≤ u·|x|) and, like every flash attention, rounds the
    second GEMM's operand (P for O and dV, dS for dQ and dK) to the input dtype, adding ≤ u·Σ|terms|
    to each sum (fp32 accumulation otherwise). Σ|terms| exceeds |result| by a small factor where
    terms cancel (dS sums to ~0 per row), so the error is a few u·max|ref|: observed ≤ 1.1 (fp16) and
    ≤ 4.5 (bf16) on these cases; allow 8u·max|ref|.
    """
    scale = reference.abs().max().item()
    return 1e-5 * scale if dtype == torch.float32 else 8 * UNIT_ROUNDOFF[dtype] * scale


def packed_document_ids(b, length, seed, max_doc=11):
    """(b, length) int64 ids of documents of random lengths 1..max_doc packed back to back, per row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        lengths = torch.randint(1, max_doc + 1, (length,), generator=gen)
        rows.append(torch.repeat_interleave(torch.arange(length), lengths)[:length])
    return torch.stack(rows)


def mask_case(b, s_q, s_k, *, causal=True, window_size=None, documents=False, q_offset=0, k_offset=0,
              seed=0, max_doc=11):
    """The mask keywords of flash_attention for this chunk pair (ids cut from one packed sequence)."""
    kwargs = dict(causal=causal, window_size=window_size, q_offset=q_offset, k_offset=k_offset)
    if documents:
        ids = packed_document_ids(b, max(q_offset + s_q, k_offset + s_k), seed, max_doc)
        kwargs.update(q_document_ids=ids[:, q_offset:q_offset + s_q], k_document_ids=ids[:, k_offset:k_offset + s_k])
    return kwargs


def visible_by_loops(b, s_q, s_k, kw):
    """The mask by its definition, element by element (independent of AttentionMask.visible)."""
    keep = torch.zeros(b, 1, s_q, s_k, dtype=torch.bool)
    for row in range(b):
        for i in range(s_q):
            for j in range(s_k):
                q_pos, k_pos = kw.get("q_offset", 0) + i, kw.get("k_offset", 0) + j
                ok = k_pos <= q_pos if kw.get("causal", True) else True
                if kw.get("window_size") is not None:
                    ok = ok and q_pos - k_pos < kw["window_size"]
                if kw.get("q_document_ids") is not None:
                    ok = ok and bool(kw["q_document_ids"][row, i] == kw["k_document_ids"][row, j])
                keep[row, 0, i, j] = ok
    return keep


def make_inputs(b, heads, kv_heads, s_q, s_k, d, dtype, seed=0, seq_major=False):
    """([q, k, v], grad_out); seq_major: q stored (b, s, h, d) and seen as (b, h, s, d) (a layer's view)."""
    gen = torch.Generator().manual_seed(seed)
    if seq_major:
        q = torch.randn(b, s_q, heads, d, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(b, heads, s_q, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, s_k, d, generator=gen) for _ in range(2))
    grad_out = torch.randn(b, heads, s_q, d, generator=gen)
    return [t.to(dtype) for t in (q, k, v)], grad_out.to(dtype)


def run_with_grads(fn, qkv, grad_out, **kwargs):
    """[out, dq, dk, dv] of ``fn(q, k, v, **kwargs)`` backpropagating grad_out."""
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = fn(*leaves, **kwargs)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def assert_all_close(got, expected, dtype, names=NAMES):
    for name, g, e in zip(names, got, expected):
        assert g.dtype == dtype and g.shape == e.shape, name
        atol = tolerance(dtype, e.float())
        torch.testing.assert_close(g.float(), e.float(), rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
