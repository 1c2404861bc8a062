"""grouped_gemm: the Triton kernels (interpreter on CPU) and the torch path against a loop of
``torch.matmul`` in float64; forward, dgrad and wgrad, on odd shapes with an empty group.

Tolerance: the GEMM error bound |fl(A·B) − A·B| ≤ γ·(|A|·|B|) elementwise, per group. fp32
accumulation over K terms gives γ ≈ K·u32 (u32 = 2⁻²⁴); 16-bit outputs add one rounding of the
result, u_out·|C| (u = 2⁻⁸ bf16, 2⁻¹¹ fp16); dgrad and wgrad read the 16-bit dy the same way. The
factor 2 covers a different summation order than the reference's. A row sent to the wrong group,
a tile not written (outputs are poisoned with NaN) or a missed group in wgrad is off by O(1).
"""
import pytest
import torch

from tpfuse.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference

SIZES = (5, 0, 21, 3)          # an empty group, groups shorter and longer than BLOCK_M = 16
K, N = 19, 37                  # not multiples of the interpreter's tiles (BLOCK_K 32, BLOCK_N 32)
# (K, N): ragged tiles everywhere; whole tiles everywhere (the contiguity-hinted loads); whole K,
# ragged N (forward ragged, dgrad and wgrad's K side whole)
SHAPES = [(K, N), (32, 64), (32, N)]
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _bound(a_abs, b_abs, k, out_dtype, expected):
    """2·(K·u32·|A||B| + u_out·|C|) (fp32 outputs: the first term alone)."""
    out_term = U[out_dtype] if out_dtype != torch.float32 else 0.0
    return 2 * (k * U[torch.float32] * a_abs + out_term * expected.abs())


def _assert_within(actual, expected, bound, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (unwritten elements?)"
    excess = ((actual.double() - expected).abs() - bound).max().item()
    assert excess <= 0, f"{what}: error exceeds the bound by {excess:.3g}"


def _inputs(dtype, k=K, n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = sum(SIZES)
    x = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(len(SIZES), k, n, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to(dtype)
    return x, w, dy


def _per_group_abs_products(x, w, dy):
    """|x||w| (M, N), |dy||wᵀ| (M, K) and |xᵀ||dy| (G, K, N) in float64, group by group."""
    xa, wa, da = x.detach().abs().double(), w.detach().abs().double(), dy.abs().double()
    y_abs = grouped_gemm_reference(xa, wa, SIZES)
    dx_abs = grouped_gemm_reference(da, wa.transpose(1, 2), SIZES)
    dw_abs, start = [], 0
    for rows in SIZES:
        dw_abs.append(xa[start:start + rows].t() @ da[start:start + rows])
        start += rows
    return y_abs, dx_abs, torch.stack(dw_abs)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", SHAPES)
def test_grouped_gemm_and_gradients_match_a_loop_of_matmuls(backend, dtype, k, n, poisoned_outputs):
    x, w, dy = _inputs(dtype, k, n)
    y = grouped_gemm(x, w, SIZES, backend=backend)
    dx, dw = torch.autograd.grad(y, [x, w], dy)

    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y_ref = grouped_gemm_reference(x64, w64, SIZES)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, [x64, w64], dy.double())
    y_abs, dx_abs, dw_abs = _per_group_abs_products(x, w, dy)
    _assert_within(y, y_ref, _bound(y_abs, None, k, dtype, y_ref), "forward")
    _assert_within(dx, dx_ref, _bound(dx_abs, None, n, dtype, dx_ref), "dgrad")
    _assert_within(dw, dw_ref, _bound(dw_abs, None, max(SIZES), dtype, dw_ref), "wgrad")
    assert (dw[SIZES.index(0)] == 0).all(), "an empty group's weight gradient is zero"


def test_grouped_gemm_reads_strided_operands():
    """A transposed weight view (what dgrad passes) and a column slice of x give the same
    result as contiguous copies."""
    gen = torch.Generator().manual_seed(1)
    m = sum(SIZES)
    x = torch.randn(m, 2 * K, generator=gen)[:, ::2]             # stride (2K, 2)
    w = torch.randn(len(SIZES), N, K, generator=gen).transpose(1, 2)   # (G, K, N), stride-1 on K
    y = grouped_gemm(x, w, SIZES, backend="triton")
    y_ref = grouped_gemm_reference(x.double(), w.double(), SIZES)
    y_abs = grouped_gemm_reference(x.abs().double(), w.abs().double(), SIZES)
    _assert_within(y, y_ref, _bound(y_abs, None, K, torch.float32, y_ref), "strided")


def test_no_rows_at_all():
    x = torch.zeros(0, K, requires_grad=True)
    w = torch.randn(2, K, N, requires_grad=True)
    y = grouped_gemm(x, w, [0, 0], backend="triton")
    assert y.shape == (0, N)
    (dw,) = torch.autograd.grad(y.sum(), [w])
    assert (dw == 0).all()


@pytest.mark.parametrize("sizes,message", [
    ((5, 0, 21), "3 entries but w holds 4"),
    ((5, 0, 21, 4), "sum to the 29 rows"),
    ((30, 0, -1, 0), "must be >= 0"),
])
def test_bad_group_sizes_are_value_errors(sizes, message):
    x, w, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=message):
        grouped_gemm(x, w, sizes)
