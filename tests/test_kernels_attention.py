"""flash_attention: the Triton kernels (interpreter) and the torch path vs the explicit-softmax
reference, and the reference vs float64 SDPA; forward, saved logsumexp and dq, dk, dv.

The launchers allocate every output (O, lse, δ, dq, dk, dv) filled with NaN (poison), so an element a
kernel fails to write stays NaN and fails ``assert_close`` (NaN never compares equal).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tpfuse.kernels.flash_attention import attention_reference, flash_attention
from tpfuse.kernels.flash_attention_fwd import attention_forward_triton

# Unit roundoff u of each dtype (half an ulp at 1: 2^-24 fp32, 2^-11 fp16, 2^-9 bf16).
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -9}


def _tolerance(dtype, reference):
    """Absolute tolerance for a kernel result against the fp32 reference on the same rounded inputs.

    fp32: both sides compute in fp32 and differ only in summation order (online softmax rescaling,
    blocked sums over s <= 67 terms): 1e-5 relative to the largest value covers it (observed ~1e-6).
    fp16/bf16: the kernel rounds its output (≤ u·|x|) and, like every flash attention, rounds the
    second GEMM's operand (P for O and dV, dS for dQ and dK) to the input dtype, adding ≤ u·Σ|terms|
    to each sum (fp32 accumulation otherwise). Σ|terms| exceeds |result| by a small factor where
    terms cancel (dS sums to ~0 per row), so the error is a few u·max|ref|: observed ≤ 1.1 (fp16) and
    ≤ 4.5 (bf16) on these cases; allow 8u·max|ref|.
    """
    scale = reference.abs().max().item()
    return 1e-5 * scale if dtype == torch.float32 else 8 * UNIT_ROUNDOFF[dtype] * scale


def _inputs(b, heads, kv_heads, s, d, dtype, seed=0, seq_major=False):
    gen = torch.Generator().manual_seed(seed)
    if seq_major:  # (b, s, h, d) storage seen as (b, h, s, d): a non-contiguous view, as layers make
        q = torch.randn(b, s, heads, d, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(b, heads, s, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
    grad_out = torch.randn(b, heads, s, d, generator=gen)
    return [t.to(dtype) for t in (q, k, v)], grad_out.to(dtype)


def _run(fn, qkv, grad_out, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = fn(*leaves, **kwargs)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def _assert_all_close(got, expected, dtype):
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert g.dtype == dtype and g.shape == e.shape, name
        atol = _tolerance(dtype, e.float())
        torch.testing.assert_close(g.float(), e.float(), rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_reference_matches_float64_sdpa(causal, heads, kv_heads):
    qkv, grad_out = _inputs(2, heads, kv_heads, 37, 24, torch.float32)
    got = _run(attention_reference, qkv, grad_out, causal=causal)
    exact = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                 [t.double() for t in qkv], grad_out.double())
    for g, e in zip(got, exact):  # fp32 against float64: summation-order noise ~1e-6
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)


# (dtype, causal, heads, kv_heads, s, d): GQA, MHA and MQA; d padded (24 → 32, 100 → 128) and exact
# (16, 64);
# s = 67 and 37 leave ragged tails for every interpreter block size (16 and 32).
TRITON_CASES = [
    (torch.float32, True, 4, 2, 67, 24),
    (torch.float32, False, 4, 4, 37, 64),
    (torch.float32, True, 2, 1, 37, 16),
    (torch.float16, True, 4, 2, 67, 24),
    (torch.bfloat16, False, 2, 1, 37, 64),
    (torch.bfloat16, True, 4, 4, 37, 16),
    (torch.float32, True, 2, 1, 5, 100),  # s below every block, d = 100 padded to 128
]


@pytest.mark.parametrize("dtype,causal,heads,kv_heads,s,d", TRITON_CASES)
def test_triton_matches_reference(dtype, causal, heads, kv_heads, s, d):
    qkv, grad_out = _inputs(2, heads, kv_heads, s, d, dtype, seq_major=(d == 24))
    scale = 0.3 if d == 64 else None  # a custom softmax_scale on the d = 64 cases
    got = _run(flash_attention, qkv, grad_out, causal=causal, softmax_scale=scale, backend="triton")
    expected = _run(attention_reference, qkv, grad_out, causal=causal, softmax_scale=scale)
    _assert_all_close(got, expected, dtype)


def test_triton_forward_saves_the_logsumexp():
    qkv, _ = _inputs(2, 4, 2, 37, 24, torch.float32, seed=1)
    _, lse = attention_forward_triton(*qkv, causal=True, softmax_scale=1 / math.sqrt(24))
    _, expected = attention_reference(*qkv, causal=True, return_lse=True)
    torch.testing.assert_close(lse, expected, rtol=1e-5, atol=1e-5)  # fp32 summation order only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(dtype):
    qkv, grad_out = _inputs(2, 4, 2, 67, 24, dtype, seed=2)
    got = _run(flash_attention, qkv, grad_out, causal=True, backend="torch")
    expected = _run(attention_reference, qkv, grad_out, causal=True)
    _assert_all_close(got, expected, dtype)


def test_bad_inputs_raise_value_error():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="heads=4 must be a multiple of kv_heads=3"):
        flash_attention(q, k, k)
    for d in (8, 256):
        t = torch.randn(1, 2, 8, d)
        with pytest.raises(ValueError, match=f"head dim d={d}"):
            flash_attention(t, t, t)
    with pytest.raises(ValueError, match="sequence length"):
        flash_attention(q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))
    with pytest.raises(ValueError, match="dtypes"):
        flash_attention(q, k[:, :2].double(), k[:, :2].double())
