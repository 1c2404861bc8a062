"""layer_norm and rms_norm: the Triton kernels (interpreter on CPU) and the torch paths against the
plain-torch references, and the references against float64; forward, dx, dweight, dbias.

Tolerances: every quantity is a sum over the row (N terms: mean, variance, the two reductions of
the backward) or over the rows (M terms: dweight, dbias), accumulated in fp32 in a different order
by the kernel and by torch. A sum of n terms carries at most n·u32 (u32 = 2⁻²⁴) relative to the
sum of the magnitudes of its terms, so each comparison allows
    2·(n·u32·magnitude + u_out·|expected|)
with magnitude the same formula evaluated on absolute values in float64 and u_out the unit
roundoff of the output dtype (2⁻⁸ bf16, 2⁻¹¹ fp16, 2⁻²⁴ fp32): both sides round their fp32 result
once to the output dtype. 16-bit inputs are read exactly by both, so only that rounding differs.
In LayerNorm, x − μ cancels: μ's error (N·u·mean|x|) is absolute, so |x̂| is widened by
rstd·mean|x| wherever it enters a magnitude.
"""
import pytest
import torch

from tpfuse.kernels import layer_norm, rms_norm
from tpfuse.kernels.layer_norm import layer_norm_reference
from tpfuse.kernels.rms_norm import rms_norm_reference

ROWS, WIDTH, EPS = 67, 61, 1e-5
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
U32 = U[torch.float32]


def _magnitudes(x, w, b, dy, kind):
    """Float64 sums of absolute values bounding each output's rounding error (see module doc)."""
    x, w, dy = x.detach().double(), w.detach().double(), dy.double()
    centered = x - x.mean(-1, keepdim=True) if kind == "layer" else x
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + EPS)
    x_hat = (centered * rstd).abs()
    if kind == "layer":  # μ's own rounding, N·u·mean|x|, is an absolute error of x − μ: scaled by rstd
        x_hat = x_hat + rstd * x.abs().mean(-1, keepdim=True)
    w_dy = (w * dy).abs()
    y = x_hat * w.abs() + (b.detach().double().abs() if b is not None else 0)
    dx = rstd * (w_dy + x_hat * (x_hat * w_dy).mean(-1, keepdim=True) + w_dy.mean(-1, keepdim=True))
    return {"y": y, "dx": dx, "dw": (dy.abs() * x_hat).sum(0), "db": dy.abs().sum(0)}


def _assert_within(actual, expected, magnitude, n_terms, out_dtype, what):
    assert actual.shape == expected.shape and actual.dtype == out_dtype, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (unwritten elements?)"
    err = (actual.double() - expected.double()).abs()
    bound = 2 * (n_terms * U32 * magnitude + U[out_dtype] * expected.double().abs())
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds bound by {worst:.3g} (max err {err.max().item():.3g})"


OPS = {
    "layer": (lambda x, w, b, **kw: layer_norm(x, w, b, EPS, **kw), lambda x, w, b: layer_norm_reference(x, w, b, EPS)),
    "rms": (lambda x, w, b, **kw: rms_norm(x, w, EPS, **kw), lambda x, w, b: rms_norm_reference(x, w, EPS)),
}


def _inputs(dtype, shape=(ROWS, WIDTH), seed=0, with_bias=True, row_stride_pad=0):
    gen = torch.Generator().manual_seed(seed)
    width = shape[-1]
    x = (torch.randn(*shape[:-1], width + row_stride_pad, generator=gen) * 3 + 1)[..., :width]
    w = torch.randn(width, generator=gen)
    b = torch.randn(width, generator=gen) if with_bias else None
    dy = torch.randn(*shape, generator=gen).to(dtype)
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    return leaves, dy


def _compare(kind, leaves, dy, backend, reference=None):
    """Forward and gradients of the op (or of ``reference`` in float64) vs the reference."""
    op, ref = OPS[kind]
    x, w, b = leaves
    wrt = [t for t in (x, w, b if kind == "layer" else None) if t is not None]
    y = op(x, w, b, backend=backend)
    grads = torch.autograd.grad(y, wrt, dy)
    if reference is None:
        y_ref = ref(x, w, b)
        grads_ref = torch.autograd.grad(y_ref, wrt, dy)
    else:
        y_ref, grads_ref = reference
    n_rows, width = dy.reshape(-1, dy.shape[-1]).shape
    mags = _magnitudes(x.reshape(-1, width), w, b, dy.reshape(-1, width), kind)
    _assert_within(y, y_ref, mags["y"].view(y.shape), width, x.dtype, "y")
    _assert_within(grads[0], grads_ref[0], mags["dx"].view(x.shape), width, x.dtype, "dx")
    _assert_within(grads[1], grads_ref[1], mags["dw"], n_rows + width, w.dtype, "dweight")
    if len(grads) == 3:
        _assert_within(grads[2], grads_ref[2], mags["db"], n_rows, b.dtype, "dbias")


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(kind, dtype, poisoned_outputs):
    leaves, dy = _inputs(dtype)
    _compare(kind, leaves, dy, "triton")


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_triton_wide_rows_strided_batched_input(kind, poisoned_outputs):
    """(5, 3, 300) rows (block 512, mostly masked tail) sliced out of a 317-wide buffer: row stride
    317, passed to the kernel as a stride."""
    leaves, dy = _inputs(torch.float32, shape=(5, 3, 300), seed=1, row_stride_pad=17)
    assert leaves[0].stride()[-2] == 317
    _compare(kind, leaves, dy, "triton")


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rows_wider_than_one_chunk(kind, dtype, poisoned_outputs):
    """Rows of 700 > the interpreter's chunk (256): the forward's three passes over column chunks
    and the backward's per-row sums + (row block, chunk) kernels, with a masked last chunk."""
    from tpfuse.kernels.layer_norm import CPU_CHUNK_N
    leaves, dy = _inputs(dtype, shape=(9, 700), seed=5, row_stride_pad=3)
    assert 2 * CPU_CHUNK_N < 700 < 3 * CPU_CHUNK_N
    _compare(kind, leaves, dy, "triton")


@pytest.mark.parametrize("width", [61, 700])
@pytest.mark.parametrize("stages", [2, 4])
def test_backward_pipelining_depths_give_the_default_result(width, stages, poisoned_outputs):
    """The backward launchers' ``stages`` (the depth benchmarks/gpu_check.py compares on a GPU)
    changes only how loads overlap, not the arithmetic: dx, dw and db equal the default depth's
    bit for bit, for rows in one block (61) and in column chunks (700); and the default agrees with
    the reference (the bounds of ``_compare``)."""
    from tpfuse.kernels.layer_norm import BWD_STAGES, layer_norm_bwd_triton, layer_norm_fwd_triton
    from tpfuse.kernels.rms_norm import rms_norm_bwd_triton, rms_norm_fwd_triton
    (x, w, b), dy = _inputs(torch.bfloat16, shape=(13, width), seed=7)
    x, w, b = x.detach(), w.detach(), b.detach()
    _, mean, rstd = layer_norm_fwd_triton(x, w, b, EPS)
    _, rms_rstd = rms_norm_fwd_triton(x, w, EPS)
    assert stages != BWD_STAGES
    for run in (lambda s: layer_norm_bwd_triton(dy, x, w, mean, rstd, stages=s),
                lambda s: rms_norm_bwd_triton(dy, x, w, rms_rstd, stages=s)):
        for got, want in zip(run(stages), run(None)):
            assert torch.equal(got, want)
    _compare("layer", [t.requires_grad_() for t in (x, w, b)], dy, "triton")


def test_triton_layer_norm_without_bias(poisoned_outputs):
    leaves, dy = _inputs(torch.float32, seed=2, with_bias=False)
    _compare("layer", leaves, dy, "triton")


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(kind, dtype):
    leaves, dy = _inputs(dtype, seed=3)
    _compare(kind, leaves, dy, "torch")


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_reference_matches_float64(kind):
    leaves, dy = _inputs(torch.float32, seed=4)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    _, ref = OPS[kind]
    wrt64 = leaves64 if kind == "layer" else leaves64[:2]
    y64 = ref(*leaves64)
    grads64 = torch.autograd.grad(y64, wrt64, dy.double())
    _compare_fp32_vs_exact(kind, leaves, dy, (y64, grads64))


def _compare_fp32_vs_exact(kind, leaves, dy, exact):
    """The fp32 reference against float64 values (same bounds: fp32 sums vs exact ones)."""
    x, w, b = leaves
    _, ref = OPS[kind]
    wrt = [x, w, b] if kind == "layer" else [x, w]
    y = ref(x, w, b)
    grads = torch.autograd.grad(y, wrt, dy)
    mags = _magnitudes(x, w, b, dy, kind)
    _assert_within(y, exact[0], mags["y"], WIDTH, torch.float32, "y")
    _assert_within(grads[0], exact[1][0], mags["dx"], WIDTH, torch.float32, "dx")
    _assert_within(grads[1], exact[1][1], mags["dw"], ROWS + WIDTH, torch.float32, "dweight")
    if kind == "layer":
        _assert_within(grads[2], exact[1][2], mags["db"], ROWS, torch.float32, "dbias")


@pytest.mark.parametrize("call,match", [
    (lambda: layer_norm(torch.randn(4, 8), torch.randn(7), torch.randn(8)), "weight"),
    (lambda: layer_norm(torch.randn(4, 8), torch.randn(8), torch.randn(9)), "bias"),
    (lambda: rms_norm(torch.randn(4, 8), torch.randn(8), eps=0.0), "eps"),
    (lambda: rms_norm(torch.randn(4, 8).double(), torch.randn(8)), "x.dtype"),
])
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
