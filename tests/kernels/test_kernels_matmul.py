"""matmul: the Triton kernel (interpreter on CPU) and the torch path against the plain-torch
reference, and the reference against float64; forward and every gradient.

Tolerances follow the standard GEMM error bound |fl(A·B) − A·B| ≤ γ·(|A|·|B|) elementwise:
- fp32 accumulation over K terms: γ ≈ K·u32 (u32 = 2⁻²⁴); a different summation order (tiles of
  32 vs MKL's) makes the two results differ by up to about twice that;
- 16-bit outputs add one rounding of the result: u_out·|C| (u = 2⁻⁸ bf16, 2⁻¹¹ fp16), and in
  backward the operand g = dy ⊙ act'(z) is rounded to the input dtype before the GEMMs (the
  reference keeps it in fp32): another u_in·(|g|·|b|);
- the activation is ≤ 1.13-Lipschitz, covered by the factor 2 of ``_bound``.
"""
import pytest
import torch

from tpfuse.kernels import matmul
from tpfuse.kernels.matmul import ACTIVATIONS, MatmulOptions, as_matrix, matmul_reference, pinned_config

M, N, K = 37, 53, 61
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # σ(2u) in numpy: exp → inf → 0, as on GPU


def _bound(a, b, k, out_dtype, operand_dtype, expected):
    """2·(γ·|A||B| + u_out·|C|) with γ = K·u32 + u_operand (the operand rounding term is 0 for fp32)."""
    magnitude = a.detach().abs().double() @ b.detach().abs().double()
    operand_term = UNIT_ROUNDOFF[operand_dtype] if operand_dtype != torch.float32 else 0.0
    gamma = k * UNIT_ROUNDOFF[torch.float32] + operand_term
    return 2 * (gamma * magnitude + UNIT_ROUNDOFF[out_dtype] * expected.abs().double())


def _assert_within(actual, expected, bound, what):
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected.double()).abs()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (unwritten elements?)"
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds bound by {worst:.3g} (max err {err.max().item():.3g})"


def _inputs(dtype, bias_on, seed=0, a_transposed=False, b_transposed=False, dims=(M, N, K)):
    m, n, k = dims
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(k, m, generator=gen).t() if a_transposed else torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen).t() if b_transposed else torch.randn(k, n, generator=gen)
    bias = torch.randn(n, generator=gen) if bias_on else None
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (a, b, bias)]
    return leaves, torch.randn(m, n, generator=gen).to(dtype)


def _run(fn, leaves, dy):
    y = fn(*leaves)
    grads = torch.autograd.grad(y, [t for t in leaves if t is not None], dy)
    return y, grads


def _check_against_reference(leaves, dy, activation, backend, out_dtype=None, options=None):
    """Forward and the gradients of a, b, bias of ``matmul`` vs the fp32 reference (autograd)."""
    a, b, bias = leaves
    M, K = a.shape
    N = b.shape[1]
    out_dtype = out_dtype or a.dtype
    y, grads = _run(lambda a, b, bias: matmul(a, b, bias, activation, out_dtype, backend=backend, options=options),
                    leaves, dy.to(out_dtype))
    y_ref, grads_ref = _run(lambda a, b, bias: matmul_reference(a, b, bias, activation, torch.float32), leaves, dy.float())
    assert y.dtype == out_dtype
    y_bound = _bound(a, b, K, out_dtype, torch.float32, y_ref)
    if backend == "torch" and activation is not None:
        # the torch path rounds the pre-activation z to the output dtype before the activation
        # (the Triton epilogue keeps it in fp32): one more u_out·|z|, times the slope ≤ 1.13
        z_ref = matmul_reference(a, b, bias, None, torch.float32).detach().double()
        y_bound = y_bound + 2 * 1.13 * UNIT_ROUNDOFF[out_dtype] * z_ref.abs()
    _assert_within(y, y_ref, y_bound, "y")
    # |g| ≤ 1.13·|dy|: bound the backward GEMMs with |dy| in place of |g|
    g_mag = dy.float().abs() * 1.13
    da, db = grads[0], grads[1]
    _assert_within(da, grads_ref[0], _bound(g_mag, b.detach().float().t(), N, a.dtype, a.dtype, grads_ref[0]), "da")
    _assert_within(db, grads_ref[1], _bound(a.detach().float().t(), g_mag, M, b.dtype, a.dtype, grads_ref[1]), "db")
    if bias is not None:
        ones = torch.ones(1, M)
        _assert_within(grads[2], grads_ref[2], _bound(ones, g_mag, M, bias.dtype, a.dtype, grads_ref[2]), "dbias")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias_on", [True, False])
def test_triton_fp32_matches_reference(activation, bias_on, poisoned_outputs):
    leaves, dy = _inputs(torch.float32, bias_on)
    _check_against_reference(leaves, dy, activation, "triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation,bias_on", [("gelu", True), ("relu", True), (None, False)])
def test_triton_16bit_matches_reference(dtype, activation, bias_on, poisoned_outputs):
    leaves, dy = _inputs(dtype, bias_on, seed=1)
    _check_against_reference(leaves, dy, activation, "triton")


@pytest.mark.parametrize("a_transposed,b_transposed", [(True, False), (False, True), (True, True)])
def test_triton_transposed_inputs(a_transposed, b_transposed, poisoned_outputs):
    leaves, dy = _inputs(torch.float32, True, seed=2, a_transposed=a_transposed, b_transposed=b_transposed)
    _check_against_reference(leaves, dy, "gelu_tanh", "triton")


def test_triton_strided_batched_input_and_out_dtype(poisoned_outputs):
    """a (s, b, K) as strided views of wider buffers (row stride 2K; element stride 2), bf16
    inputs with an fp32 output; gradients flow back through the views."""
    gen = torch.Generator().manual_seed(3)
    b = torch.randn(K, N, generator=gen).bfloat16().requires_grad_()
    bias = torch.randn(N, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(M, N, generator=gen)
    for take in (lambda t: t[..., :K], lambda t: t[..., ::2]):
        x = take(torch.randn(M, 1, 2 * K, generator=gen).bfloat16().requires_grad_())  # (M, 1, K) view
        assert as_matrix(x)._base is not None  # the kernel gets a view (strides), not a copy
        y = matmul(x, b, bias, "gelu", torch.float32, backend="triton")
        assert y.shape == (M, 1, N)
        _check_against_reference([x.view(M, K), b, bias], dy, "gelu", "triton", torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 70, 3), (2, 3, 100)])
def test_triton_shapes_smaller_or_longer_than_one_tile(m, n, k, poisoned_outputs):
    """Tiles larger than the whole problem (M, N, K < block) and K spanning several tiles."""
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(m, k, generator=gen).requires_grad_()
    b = torch.randn(k, n, generator=gen).requires_grad_()
    bias = torch.randn(n, generator=gen).requires_grad_()
    dy = torch.randn(m, n, generator=gen)
    y, grads = _run(lambda a, b, bias: matmul(a, b, bias, "relu", backend="triton"), [a, b, bias], dy)
    y_ref, grads_ref = _run(lambda a, b, bias: matmul_reference(a, b, bias, "relu"), [a, b, bias], dy)
    _assert_within(y, y_ref, _bound(a, b, k, torch.float32, torch.float32, y_ref), "y")
    _assert_within(grads[0], grads_ref[0], _bound(dy.abs(), b.t(), n, torch.float32, torch.float32, grads_ref[0]), "da")
    _assert_within(grads[1], grads_ref[1], _bound(a.t(), dy.abs(), m, torch.float32, torch.float32, grads_ref[1]), "db")
    _assert_within(grads[2], grads_ref[2], _bound(torch.ones(1, m), dy.abs(), m, torch.float32, torch.float32,
                                                  grads_ref[2]), "dbias")


@pytest.mark.parametrize("kernel", ["tma", "pointer"])
@pytest.mark.parametrize("a_transposed,b_transposed,activation", [
    (False, True, "gelu"), (True, False, "gelu_tanh"), (False, False, "relu"), (True, True, None)])
def test_triton_tma_kernel_and_pointer_fallback(kernel, a_transposed, b_transposed, activation, poisoned_outputs):
    """The persistent TMA kernel (descriptors over each operand's storage, transposed tiles in
    shared memory, 3 persistent programs walking 12 tiles, split epilogue) and the pointer kernel
    it falls back to, on every operand layout; bf16, dims that are multiples of 8 (TMA strides must
    be 16-byte multiples) but of no tile size (edge tiles are zero-padded by the descriptor)."""
    leaves, dy = _inputs(torch.bfloat16, activation is not None, seed=7, a_transposed=a_transposed,
                         b_transposed=b_transposed, dims=(40, 88, 56))
    _check_against_reference(leaves, dy, activation, "triton", options=MatmulOptions(kernel=kernel))


def test_tma_kernel_refuses_what_a_descriptor_cannot_describe():
    a, b = torch.randn(M, K).bfloat16(), torch.randn(K, N).bfloat16()  # K = 61: row stride 122 bytes
    with pytest.raises(ValueError, match="kernel='tma'"):
        matmul(a, b, backend="triton", options=MatmulOptions(kernel="tma"))
    with pytest.raises(ValueError, match="MatmulOptions.kernel"):
        MatmulOptions(kernel="cublas")


def test_pinned_config_is_a_function_of_the_problem_only():
    """Every rank of a job computes the same tile for the same GEMM (no timing, no collective):
    the largest tile that still fills all SMs, smaller tiles for small problems, and fp32 tiles
    that fit in shared memory."""
    big = pinned_config(8192, 8192, torch.bfloat16, "tma", 132)
    assert (big.kwargs["BLOCK_M"], big.kwargs["BLOCK_N"], big.num_warps) == (128, 256, 8)
    small = pinned_config(256, 256, torch.bfloat16, "tma", 132)
    assert (small.kwargs["BLOCK_M"], small.kwargs["BLOCK_N"]) == (64, 128)
    fp32 = pinned_config(8192, 8192, torch.float32, "pointer", 132)
    assert fp32.kwargs["BLOCK_K"] == 32
    assert pinned_config(8192, 8192, torch.bfloat16, "tma", 132).all_kwargs() == big.all_kwargs()


def test_transposed_operands_are_views_not_copies():
    """The launcher passes a plain transpose (or mergeable strided batch) as strides: the matrix it
    hands the kernel shares storage with the input."""
    at = torch.randn(K, M)
    assert as_matrix(at.t()).data_ptr() == at.data_ptr()
    batched = torch.randn(5, 2, 2 * K)[..., :K]  # (5, 2, K), strides (4K, 2K, 1): dims merge
    assert as_matrix(batched).data_ptr() == batched.data_ptr() and as_matrix(batched).stride() == (2 * K, 1)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(activation, dtype):
    leaves, dy = _inputs(dtype, True, seed=4, b_transposed=True)
    _check_against_reference(leaves, dy, activation, "torch")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_matches_float64(activation):
    """The fp32 reference (forward and autograd gradients) against the same composition in float64."""
    leaves, dy = _inputs(torch.float32, True, seed=5)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    fn = lambda a, b, bias: matmul_reference(a, b, bias, activation)  # noqa: E731
    y, grads = _run(fn, leaves, dy)
    y64, grads64 = _run(fn, leaves64, dy.double())
    a, b, _ = leaves64
    # fp32 reference vs exact: K·u32·|A||B| + u32·|C| (half of the two-implementation bound)
    _assert_within(y, y64, _bound(a.detach(), b.detach(), K, torch.float32, torch.float32, y64) / 2, "y")
    g_mag = dy.double().abs() * 1.13
    _assert_within(grads[0], grads64[0], _bound(g_mag, b.detach().t(), N, torch.float32, torch.float32, grads64[0]), "da")
    _assert_within(grads[1], grads64[1], _bound(a.detach().t(), g_mag, M, torch.float32, torch.float32, grads64[1]), "db")
    _assert_within(grads[2], grads64[2], _bound(torch.ones(1, M, dtype=torch.float64), g_mag, M, torch.float32,
                                                torch.float32, grads64[2]), "dbias")


def test_output_allows_in_place_use_and_1d_input():
    a, b = torch.randn(K, requires_grad=True), torch.randn(K, N, requires_grad=True)
    y = matmul(a, b, backend="triton")
    assert y.shape == (N,)
    torch.testing.assert_close(y, a @ b, rtol=0, atol=2 * K * 2.0**-24 * (a.abs() @ b.abs()).max().item())
    y2 = matmul(a.unsqueeze(0), b, backend="torch")
    y2.mul_(2).sum().backward()  # in-place on the output keeps autograd consistent
    torch.testing.assert_close(a.grad, 2 * b.detach().sum(1))


@pytest.mark.parametrize("kwargs,match", [
    ({"activation": "swish"}, "activation"),
    ({"b": torch.randn(K + 1, N)}, "K"),
    ({"bias": torch.randn(N + 1)}, "bias"),
    ({"b": torch.randn(K, N, dtype=torch.float64)}, "b.dtype"),
    ({"out_dtype": torch.int32}, "out_dtype"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    args = {"a": torch.randn(M, K), "b": torch.randn(K, N), "bias": None, "activation": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        matmul(**args)
    with pytest.raises(ValueError, match="backend"):
        matmul(torch.randn(2, 3), torch.randn(3, 4), backend="cuda")
