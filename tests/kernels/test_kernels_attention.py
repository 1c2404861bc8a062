"""flash_attention: the Triton kernels (interpreter) and the torch path vs the explicit-softmax
reference, and the reference vs float64 SDPA with a mask built element by element from its definition;
forward, logsumexp and dq, dk, dv, for every mask rule (causal, window, documents, offsets, s_q ≠ s_k).

Kernel outputs are allocated with torch.empty; the ``poisoned_outputs`` fixture fills those with NaN,
so an element a kernel fails to write stays NaN and fails ``assert_close`` (NaN never compares equal).
"""
import pytest
import torch
import torch.nn.functional as F
from support.attention_cases import (assert_all_close, make_inputs, mask_case, packed_document_ids, run_with_grads,
                              visible_by_loops)

from tpfuse.kernels import flash_attention_fwd
from tpfuse.kernels.flash_attention import (attention_backward, attention_forward, attention_reference,
                                            flash_attention)

B = 2
# name: (heads, kv_heads, s_q, s_k, mask keywords of mask_case). s = 37 / 67 leave ragged tails for every
# interpreter block size (16 and 32); documents are 1..11 tokens long, so blocks hold several.
CASES = {
    "causal": (4, 2, 37, 37, dict()),
    "full": (4, 4, 37, 37, dict(causal=False)),
    "window": (4, 2, 37, 37, dict(window_size=5)),
    "window_not_causal": (2, 1, 37, 37, dict(causal=False, window_size=6)),
    "documents": (4, 2, 37, 37, dict(documents=True)),
    "documents_window": (2, 1, 37, 37, dict(documents=True, window_size=4)),
    "long_documents": (2, 2, 67, 67, dict(causal=False, documents=True, max_doc=40)),
    "chunk_after_keys": (4, 2, 13, 29, dict(documents=True, q_offset=40, k_offset=20)),
    "chunk_before_keys": (2, 1, 30, 29, dict(documents=True, q_offset=0, k_offset=20, max_doc=25)),
    "decode": (4, 1, 1, 37, dict(q_offset=36, window_size=9)),
}


def _case(name, dtype, d=24, seed=0, seq_major=False):
    heads, kv_heads, s_q, s_k, spec = CASES[name]
    qkv, grad_out = make_inputs(B, heads, kv_heads, s_q, s_k, d, dtype, seed=seed, seq_major=seq_major)
    return qkv, grad_out, mask_case(B, s_q, s_k, seed=seed, **spec)


def _unsorted_documents():
    """Document ids in no order (each id scattered): exact, only masked (no skipping)."""
    qkv, grad_out = make_inputs(B, 4, 2, 37, 37, 24, torch.float32, seed=3)
    ids = torch.randint(0, 3, (B, 37), generator=torch.Generator().manual_seed(3))
    return qkv, grad_out, dict(causal=True, q_document_ids=ids, k_document_ids=ids)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_float64_sdpa_with_mask_by_definition(name):
    qkv, grad_out, kw = _case(name, torch.float32)
    got = run_with_grads(attention_reference, qkv, grad_out, **kw)
    keep = visible_by_loops(B, qkv[0].shape[2], qkv[1].shape[2], kw)
    exact = run_with_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True),
                           [t.double() for t in qkv], grad_out.double())
    for g, e in zip(got, exact):  # fp32 against float64: summation-order noise ~1e-6; empty rows 0 in both
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)


def test_reference_lse_and_empty_rows():
    qkv, grad_out, kw = _case("chunk_before_keys", torch.float32)
    out, lse = attention_reference(*qkv, return_lse=True, **kw)
    keep = visible_by_loops(B, 30, 29, kw)
    empty = ~keep.any(-1)                                                     # (b, 1, s_q)
    assert empty.any() and (~empty).any()
    scores = qkv[0].double() @ qkv[1].double().repeat_interleave(2, 1).transpose(-1, -2) / 24 ** 0.5
    expected = torch.logsumexp(scores.masked_fill(~keep, float("-inf")), -1)  # −inf on empty rows
    torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-5)
    assert (out.masked_select(empty[..., None]) == 0).all()


@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_matches_reference(name):
    qkv, grad_out, kw = _case(name, torch.float32, seed=1)
    got = run_with_grads(flash_attention, qkv, grad_out, backend="torch", **kw)
    expected = run_with_grads(attention_reference, qkv, grad_out, **kw)
    assert_all_close(got, expected, torch.float32)
    _, lse = attention_forward(*qkv, backend="torch", **kw)
    _, lse_expected = attention_reference(*qkv, return_lse=True, **kw)
    torch.testing.assert_close(lse, lse_expected, rtol=1e-5, atol=1e-5)   # −inf rows compare equal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["causal", "documents_window", "chunk_after_keys"])
def test_torch_path_half_precision(dtype, name):
    qkv, grad_out, kw = _case(name, dtype, seed=2, seq_major=True)
    got = run_with_grads(flash_attention, qkv, grad_out, backend="torch", **kw)
    expected = run_with_grads(attention_reference, qkv, grad_out, **kw)
    assert_all_close(got, expected, dtype)


def test_torch_path_unsorted_documents():
    qkv, grad_out, kw = _unsorted_documents()
    got = run_with_grads(flash_attention, qkv, grad_out, backend="torch", **kw)
    assert_all_close(got, run_with_grads(attention_reference, qkv, grad_out, **kw), torch.float32)


def test_torch_path_long_window_is_chunked():
    """A window much narrower than the sequence: row chunks, each reading only its keys."""
    kw = dict(causal=True, window_size=7)
    qkv, grad_out = make_inputs(1, 2, 1, 300, 300, 16, torch.float32, seed=4)  # two chunks of 256 rows
    got = run_with_grads(flash_attention, qkv, grad_out, backend="torch", **kw)
    assert_all_close(got, run_with_grads(attention_reference, qkv, grad_out, **kw), torch.float32)


# (dtype, case, d, deterministic): every mask rule in fp32 and a half dtype, the atomic-dq backward
# (default) and the deterministic one; d padded (24 → 32) and exact (16, 64); inputs seen through a
# (b, s, h, d) layout at d = 24.
TRITON_CASES = [
    (torch.float32, "causal", 24, False),
    (torch.float32, "causal", 24, True),
    (torch.float16, "causal", 24, False),
    (torch.bfloat16, "full", 64, False),
    (torch.float32, "window", 16, False),
    (torch.bfloat16, "window_not_causal", 16, True),
    (torch.float32, "documents", 16, False),
    (torch.float32, "long_documents", 16, True),
    (torch.bfloat16, "long_documents", 24, False),
    (torch.float32, "documents_window", 16, True),
    (torch.float16, "chunk_after_keys", 16, False),
    (torch.float32, "chunk_before_keys", 24, False),
    (torch.bfloat16, "decode", 16, False),
]


@pytest.mark.parametrize("dtype,name,d,deterministic", TRITON_CASES)
def test_triton_matches_reference(dtype, name, d, deterministic, poisoned_outputs):
    qkv, grad_out, kw = _case(name, dtype, d=d, seq_major=(d == 24))
    scale = 0.3 if d == 64 else None  # a custom softmax_scale on the d = 64 case
    got = run_with_grads(flash_attention, qkv, grad_out, softmax_scale=scale, backend="triton",
                         deterministic=deterministic, **kw)
    expected = run_with_grads(attention_reference, qkv, grad_out, softmax_scale=scale, **kw)
    assert_all_close(got, expected, dtype)


@pytest.mark.parametrize("deterministic", [False, True])
def test_triton_unsorted_documents(deterministic, poisoned_outputs):
    qkv, grad_out, kw = _unsorted_documents()
    got = run_with_grads(flash_attention, qkv, grad_out, backend="triton", deterministic=deterministic, **kw)
    assert_all_close(got, run_with_grads(attention_reference, qkv, grad_out, **kw), torch.float32)


@pytest.mark.parametrize("name,deterministic", [("documents_window", False), ("chunk_after_keys", True)])
def test_triton_tma_path(name, deterministic, poisoned_outputs, monkeypatch):
    """The kernels' TMA-descriptor loads (taken on Hopper GPUs), forced in the interpreter: the boxes'
    zero fill replaces the masked loads at the sequence and head-dim edges (d = 24 pads to 32)."""
    monkeypatch.setattr(flash_attention_fwd, "tma_usable", lambda *tensors: True)
    qkv, grad_out, kw = _case(name, torch.float32, d=24, seq_major=True)
    got = run_with_grads(flash_attention, qkv, grad_out, backend="triton", deterministic=deterministic, **kw)
    assert_all_close(got, run_with_grads(attention_reference, qkv, grad_out, **kw), torch.float32)


def test_triton_small_sequence_wide_head(poisoned_outputs):
    """s below every block, d = 100 padded to 128, MQA."""
    qkv, grad_out = make_inputs(B, 2, 1, 5, 5, 100, torch.float32)
    got = run_with_grads(flash_attention, qkv, grad_out, backend="triton")
    assert_all_close(got, run_with_grads(attention_reference, qkv, grad_out), torch.float32)


def test_triton_reads_and_writes_the_layers_layout_without_copies(poisoned_outputs, monkeypatch):
    """q, k, v as ParallelAttention cuts them from the fused QKV output (s, b, groups, heads/group + 2, d):
    no input is copied, out comes back in the (s, b, h, d) order (the layer's reshape is then a view), and
    dq, dk, dv in the layouts of q, k, v."""
    s, b, groups, per_group, d = 37, 2, 2, 2, 16
    qkv = torch.randn(s, b, groups, per_group + 2, d, generator=torch.Generator().manual_seed(8))
    q = qkv[:, :, :, :per_group].reshape(s, b, groups * per_group, d).permute(1, 2, 0, 3)
    k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in (per_group, per_group + 1))
    grad_out = torch.randn(b, s, groups * per_group, d).transpose(1, 2)
    contiguous = torch.Tensor.contiguous

    def no_copy(t, *args, **kwargs):
        assert t.is_contiguous(*args, **kwargs), f"a copy of a {tuple(t.shape)} tensor"
        return contiguous(t, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "contiguous", no_copy)
        out, lse = attention_forward(q, k, v, backend="triton")
        dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, backend="triton")
    assert out.permute(2, 0, 1, 3).is_contiguous()
    assert all(g.permute(2, 0, 1, 3).is_contiguous() for g in (dq, dk, dv))
    expected = run_with_grads(attention_reference, [q, k, v], grad_out)
    assert_all_close([out, dq, dk, dv], expected, torch.float32)


def test_triton_forward_saves_the_logsumexp(poisoned_outputs):
    qkv, _, kw = _case("causal", torch.float32, seed=1)
    _, lse = attention_forward(*qkv, backend="triton", **kw)
    _, expected = attention_reference(*qkv, return_lse=True, **kw)
    torch.testing.assert_close(lse, expected, rtol=1e-5, atol=1e-5)  # fp32 summation order only


# Empty rows next to live ones, in every kind of tile: keys at positions 20..48 and causal queries at
# 0..36, so rows 0..19 see no key (whole query tiles of 16 rows empty, one tile mixed) and the query
# and key ends are ragged for every block size; documents empty some later rows too, and a window
# leaves rows whose only keys lie in a padded key tile.
EMPTY_ROW_CASES = {
    "keys_after_queries": (37, 29, dict(causal=True, k_offset=20)),
    "documents_missing_from_keys": (37, 29, dict(causal=True, k_offset=20, documents=True, max_doc=6)),
    "window_into_padded_keys": (37, 21, dict(causal=True, window_size=3, q_offset=16)),
}


@pytest.mark.parametrize("backend,deterministic", [("torch", False), ("triton", False), ("triton", True)])
@pytest.mark.parametrize("name", list(EMPTY_ROW_CASES))
def test_empty_rows_and_padded_tiles_give_zeros_not_nan(name, backend, deterministic, poisoned_outputs):
    """A query with no visible key: out 0, lse −inf, dq 0 (its dO is nonzero), and no NaN anywhere
    in out, lse, dq, dk, dv — the backward reads lse = −inf for those rows, and padded tile rows /
    columns (zero q, k, dO) must add nothing. dk, dv against the reference."""
    s_q, s_k, spec = EMPTY_ROW_CASES[name]
    qkv, grad_out = make_inputs(B, 2, 1, s_q, s_k, 16, torch.float32, seed=5)
    kw = mask_case(B, s_q, s_k, seed=5, **spec)
    empty = ~visible_by_loops(B, s_q, s_k, kw).any(dim=-1)                        # (b, 1, s_q)
    assert empty.any() and not empty.all()                                        # the case has both
    out, lse = attention_forward(*qkv, backend=backend, **kw)
    grads = attention_backward(grad_out, *qkv, out, lse, backend=backend, deterministic=deterministic, **kw)
    for label, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert not t.isnan().any(), f"{label} has NaN"
    empty_heads = empty.expand(B, 2, s_q)
    assert (lse[empty_heads] == float("-inf")).all() and lse[~empty_heads].isfinite().all()
    assert (out[empty_heads] == 0).all() and (grads[0][empty_heads] == 0).all()
    expected = run_with_grads(attention_reference, qkv, grad_out, **kw)
    assert_all_close([out, *grads], expected, torch.float32)


def test_packed_document_ids_are_sorted_runs():
    ids = packed_document_ids(3, 50, seed=0)
    assert ids.shape == (3, 50) and (ids.diff(dim=1) >= 0).all() and (ids.diff(dim=1) <= 1).all()


def test_bad_inputs_raise_value_error():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="heads=4 must be a multiple of kv_heads=3"):
        flash_attention(q, k, k)
    for d in (8, 256):
        t = torch.randn(1, 2, 8, d)
        with pytest.raises(ValueError, match=f"head dim d={d}"):
            flash_attention(t, t, t)
    with pytest.raises(ValueError, match="batch and head dim"):
        flash_attention(q, torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16))
    with pytest.raises(ValueError, match="dtypes"):
        flash_attention(q, k[:, :2].double(), k[:, :2].double())
    kv = torch.randn(1, 2, 8, 16)
    for scale in (float("nan"), 0.0, -0.5, float("inf")):
        with pytest.raises(ValueError, match=f"softmax_scale must be a positive finite number, got {scale}"):
            flash_attention(q, kv, kv, softmax_scale=scale)
    with pytest.raises(ValueError, match="window_size must be >= 1, got 0"):
        flash_attention(q, kv, kv, window_size=0)
    with pytest.raises(ValueError, match="q_offset must be an int"):
        flash_attention(q, kv, kv, q_offset=1.5)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="must be given together"):
        flash_attention(q, kv, kv, q_document_ids=ids)
    with pytest.raises(ValueError, match=r"k_document_ids shape \(1, 7\) must be \(b, s\) = \(1, 8\)"):
        flash_attention(q, kv, kv, q_document_ids=ids, k_document_ids=ids[:, :7])
    with pytest.raises(ValueError, match="q_document_ids must be an integer tensor"):
        flash_attention(q, kv, kv, q_document_ids=ids.float(), k_document_ids=ids)
