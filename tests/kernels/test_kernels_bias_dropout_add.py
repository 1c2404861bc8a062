"""bias_dropout_add on both backends (Triton through the interpreter on CPU tensors, and torch).

The mask depends only on (seed, element index, p), so it is read back through the op itself:
with x = 1, no bias and residual = 0 the output is m / (1 − p). The op on real inputs with the same
seed is then compared against the reference built from that mask, forward and backward.

Tolerances: kernel and reference do the same fp32 operations (x + bias, · 1/(1−p), + residual)
and round once to the output dtype; the scale may be rounded differently (Python double vs fp32
kernel argument), so we allow 2 units of roundoff of the output dtype (plus 2 of fp32) relative
to the magnitudes; dbias sums ROWS terms in fp32, which adds ROWS·u32 relative to Σ|terms|.
"""
import math

import pytest
import torch

from tpfuse.kernels import bias_dropout_add
from tpfuse.kernels.bias_dropout_add import bias_dropout_add_reference

ROWS, HIDDEN = 37, 61
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
BACKENDS = ["triton", "torch"]


def keep_mask(shape, p, seed, backend):
    """The keep mask the op draws for (shape, p, seed), observed through the op."""
    out = bias_dropout_add(torch.ones(shape), None, torch.zeros(shape), p, True, seed, backend=backend)
    assert torch.isfinite(out).all()
    kept = out != 0
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1.0 / (1.0 - p)))  # the 1/(1-p) scale
    return kept


def _close(actual, expected, magnitude, dtype, what, n_terms=1):
    assert actual.dtype == expected.dtype, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (unwritten elements?)"
    err = (actual.double() - expected.double()).abs()
    bound = 2 * (U[dtype] + n_terms * U[torch.float32]) * magnitude.double()
    assert (err <= bound).all(), f"{what}: max err {err.max().item():.3g}"


def _inputs(dtype, with_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(HIDDEN, generator=gen).to(dtype).requires_grad_() if with_bias else None
    residual = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype).requires_grad_()
    return x, bias, residual, torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,with_bias", [(torch.float32, True), (torch.float32, False),
                                             (torch.bfloat16, True), (torch.float16, True)])
def test_matches_reference_with_its_mask(backend, dtype, with_bias, poisoned_outputs):
    p, seed = 0.3, 1234
    x, bias, residual, dy = _inputs(dtype, with_bias)
    mask = keep_mask(x.shape, p, seed, backend)
    out = bias_dropout_add(x, bias, residual, p, True, seed, backend=backend)
    ref = bias_dropout_add_reference(x, bias, residual, p, mask)
    scale = 1 / (1 - p)
    value_mag = x.detach().abs() + (bias.detach().abs() if with_bias else 0)
    _close(out, ref, residual.detach().abs() + scale * value_mag, dtype, "out")
    leaves = [t for t in (x, bias, residual) if t is not None]
    grads = torch.autograd.grad(out, leaves, dy)
    grads_ref = torch.autograd.grad(ref, leaves, dy)
    # backward: the same mask (dx is 0 exactly where forward dropped, dy·scale elsewhere)
    _close(grads[0], grads_ref[0], scale * dy.abs(), dtype, "dx")
    assert torch.equal(grads[0] == 0, ~mask | (dy == 0))
    if with_bias:  # a column sum over ROWS terms, accumulated in fp32 (ROWS·u32) then rounded
        _close(grads[1], grads_ref[1], scale * dy.abs().sum(0), dtype, "dbias", n_terms=ROWS)
    assert torch.equal(grads[-1], dy)  # dresidual = dy


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_first_non_contiguous_inputs(backend, poisoned_outputs):
    """x (s, b, h) as a transposed view, bias broadcast over s and b, fp32."""
    p, seed, shape = 0.25, 77, (7, 3, HIDDEN)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 7, HIDDEN, generator=gen).transpose(0, 1).requires_grad_()  # (s, b, h), not contiguous
    bias = torch.randn(HIDDEN, generator=gen).requires_grad_()
    residual = torch.randn(*shape, generator=gen).requires_grad_()
    dy = torch.randn(*shape, generator=gen)
    mask = keep_mask(shape, p, seed, backend)
    out = bias_dropout_add(x, bias, residual, p, True, seed, backend=backend)
    ref = bias_dropout_add_reference(x, bias, residual, p, mask)
    magnitude = residual.detach().abs() + (x.detach().abs() + bias.detach().abs()) / (1 - p)
    _close(out, ref, magnitude, torch.float32, "out")
    grads, grads_ref = (torch.autograd.grad(o, [x, bias, residual], dy) for o in (out, ref))
    _close(grads[0], grads_ref[0], dy.abs() / (1 - p), torch.float32, "dx")
    _close(grads[1], grads_ref[1], dy.abs().sum((0, 1)) / (1 - p), torch.float32, "dbias", n_terms=21)
    assert torch.equal(grads[2], dy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_reproducible_from_seed_and_seeds_differ(backend):
    first = keep_mask((ROWS, HIDDEN), 0.5, 7, backend)
    assert torch.equal(first, keep_mask((ROWS, HIDDEN), 0.5, 7, backend))
    assert not torch.equal(first, keep_mask((ROWS, HIDDEN), 0.5, 8, backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_within_binomial_bound(backend, p):
    """Kept count ~ Binomial(n, 1 − p): within 5 standard deviations (false alarm < 1e-6)."""
    n = ROWS * HIDDEN * 4
    kept = keep_mask((4 * ROWS, HIDDEN), p, 99, backend).sum().item()
    assert abs(kept - n * (1 - p)) <= 5 * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_and_zero_p_are_identity_plus_add(backend, poisoned_outputs):
    x, bias, residual, _ = _inputs(torch.float32, True, seed=3)
    expected = residual + (x + bias)  # the op's order of additions: same fp32 operations
    magnitude = residual.detach().abs() + x.detach().abs() + bias.detach().abs()
    for p, training in ((0.5, False), (0.0, True)):
        out = bias_dropout_add(x, bias, residual, p, training, seed=5, backend=backend)
        _close(out, expected, magnitude, torch.float32, f"p={p} training={training}")
    assert torch.equal(bias_dropout_add(x, bias, residual, 1.0, True, 5, backend=backend), residual)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_none_follows_torch_manual_seed(backend):
    x, bias, residual, _ = _inputs(torch.float32, True, seed=4)
    torch.manual_seed(11)
    first = bias_dropout_add(x, bias, residual, 0.5, True, backend=backend)
    second = bias_dropout_add(x, bias, residual, 0.5, True, backend=backend)
    torch.manual_seed(11)
    again = bias_dropout_add(x, bias, residual, 0.5, True, backend=backend)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_fp32_residual_stream_with_bf16_input():
    x, bias, _, _ = _inputs(torch.bfloat16, True, seed=6)
    residual = torch.randn(ROWS, HIDDEN)
    for backend in BACKENDS:
        mask = keep_mask(x.shape, 0.2, 3, backend)
        out = bias_dropout_add(x, bias, residual, 0.2, True, 3, backend=backend)
        assert out.dtype == torch.float32
        ref = bias_dropout_add_reference(x, bias, residual, 0.2, mask)
        _close(out, ref, residual.abs() + 1.25 * (x.detach().abs() + bias.detach().abs()), torch.float32, backend)


@pytest.mark.parametrize("kwargs,match", [
    ({"p": 1.5}, "p must be"),
    ({"residual": torch.zeros(3, 5)}, "residual shape"),
    ({"bias": torch.zeros(5)}, "bias must"),
    ({"seed": -1}, "seed"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    args = {"x": torch.zeros(3, 4), "bias": None, "residual": torch.zeros(3, 4), "p": 0.1, "training": True}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        bias_dropout_add(**args)


def test_triton_row_strided_views_use_the_mask_of_their_logical_elements(poisoned_outputs):
    """x and residual as column slices of wider buffers (row stride 70, read through the stride):
    the mask is keyed by (row, column), so it equals the one drawn for contiguous inputs."""
    p, seed = 0.4, 99
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, 70, generator=gen)[:, :HIDDEN]
    residual = torch.randn(ROWS, 70, generator=gen)[:, 3:3 + HIDDEN]
    bias = torch.randn(2 * HIDDEN, generator=gen)[::2]                  # a strided bias
    assert x.stride(0) == 70 and not bias.is_contiguous()
    mask = keep_mask((ROWS, HIDDEN), p, seed, "triton")
    out = bias_dropout_add(x, bias, residual, p, True, seed, backend="triton")
    ref = bias_dropout_add_reference(x, bias, residual, p, mask)
    _close(out, ref, residual.abs() + (x.abs() + bias.abs()) / (1 - p), torch.float32, "out")


# ---------------------------------------------------------------- layout-invariant masks

def _coordinates(rows, seed=3, site=11):
    from tpfuse.kernels.philox import RowCoordinates, dropout_key

    return RowCoordinates(dropout_key(seed, site), (torch.arange(rows) * 7) % 23,
                          torch.arange(rows) // 5 + 1000)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_coordinate_mask_equal_on_both_backends_forward_and_backward(p):
    """With global coordinates both backends draw the mask of kernels/philox.py, bit for bit."""
    from tpfuse.kernels.philox import hidden_keep_mask

    coords = _coordinates(ROWS)
    expected = hidden_keep_mask(p, coords, HIDDEN)
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(ROWS, HIDDEN, generator=gen), torch.randn(ROWS, HIDDEN, generator=gen)
    bias, dy = torch.randn(HIDDEN, generator=gen), torch.randn(ROWS, HIDDEN, generator=gen)
    reference = bias_dropout_add_reference(x, bias, residual, p, expected)
    for backend in BACKENDS:
        ones = bias_dropout_add(torch.ones(ROWS, HIDDEN), None, torch.zeros(ROWS, HIDDEN), p,
                                True, backend=backend, coordinates=coords)
        assert torch.equal(ones != 0, expected), backend
        xs = x.clone().requires_grad_()
        out = bias_dropout_add(xs, bias, residual, p, True, backend=backend, coordinates=coords)
        _close(out, reference, residual.abs() + (x + bias).abs() / (1 - p), torch.float32, backend)
        out.backward(dy)
        assert torch.equal(xs.grad != 0, expected & (dy != 0)), backend
