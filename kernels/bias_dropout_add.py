"""Fused ``residual + dropout(x + bias)`` (Megatron's bias-dropout-add), deterministic under a seed.

Forward  out = residual + m ⊙ (x + bias) / (1 − p),   m_i = [u_i ≥ p],  u_i ~ U[0, 1) from the seed
Backward dresidual = dy,   dx = m ⊙ dy / (1 − p),   dbias = Σ_rows dx
With ``training=False`` (or p = 0) it is ``residual + x + bias``; with p = 1 every element is dropped.

With ``coordinates`` (``kernels.philox.RowCoordinates``: the dropout site's Philox key and each
row's global position and sample) the mask is the layout-invariant one of ``kernels/philox.py``,
the same on both backends: m = keep(key; h // 4, position, sample, 0; word h % 4), recomputed
from the coordinates in the Triton backward, saved (as a mask) by the torch path.

Without coordinates the mask depends only on (seed, element index, p), never on the values, and
each backend is reproducible; the two backends draw different masks:
- Triton: u from Philox, one ``tl.randint4x`` call per quad of consecutive columns of a row
  (counter = row · ⌈H/4⌉ + col // 4, component col mod 4; rows = the leading dims flattened).
  Backward recomputes m from the seed: no mask is stored. Strided inputs whose leading dims merge
  are read through their row stride (no copy).
- torch: u from a ``torch.Generator`` seeded with the seed (``bernoulli_``). The mask is saved for
  backward (one element per input, x's dtype): cheaper on CPU than drawing it again.
``seed=None`` draws a seed from torch's default CPU generator (``torch.randint``), so
``torch.manual_seed`` and RNG trackers that fork that generator make runs reproducible.

File shape: Triton kernels → launchers → plain-torch reference → autograd Functions → op.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import backend as _backend
from .philox import RowCoordinates, hidden_keep_mask, keep_threshold, philox_keep

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SEED_LIMIT = 2**31 - 1


# ----------------------------------------------------------------------------- Triton kernels
# Tiles of (BLOCK_R rows, BLOCK_Q column quads, 4): one Philox call (``tl.randint4x``) yields the
# four uniforms of a quad of consecutive columns, keyed by counter = row · ⌈H/4⌉ + col // 4; the
# bias is a contiguous (BLOCK_Q, 4) load per tile, broadcast over its rows (no per-element modulo).

@triton.jit
def _keep_mask(seed, rows, quads, n_quads, p, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(BLOCK_R, BLOCK_Q, 4) booleans: uniform(seed, row, col) ≥ p."""
    counter = rows[:, None] * n_quads + quads[None, :]                          # (BR, BQ)
    r0, r1, r2, r3 = tl.randint4x(seed, counter)
    bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK_R, BLOCK_Q, 4))
    return tl.uint_to_uniform_float(bits) >= p


@triton.jit
def _coordinate_keep_mask(key, pos_ptr, sample_ptr, rows, quads, n_rows, threshold,
                          BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(BLOCK_R, BLOCK_Q, 4) booleans of the layout-invariant mask: Philox(key; quad, the row's
    global position, its global sample, 0), word = column mod 4."""
    in_rows = rows < n_rows
    pos = tl.load(pos_ptr + rows, mask=in_rows, other=0)                        # (BR,)
    sample = tl.load(sample_ptr + rows, mask=in_rows, other=0)
    c0 = quads[None, :] + 0 * rows[:, None]                                     # (BR, BQ)
    c1 = pos[:, None] + 0 * quads[None, :]
    c2 = sample[:, None] + 0 * quads[None, :]
    k0, k1, k2, k3 = philox_keep(key, c0, c1, c2, 0 * c0, threshold)
    # join(join(a, b), join(c, d))[..., i, j] is (a, b) for j = 0, (c, d) for j = 1 at i: words
    # in column order 0, 1, 2, 3 come from join(join(k0, k2), join(k1, k3))
    return tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), (BLOCK_R, BLOCK_Q, 4))


@triton.jit
def _keep(seed, key, pos_ptr, sample_ptr, rows, quads, n_rows, hidden, p, threshold,
          COORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    if COORDS:
        keep = _coordinate_keep_mask(key, pos_ptr, sample_ptr, rows, quads, n_rows, threshold,
                                     BLOCK_R, BLOCK_Q)
    else:
        keep = _keep_mask(seed, rows, quads, tl.cdiv(hidden, 4), p, BLOCK_R, BLOCK_Q)
    return keep


@triton.jit
def _bias_dropout_add_fwd_kernel(x_ptr, bias_ptr, res_ptr, out_ptr, pos_ptr, sample_ptr, n_rows,
                                 hidden, stride_x, stride_res, stride_out, p, scale, seed, key,
                                 threshold, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                                 COORDS: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)                   # (BR,)
    quads = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)                  # (BQ,)
    cols = quads[:, None] * 4 + tl.arange(0, 4)[None, :]                        # (BQ, 4)
    mask = (rows < n_rows)[:, None, None] & (cols < hidden)[None, :, :]
    rows64 = rows.to(tl.int64)[:, None, None]
    value = tl.load(x_ptr + rows64 * stride_x + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        value += tl.load(bias_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)[None, :, :]
    if DROPOUT:
        keep = _keep(seed, key, pos_ptr, sample_ptr, rows, quads, n_rows, hidden, p, threshold,
                     COORDS, BLOCK_R, BLOCK_Q)
        value = tl.where(keep, value * scale, 0.0)
    out = tl.load(res_ptr + rows64 * stride_res + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    out += value
    tl.store(out_ptr + rows64 * stride_out + cols[None, :, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_bwd_kernel(dy_ptr, dx_ptr, pos_ptr, sample_ptr, n_rows, hidden, stride_dy, stride_dx,
                        p, scale, seed, key, threshold, COORDS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """dx = m ⊙ dy · scale with m recomputed from (seed, row, col) exactly as in forward."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    quads = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = quads[:, None] * 4 + tl.arange(0, 4)[None, :]
    mask = (rows < n_rows)[:, None, None] & (cols < hidden)[None, :, :]
    rows64 = rows.to(tl.int64)[:, None, None]
    dy = tl.load(dy_ptr + rows64 * stride_dy + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    keep = _keep(seed, key, pos_ptr, sample_ptr, rows, quads, n_rows, hidden, p, threshold,
                 COORDS, BLOCK_R, BLOCK_Q)
    dx = tl.where(keep, dy * scale, 0.0)
    tl.store(dx_ptr + rows64 * stride_dx + cols[None, :, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers

def tile_params(hidden: int, is_cuda: bool) -> dict:
    """Tile of ≈ 4096 elements on GPU (≤ 1024 columns, 8 warps: 16 elements per thread),
    small ones interpreted (the tests' 61 columns span two column tiles)."""
    cols = min(triton.next_power_of_2(max(hidden, 4)), 1024 if is_cuda else 32)
    rows = max(1, (4096 if is_cuda else 256) // cols)
    params = {"BLOCK_R": rows, "BLOCK_Q": cols // 4}
    if is_cuda:
        params["num_warps"] = 8
    return params


def _grid(n_rows, hidden, params):
    return (triton.cdiv(n_rows, params["BLOCK_R"]), triton.cdiv(hidden, 4 * params["BLOCK_Q"]))


def _coordinate_args(coordinates, like, p):
    """(positions, samples, key, threshold) kernel arguments; placeholders without coordinates."""
    if coordinates is None:
        return like, like, 0, 0
    device = like.device
    return (coordinates.positions.to(device=device, dtype=torch.int32).contiguous(),
            coordinates.samples.to(device=device, dtype=torch.int32).contiguous(),
            coordinates.key, keep_threshold(p))


def bias_dropout_add_fwd_triton(x2d, bias, res2d, p, scale, seed, dropout, out_dtype,
                                coordinates=None):
    """x, residual (rows, H) with unit column stride, bias (H,) contiguous → out (rows, H)."""
    n_rows, hidden = x2d.shape
    out = torch.empty((n_rows, hidden), device=x2d.device, dtype=out_dtype)
    if out.numel():
        params = tile_params(hidden, x2d.is_cuda)
        pos, sample, key, threshold = _coordinate_args(coordinates, x2d, p)
        _backend.launch(_bias_dropout_add_fwd_kernel, _grid(n_rows, hidden, params), x2d,
                        bias if bias is not None else x2d, res2d, out, pos, sample, n_rows, hidden,
                        x2d.stride(0), res2d.stride(0), out.stride(0), p, scale, seed, key,
                        threshold, HAS_BIAS=bias is not None, DROPOUT=dropout,
                        COORDS=coordinates is not None, **params)
    return out


def dropout_bwd_triton(dy2d, p, scale, seed, dx_dtype, coordinates=None):
    n_rows, hidden = dy2d.shape
    dx = torch.empty((n_rows, hidden), device=dy2d.device, dtype=dx_dtype)
    if dx.numel():
        params = tile_params(hidden, dy2d.is_cuda)
        pos, sample, key, threshold = _coordinate_args(coordinates, dy2d, p)
        _backend.launch(_dropout_bwd_kernel, _grid(n_rows, hidden, params), dy2d, dx, pos, sample,
                        n_rows, hidden, dy2d.stride(0), dx.stride(0), p, scale, seed, key,
                        threshold, COORDS=coordinates is not None, **params)
    return dx


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (..., H) as (rows, H) with unit column stride: a view when the leading dims merge."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


# ----------------------------------------------------------------------------- torch paths

def bias_dropout_add_reference(x, bias, residual, p, keep_mask):
    """Plain torch ops given an explicit boolean keep mask (None: no dropout), computed in fp32."""
    value = x.float() + (bias.float() if bias is not None else 0.0)
    if keep_mask is not None:
        value = torch.where(keep_mask, value * _scale(p), torch.zeros_like(value))
    return (residual.float() + value).to(torch.promote_types(x.dtype, residual.dtype))


def _scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def torch_keep_mask(shape, p, seed, device, dtype):
    """The torch path's mask (1 keep / 0 drop, in ``dtype``) for a seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(shape, device=device, dtype=dtype).bernoulli_(1.0 - p, generator=generator)


def coordinate_keep_mask(shape, p, coordinates, device, dtype):
    """The layout-invariant mask (1 keep / 0 drop, in ``dtype``) of ``kernels/philox.py``."""
    rows = math.prod(shape[:-1])
    coordinates.check(rows)
    keep = hidden_keep_mask(p, coordinates, shape[-1], device)
    return keep.to(dtype).reshape(shape)


class _BiasDropoutAddTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, coordinates=None):
        out_dtype = torch.promote_types(x.dtype, residual.dtype)  # e.g. an fp32 residual stream
        value = x.to(out_dtype) + bias.to(out_dtype) if bias is not None else x.to(out_dtype)
        if coordinates is None:
            keep = torch_keep_mask(x.shape, p, seed, x.device, out_dtype)
        else:
            keep = coordinate_keep_mask(x.shape, p, coordinates, x.device, out_dtype)
        out = torch.addcmul(residual.to(out_dtype), value, keep, value=_scale(p))
        ctx.save_for_backward(keep)
        ctx.p, ctx.has_bias = p, bias is not None
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        dx = (dy * keep).mul_(_scale(ctx.p))  # in the output dtype
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx.to(ctx.x_dtype), dbias, dy.to(ctx.residual_dtype), None, None, None


class _BiasDropoutAddTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, dropout, coordinates=None):
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
        if coordinates is not None:
            coordinates.check(x.numel() // max(x.shape[-1], 1))
        out = bias_dropout_add_fwd_triton(_rows(x), bias.contiguous() if bias is not None else None,
                                          _rows(residual), p, _scale(p), seed, dropout, out_dtype,
                                          coordinates)
        ctx.p, ctx.seed, ctx.dropout, ctx.has_bias = p, seed, dropout, bias is not None
        ctx.coordinates = coordinates
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        if ctx.dropout:  # dx kept in dy's dtype until dbias is summed, then cast to x's
            dx = dropout_bwd_triton(_rows(dy), ctx.p, _scale(ctx.p), ctx.seed, dy.dtype,
                                    ctx.coordinates).view(dy.shape)
        else:
            dx = dy
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx.to(ctx.x_dtype), dbias, dy.to(ctx.residual_dtype), None, None, None, None


# ----------------------------------------------------------------------------- the op

def _validate(x, bias, residual, p):
    for name, t in (("x", x), ("bias", bias), ("residual", residual)):
        if t is not None and t.dtype not in DTYPES:
            raise ValueError(f"bias_dropout_add: {name}.dtype must be one of {DTYPES}, got {t.dtype}")
    if residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add: residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_dropout_add: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: p must be in [0, 1], got {p}")


def _draw_seed(seed):
    if seed is None:
        return int(torch.randint(0, _SEED_LIMIT, (1,), device="cpu").item())  # default CPU generator
    if not 0 <= int(seed) < _SEED_LIMIT:
        raise ValueError(f"bias_dropout_add: seed must be in [0, {_SEED_LIMIT}), got {seed}")
    return int(seed)


def bias_dropout_add(x, bias, residual, p, training, seed=None, *, backend=None,
                     coordinates: RowCoordinates | None = None):
    """``residual + dropout(x + bias, p)``; x and residual ``(..., H)``, bias ``(H,)`` or None.
    Output dtype: the promotion of x's and residual's (an fp32 residual stream stays fp32).
    ``coordinates``: the rows' global coordinates (layout-invariant mask; ``seed`` unused)."""
    _validate(x, bias, residual, p)
    dropout = bool(training) and p > 0.0
    path = _backend.resolve(backend, x, bias, residual)
    if path == "torch" and not dropout:
        return residual + (x + bias if bias is not None else x)
    if not dropout:
        coordinates = None
    seed = _draw_seed(seed) if dropout and coordinates is None else 0
    if path == "torch":
        return _BiasDropoutAddTorch.apply(x, bias, residual, float(p), seed, coordinates)
    if x.numel() // max(x.shape[-1], 1) * ((x.shape[-1] + 3) // 4) >= 2**31:
        raise ValueError(f"bias_dropout_add: the Triton kernel's Philox counter (rows · ⌈H/4⌉) must "
                         f"stay below 2**31, got shape {tuple(x.shape)}")
    return _BiasDropoutAddTriton.apply(x, bias, residual, float(p), seed, dropout, coordinates)
