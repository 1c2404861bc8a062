"""The flash-decoding path (one query row per head, keys split over programs, partials merged) against
the plain-torch reference, through Triton's interpreter: odd key counts, grouped-query heads (the
heads of a group are the rows of one tile), causal with a query offset, windows, documents, empty
rows, strided KV-cache views, and the split plan itself.

Tolerance: ``support.attention_cases.tolerance`` (fp32: summation order only; 16-bit: the output rounding and
the rounded P operand, as every flash attention). The merge adds one fp32 rescaling per split, far
below it. A wrong split bound, merge weight or mask moves the output by O(1).
"""
import importlib

import pytest
import torch

from support.attention_cases import make_inputs, mask_case, tolerance
from tpfuse.kernels import flash_attention_decode as decode
from tpfuse.kernels.flash_attention import attention_forward, attention_reference
from tpfuse.kernels.flash_attention_mask import build_mask

flash_module = importlib.import_module("tpfuse.kernels.flash_attention")  # (the package exports the function)

S_K = 77     # 3 splits of the interpreter's 32 keys, the last one ragged (13 keys, 16-key tiles)


def _check(q, k, v, **kw):
    out, lse = attention_forward(q, k, v, backend="triton", **kw)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=tolerance(q.dtype, ref.float()))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), rtol=1e-5, atol=1e-5)
    return out, lse


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (3, 1), (20, 1)])  # (20, 1): two 16-head tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_matches_the_reference(heads, kv_heads, dtype):
    (q, k, v), _ = make_inputs(2, heads, kv_heads, 1, S_K, 24, dtype, seed=heads)
    _check(q, k, v, **mask_case(2, 1, S_K, q_offset=S_K - 1))


@pytest.mark.parametrize("kw", [
    dict(q_offset=40),                               # causal, keys past the query skipped (2 splits)
    dict(q_offset=45, k_offset=9),                   # offsets on both sides
    dict(q_offset=S_K - 1, window_size=20),          # a window: the splits start at its first key
    dict(q_offset=S_K - 1, documents=True),          # the query's document bounds each split
    dict(causal=False, q_offset=30, documents=True),
    dict(causal=False, window_size=50, q_offset=60),
], ids=["causal", "offsets", "window", "documents", "documents-noncausal", "window-noncausal"])
def test_decode_masks_match_the_reference(kw):
    (q, k, v), _ = make_inputs(2, 6, 2, 1, S_K, 16, torch.float32, seed=3)
    _check(q, k, v, **mask_case(2, 1, S_K, seed=5, **kw))


def test_rows_that_see_no_key_give_out_0_and_lse_minus_inf():
    """A query before every key (causal, q_offset < k_offset): every split empty."""
    (q, k, v), _ = make_inputs(1, 4, 2, 1, S_K, 16, torch.float32)
    out, lse = _check(q, k, v, causal=True, q_offset=3, k_offset=10)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_kv_cache_views_are_read_through_their_strides():
    """K / V as (b, h_kv, s, d) views of a (b, s_max, h_kv, d) cache filled up to s; q seq-major."""
    gen = torch.Generator().manual_seed(7)
    cache_k, cache_v = (torch.randn(2, 96, 2, 32, generator=gen) for _ in range(2))
    k, v = (c[:, :S_K].transpose(1, 2) for c in (cache_k, cache_v))
    q = torch.randn(2, 1, 6, 32, generator=gen).transpose(1, 2)
    _check(q, k, v, causal=True, q_offset=S_K - 1)


def test_flash_attention_routes_decode_steps_to_the_split_kernel(monkeypatch):
    """s_q = 1 runs the split kernel, s_q > 1 the forward kernel."""
    calls = []
    for name in ("attention_decode_triton", "attention_forward_triton"):
        real = getattr(flash_module, name)
        monkeypatch.setattr(flash_module, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    for s_q in (1, 2):
        (q, k, v), _ = make_inputs(1, 2, 1, s_q, 20, 16, torch.float32)
        _check(q, k, v, causal=True, q_offset=20 - s_q)
    assert calls == ["attention_decode_triton", "attention_forward_triton"]


def test_split_plan():
    """Interpreted: splits of CPU_KEYS_PER_SPLIT keys over the visible span; never more than
    MAX_SPLITS; one (empty) split when nothing is visible."""
    cpu = torch.device("cpu")
    assert decode.split_plan(77, 4, cpu, 16) == (3, 32)
    assert decode.split_plan(0, 4, cpu, 16) == (1, 32)
    splits, per_split = decode.split_plan(100_000, 4, cpu, 16)
    assert splits <= decode.MAX_SPLITS and splits * per_split >= 100_000
    q = torch.zeros(1, 1, 1, 16)
    k = torch.zeros(1, 1, S_K, 16)
    assert decode.visible_key_span(build_mask(q, k, True, q_offset=40), S_K) == (0, 41)
    assert decode.visible_key_span(build_mask(q, k, True, window_size=20, q_offset=76), S_K) == (57, 77)
    assert decode.visible_key_span(build_mask(q, k, False), S_K) == (0, S_K)
    assert decode.visible_key_span(build_mask(q, k, True, q_offset=3, k_offset=10), S_K) == (0, 0)
