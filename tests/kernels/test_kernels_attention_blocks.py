"""The ring-attention building blocks: attention over key blocks with position offsets and document ids,
combined by merge_attention, equals attention over all keys (forward, logsumexp); attention_backward
per key block given the merged out / lse sums to the full gradients. And masked-out tiles are skipped,
not just masked: keys / queries a block may not see are filled with NaN, which any read would spread
(0 · NaN = NaN inside a GEMM).
"""
import pytest
import torch
from support.attention_cases import assert_all_close, make_inputs, mask_case, run_with_grads

from tpfuse.kernels.flash_attention import (attention_backward, attention_forward, attention_reference,
                                            merge_attention)

B, HEADS, KV_HEADS, D = 2, 4, 2, 16
BACKENDS = ["torch", "triton"]


def _split_keys(kw, k, v, bounds):
    """Per key block [lo, hi): (k, v, mask keywords with k_offset and k_document_ids of the block)."""
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        block = dict(kw, k_offset=kw["k_offset"] + lo)
        if kw.get("k_document_ids") is not None:
            block["k_document_ids"] = kw["k_document_ids"][:, lo:hi]
        yield k[:, :, lo:hi], v[:, :, lo:hi], block


# (s_q, q_offset, key blocks, mask): the query chunk sits inside the key range, so some blocks are in
# its future (empty under causal: lse −inf) and some rows see nothing in a block.
RING_CASES = {
    "causal_documents": (19, 14, (0, 13, 29, 40), dict(documents=True)),
    "window": (40, 0, (0, 16, 17, 40), dict(window_size=9)),
    "full_documents": (23, 5, (0, 20, 40), dict(causal=False, documents=True, max_doc=15)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(RING_CASES))
def test_key_blocks_merge_to_full_attention(name, backend):
    s_q, q_offset, bounds, spec = RING_CASES[name]
    s_k = bounds[-1]
    (q, k, v), grad_out = make_inputs(B, HEADS, KV_HEADS, s_q, s_k, D, torch.float32, seed=5)
    kw = mask_case(B, s_q, s_k, q_offset=q_offset, seed=5, **spec)
    out = lse = None
    for k_blk, v_blk, blk_kw in _split_keys(kw, k, v, bounds):
        o, l = attention_forward(q, k_blk, v_blk, backend=backend, **blk_kw)
        out, lse = (o, l) if out is None else merge_attention(out, lse, o, l)
    expected_out, expected_lse = attention_reference(q, k, v, return_lse=True, **kw)
    assert_all_close([out], [expected_out], torch.float32, names=("out",))
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)

    dq = torch.zeros_like(q)
    dk, dv = [], []
    for k_blk, v_blk, blk_kw in _split_keys(kw, k, v, bounds):
        g_q, g_k, g_v = attention_backward(grad_out, q, k_blk, v_blk, out, lse, backend=backend, **blk_kw)
        dq, dk, dv = dq + g_q, dk + [g_k], dv + [g_v]
    expected = run_with_grads(attention_reference, [q, k, v], grad_out, **kw)
    assert_all_close([dq, torch.cat(dk, 2), torch.cat(dv, 2)], expected[1:], torch.float32, names=("dq", "dk", "dv"))


def test_merge_attention_of_empty_rows():
    out_a, out_b = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    inf = float("-inf")
    lse_a = torch.tensor([[[0.5, inf, inf], [1.0, inf, 2.0]]])
    lse_b = torch.tensor([[[inf, 0.25, inf], [1.0, 3.0, 2.0]]])
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0, 0, 0], out_a[0, 0, 0], rtol=0, atol=0)     # b empty: a's values
    torch.testing.assert_close(out[0, 0, 1], out_b[0, 0, 1], rtol=0, atol=0)     # a empty: b's values
    assert (out[0, 0, 2] == 0).all() and lse[0, 0, 2] == inf                     # both empty
    torch.testing.assert_close(out[0, 1, 0], (out_a[0, 1, 0] + out_b[0, 1, 0]) / 2)  # equal weights
    torch.testing.assert_close(lse[0, 1], torch.tensor([1.0 + 0.6931472, 3.0, 2.0 + 0.6931472]))


def _poisoned(t, index):
    t = t.clone()
    t[index] = float("nan")
    return t


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy meets the NaN poison
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiles_of_other_documents_are_never_read(backend):
    """Two documents of 32 tokens (whole interpreter tiles), not causal: a query of document A reads no
    key of document B, forward and backward, in either direction."""
    (q, k, v), grad_out = make_inputs(1, 2, 1, 64, 64, D, torch.float32, seed=6)
    ids = (torch.arange(64) >= 32).long()[None]
    kw = dict(causal=False, q_document_ids=ids, k_document_ids=ids)
    out, lse = attention_reference(q, k, v, return_lse=True, **kw)
    grads = torch.autograd.functional.vjp(lambda *t: attention_reference(*t, **kw), (q, k, v), grad_out)[1]
    for mine, other in ((slice(0, 32), slice(32, 64)), (slice(32, 64), slice(0, 32))):
        keys = (slice(None), slice(None), other)
        got, _ = attention_forward(q, _poisoned(k, keys), _poisoned(v, keys), backend=backend, **kw)
        torch.testing.assert_close(got[:, :, mine], out[:, :, mine], rtol=0, atol=1e-5)
        rows = (slice(None), slice(None), other)
        g_q, g_k, g_v = attention_backward(_poisoned(grad_out, rows), _poisoned(q, rows), k, v,
                                           _poisoned(out, rows), _poisoned(lse, rows), backend=backend, **kw)
        for g, e in zip((g_k, g_v), grads[1:]):      # this document's keys never see the other's queries
            torch.testing.assert_close(g[:, :, mine], e[:, :, mine], rtol=0, atol=1e-5)
        torch.testing.assert_close(g_q[:, :, mine], grads[0][:, :, mine], rtol=0, atol=1e-5)


# backend: (s, window, rows checked, keys poisoned): tiles (Triton) or row chunks (torch path) of these
# rows start after the poisoned keys.
WINDOW_SKIP = {"torch": (300, 7, slice(256, 300), slice(0, 240)), "triton": (64, 8, slice(32, 64), slice(0, 16))}


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_behind_the_window_are_never_read(backend):
    s, window, rows, keys = WINDOW_SKIP[backend]
    (q, k, v), _ = make_inputs(1, 2, 1, s, s, D, torch.float32, seed=7)
    kw = dict(causal=True, window_size=window)
    poison = (slice(None), slice(None), keys)
    got, _ = attention_forward(q, _poisoned(k, poison), _poisoned(v, poison), backend=backend, **kw)
    expected = attention_reference(q, k, v, **kw)
    torch.testing.assert_close(got[:, :, rows], expected[:, :, rows], rtol=0, atol=1e-5)
