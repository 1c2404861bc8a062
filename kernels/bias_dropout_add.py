"""Fused ``residual + dropout(x + bias)`` (Megatron's bias-dropout-add), deterministic under a seed.

Forward  out = residual + m ⊙ (x + bias) / (1 − p),   m_i = [u_i ≥ p],  u_i ~ U[0, 1) from the seed
Backward dresidual = dy,   dx = m ⊙ dy / (1 − p),   dbias = Σ_rows dx
With ``training=False`` (or p = 0) it is ``residual + x + bias``; with p = 1 every element is dropped.

The mask m depends only on (seed, element index, p), never on the values, and each backend is
reproducible; the two backends draw different masks:
- Triton: u = tl.rand(seed, flat index) (Philox). Backward recomputes m from the seed: no mask is
  stored.
- torch: u from a ``torch.Generator`` seeded with the seed (``bernoulli_``). The mask is saved for
  backward (one element per input, x's dtype): cheaper on CPU than drawing it again.
``seed=None`` draws a seed from torch's default CPU generator (``torch.randint``), so
``torch.manual_seed`` and RNG trackers that fork that generator make runs reproducible.

File shape: Triton kernels → launchers → plain-torch reference → autograd Functions → op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend as _backend

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SEED_LIMIT = 2**31 - 1


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _bias_dropout_add_fwd_kernel(x_ptr, bias_ptr, res_ptr, out_ptr, n_elements, hidden, p, scale, seed,
                                 HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat element index: the mask's key
    mask = offs < n_elements
    value = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        value += tl.load(bias_ptr + offs % hidden, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = tl.rand(seed, offs) >= p
        value = tl.where(keep, value * scale, 0.0)
    out = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32) + value
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_bwd_kernel(dy_ptr, dx_ptr, n_elements, p, scale, seed, BLOCK: tl.constexpr):
    """dx = m ⊙ dy · scale with m recomputed from (seed, index) exactly as in forward."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    keep = tl.rand(seed, offs) >= p
    tl.store(dx_ptr + offs, tl.where(keep, dy * scale, 0.0).to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers

def _block(t: torch.Tensor) -> int:
    return 1024 if t.is_cuda else 4096  # interpreted: few, wide programs


def bias_dropout_add_fwd_triton(x, bias, residual, p, scale, seed, dropout, out_dtype):
    """Flat contiguous x, residual (n,) and bias (H,) → out (n,) in out_dtype."""
    n = x.numel()
    out = torch.empty(n, device=x.device, dtype=out_dtype)
    if n:
        block = _block(x)
        _backend.launch(_bias_dropout_add_fwd_kernel, (triton.cdiv(n, block),), x, bias if bias is not None else x,
                        residual, out, n, bias.numel() if bias is not None else 1, p, scale, seed,
                        HAS_BIAS=bias is not None, DROPOUT=dropout, BLOCK=block)
    return out


def dropout_bwd_triton(dy, p, scale, seed, dx_dtype):
    n = dy.numel()
    dx = torch.empty(n, device=dy.device, dtype=dx_dtype)
    if n:
        block = _block(dy)
        _backend.launch(_dropout_bwd_kernel, (triton.cdiv(n, block),), dy, dx, n, p, scale, seed, BLOCK=block)
    return dx


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


class _BiasDropoutAddTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, seed):
        out_dtype = torch.promote_types(x.dtype, residual.dtype)  # e.g. an fp32 residual stream
        value = x.to(out_dtype) + bias.to(out_dtype) if bias is not None else x.to(out_dtype)
        keep = torch_keep_mask(x.shape, p, seed, x.device, out_dtype)
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
        return dx.to(ctx.x_dtype), dbias, dy.to(ctx.residual_dtype), None, None


class _BiasDropoutAddTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, dropout):
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
        flat_x, flat_res = x.contiguous().view(-1), residual.contiguous().view(-1)  # flat kernel
        out = bias_dropout_add_fwd_triton(flat_x, bias.contiguous() if bias is not None else None, flat_res,
                                          p, _scale(p), seed, dropout, out_dtype)
        ctx.p, ctx.seed, ctx.dropout, ctx.has_bias = p, seed, dropout, bias is not None
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        if ctx.dropout:  # dx kept in dy's dtype until dbias is summed, then cast to x's
            dx = dropout_bwd_triton(dy.contiguous().view(-1), ctx.p, _scale(ctx.p), ctx.seed, dy.dtype).view(dy.shape)
        else:
            dx = dy
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx.to(ctx.x_dtype), dbias, dy.to(ctx.residual_dtype), None, None, None


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
        return int(torch.randint(0, _SEED_LIMIT, (1,)).item())  # default CPU generator
    if not 0 <= int(seed) < _SEED_LIMIT:
        raise ValueError(f"bias_dropout_add: seed must be in [0, {_SEED_LIMIT}), got {seed}")
    return int(seed)


def bias_dropout_add(x, bias, residual, p, training, seed=None, *, backend=None):
    """``residual + dropout(x + bias, p)``; x and residual ``(..., H)``, bias ``(H,)`` or None.
    Output dtype: the promotion of x's and residual's (an fp32 residual stream stays fp32)."""
    _validate(x, bias, residual, p)
    dropout = bool(training) and p > 0.0
    path = _backend.resolve(backend, x, bias, residual)
    if path == "torch" and not dropout:
        return residual + (x + bias if bias is not None else x)
    seed = _draw_seed(seed) if dropout else 0
    if path == "torch":
        return _BiasDropoutAddTorch.apply(x, bias, residual, float(p), seed)
    if x.numel() >= 2**31:
        raise ValueError(f"bias_dropout_add: the Triton kernel indexes < 2**31 elements, got {x.numel()}")
    return _BiasDropoutAddTriton.apply(x, bias, residual, float(p), seed, dropout)
