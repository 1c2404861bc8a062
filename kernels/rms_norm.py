"""RMSNorm over the last dim with fp32 statistics: forward and backward (dx, dweight).

Per row x (N,):  rstd = 1/√(Σx²/N + eps),  x̂ = x·rstd,  y = x̂·w.
Backward (saved: x, w and the fp32 per-row rstd):
  dx = rstd · (w⊙dy − x̂·mean(x̂⊙w⊙dy)),   dw = Σ_rows dy⊙x̂
As in layer_norm.py, backward programs own contiguous row blocks and write partial dw sums (fp32),
added up by torch: no atomics, deterministic; rows wider than ``CHUNK_N`` go in column chunks
(backward: c1 = mean(x̂⊙w⊙dy) per row first, dx = rstd·(w⊙dy − x̂·c1) per chunk).

File shape: Triton kernels → launchers → plain-torch reference → autograd Function → ``rms_norm``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend as _backend
from .layer_norm import backward_programs, row_launch_params, rows_view, validate_norm_args


# ----------------------------------------------------------------------------- Triton kernels
# As in layer_norm.py: rows up to CHUNK_N in registers, wider ones in column chunks; backward row
# loops software pipelined over a persistent grid.

@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, N, eps,
                         ONE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * stride_x, y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        y = x * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            x = tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
            squares += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            mask = start + cols < N
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = x * rstd * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, rstd_ptr, dw_part_ptr,
                         stride_x, stride_dy, stride_dx, M, N, rows_per_program,
                         BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Rows [pid·rows_per_program, ...) of a width ≤ BLOCK_N: dx, and this block's dw sums."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in tl.range(row_start, row_end, num_stages=NUM_STAGES):
        row64 = tl.cast(row, tl.int64)  # the interpreter hands loop variables over as Python ints
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        w_dy = w * dy
        dx = (w_dy - x_hat * (tl.sum(x_hat * w_dy, axis=0) / N)) * rstd
        tl.store(dx_ptr + row64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=mask)


@triton.jit
def _rms_norm_bwd_row_sums_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, c1_ptr, stride_x, stride_dy, N,
                                  BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Wide rows, step 1: c1 = mean(x̂⊙w⊙dy) of one row, over column chunks."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rstd = tl.load(rstd_ptr + row)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        mask = start + cols < N
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + start + cols, mask=mask, other=0.0).to(tl.float32)
        acc += x * rstd * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32) * dy
    tl.store(c1_ptr + row, tl.sum(acc, axis=0) / N)


@triton.jit
def _rms_norm_bwd_chunk_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, rstd_ptr, c1_ptr, dw_part_ptr,
                               stride_x, stride_dy, stride_dx, M, N, rows_per_program,
                               BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Wide rows, step 2: program (row block, column chunk): dx = rstd·(w⊙dy − x̂·c1), dw sums."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in tl.range(row_start, row_end, num_stages=NUM_STAGES):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        dx = (w * dy - x_hat * tl.load(c1_ptr + row)) * rstd
        tl.store(dx_ptr + row64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=mask)


# ----------------------------------------------------------------------------- launchers

def rms_norm_fwd_triton(x2d, weight, eps):
    """(M, N) → y (M, N) in x's dtype, rstd (M,) fp32."""
    M, N = x2d.shape
    y = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    rstd = torch.empty((M,), device=x2d.device, dtype=torch.float32)
    if M:
        params = row_launch_params(N, x2d.element_size(), x2d.is_cuda)
        _backend.launch(_rms_norm_fwd_kernel, (M,), x2d, weight, y, rstd, x2d.stride(0), y.stride(0),
                        N, eps, ONE_BLOCK=params["BLOCK_N"] >= N, **params)
    return y, rstd


def rms_norm_bwd_triton(dy2d, x2d, weight, rstd, stages=None):
    """→ dx (M, N) in x's dtype, dw (N,) fp32; ``stages`` as in ``layer_norm_bwd_triton``."""
    M, N = x2d.shape
    dx = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    params = row_launch_params(N, x2d.element_size(), x2d.is_cuda, backward=True)
    params["NUM_STAGES"] = stages or params["NUM_STAGES"]
    programs = backward_programs(M, x2d.device, params["BLOCK_N"])
    rows_per_program = triton.cdiv(M, programs) if M else 1
    dw_part = torch.empty((programs, N), device=x2d.device, dtype=torch.float32)
    if not M:
        dw_part.zero_()
    elif params["BLOCK_N"] >= N:
        _backend.launch(_rms_norm_bwd_kernel, (programs,), x2d, weight, dy2d, dx, rstd, dw_part,
                        x2d.stride(0), dy2d.stride(0), dx.stride(0), M, N, rows_per_program, **params)
    else:
        c1 = torch.empty((M,), device=x2d.device, dtype=torch.float32)
        _backend.launch(_rms_norm_bwd_row_sums_kernel, (M,), x2d, weight, dy2d, rstd, c1,
                        x2d.stride(0), dy2d.stride(0), N, **params)
        grid = (programs, triton.cdiv(N, params["BLOCK_N"]))
        _backend.launch(_rms_norm_bwd_chunk_kernel, grid, x2d, weight, dy2d, dx, rstd, c1, dw_part,
                        x2d.stride(0), dy2d.stride(0), dx.stride(0), M, N, rows_per_program, **params)
    return dx, dw_part.sum(0)


# ----------------------------------------------------------------------------- torch paths

def rms_norm_reference(x, weight, eps=1e-5):
    """The plain composition of torch ops, statistics in fp32 (fp64 for fp64 input)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


class _RMSNormTorch(torch.autograd.Function):
    """The fast torch path (ATen's rms_norm is a composite on CPU): the closed-form backward of the
    module docstring, saving only x, w and rstd (M, 1); 16-bit inputs are normalised in fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf, wf = x.float(), weight.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).mul_(wf).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        w_dy = dy.float() * weight.float()
        mean_xhat_wdy = (x_hat * w_dy).mean(-1, keepdim=True)
        dx = w_dy.sub_(x_hat * mean_xhat_wdy).mul_(rstd)
        dw = (dy.float() * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rms_norm_torch(x, weight, eps):
    return _RMSNormTorch.apply(x, weight, eps)


# ----------------------------------------------------------------------------- autograd

class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        weight = weight.contiguous()  # the kernels index w with unit stride
        y, rstd = rms_norm_fwd_triton(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dx, dw = rms_norm_bwd_triton(dy, x2d, weight, rstd)
        return dx, dw.to(weight.dtype), None


def rms_norm(x, weight, eps=1e-5, *, backend=None):
    """RMSNorm of ``x (..., N)`` over the last dim with ``weight (N,)``; output in x's dtype,
    statistics in fp32."""
    validate_norm_args("rms_norm", x, weight, None, eps)
    if _backend.resolve(backend, x, weight) == "torch":
        return rms_norm_torch(x, weight, eps)
    y = _RMSNormTriton.apply(rows_view(x), weight, eps)  # (M, N)
    return y.view(x.shape)
