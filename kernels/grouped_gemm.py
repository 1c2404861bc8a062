"""Grouped GEMM: every local expert's GEMM in one launch, over variable token counts.

The rows of ``x (M, K)`` come grouped: group g owns rows ``offsets[g] : offsets[g+1]`` (``M_g``
rows, possibly none) and multiplies them by its own matrix ``w[g] (K, N)``::

  forward  y[rows_g]  = x[rows_g] @ w[g]               (M, N)
  dgrad    dx[rows_g] = dy[rows_g] @ w[g]ᵀ             (M, K)      the forward kernel on w's
                                                                   transposed view (strides only)
  wgrad    dw[g]      = x[rows_g]ᵀ @ dy[rows_g]        (G, K, N)   one program per (g, K-tile,
                                                                   N-tile), reducing over M_g
                                                                   (an empty group gets dw[g] = 0)

Forward tiling: group g is cut into ⌈M_g / BLOCK_M⌉ row tiles. Program (t, n) finds the group of
row tile t by walking the offsets (G is the number of local experts, small), so no host-side tile
table is needed and BLOCK_M can be autotuned. Each group adds at most one partial tile, so the
grid has ⌈M / BLOCK_M⌉ + G row tiles; the surplus programs return at once.

Accumulation is fp32 for every dtype; the output has the operands' dtype.

Inside a zero-bubble I pass (``wgrad_deferral``) backward returns dx only: the wgrad GEMM is
queued for the W action, which adds ``dw`` where autograd's gradient would have gone (``main_grad``
or ``w.grad``), so the MoE experts' weight gradients fill the pipeline's idle time as the TP
linear layers' do.

File shape: Triton kernels → launchers → torch paths (the fast CPU path: one ``mm`` per group into
slices of one output, and the reference: a loop of ``torch.matmul``) → autograd Function →
``grouped_gemm``.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import backend as _backend
from .matmul import _input_precision
from .matmul_kernels import dot_over_reduction, even_tile_rules, even_tiles, tile_indices
from .wgrad_deferral import (add_deferred_grad, defer_grad_of, deferred_grad_done,
                             weight_grads_deferred)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Interpreter meta-parameters: small tiles, so test shapes have several tiles per group.
CPU_META = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}


def _hopper_configs():
    """Tiles for sm_90: per-expert row counts are often a few hundred, so 64-row tiles are
    offered next to the 128-row ones (fewer wasted rows in each group's last tile)."""
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
        (128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (64, 256, 64, 4, 8),
        (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                          num_stages=stages, num_warps=warps)
            for bm, bn, bk, stages, warps in shapes]


def _hopper_wgrad_configs():
    shapes = [(64, 128, 128, 4, 8), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (32, 64, 64, 5, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                          num_stages=stages, num_warps=warps)
            for bm, bn, bk, stages, warps in shapes]


# ----------------------------------------------------------------------------- Triton kernels

@triton.autotune(configs=_hopper_configs(), key=["N", "K"])
@triton.heuristics(even_tile_rules("N"))
@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    G, N, K,
    stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_ym, stride_yn,
    INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of y[rows_g] = x[rows_g] @ w[g]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # which group holds row tile pid_m: walk the groups, counting their tiles
    tiles_before = pid_m * 0
    group = pid_m * 0
    row_start = pid_m * 0
    row_end = pid_m * 0
    for g in range(0, G):
        start = tl.load(offsets_ptr + g)
        end = tl.load(offsets_ptr + g + 1)
        tiles = tl.cdiv(end - start, BLOCK_M)
        mine = (pid_m >= tiles_before) & (pid_m < tiles_before + tiles)
        group = tl.where(mine, g, group)
        row_start = tl.where(mine, start + (pid_m - tiles_before) * BLOCK_M, row_start)
        row_end = tl.where(mine, end, row_end)
        tiles_before += tiles
    if row_end <= row_start:  # a surplus program of the upper-bound grid
        return

    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past the group's end / columns past N re-read valid memory; their results are not stored
    rows = tl.minimum(offs_m, row_end - 1).to(tl.int64)
    cols = tile_indices(offs_n, N, BLOCK_N, EVEN_N).to(tl.int64)   # w's columns: unit stride in fwd
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk          # (BM, BK)
    w_ptrs = (w_ptr + group.to(tl.int64) * stride_wg
              + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn)               # (BK, BN)
    acc = dot_over_reduction(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_ptrs, w_ptrs, K,
                             stride_xk, stride_wk, BLOCK_K, INPUT_PRECISION, DOT_IN_FP32)
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = (offs_m[:, None] < row_end) & (offs_n[None, :] < N)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_hopper_wgrad_configs(), key=["N", "K"])
@triton.heuristics(even_tile_rules("N", "K"))
@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr,
    N, K,
    stride_xm, stride_xk, stride_dm, stride_dn, stride_wg, stride_wk, stride_wn,
    INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_K, BLOCK_N) tile of dw[g] = x[rows_g]ᵀ @ dy[rows_g], summed over the group."""
    g = tl.program_id(0)
    pid = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid // num_pid_n
    pid_n = pid % num_pid_n
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tile_indices(offs_k, K, BLOCK_K, EVEN_K).to(tl.int64)   # xᵀ's rows: x's unit-stride columns
    ns = tile_indices(offs_n, N, BLOCK_N, EVEN_N).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_group = offs_m < end
        rows = offs_m.to(tl.int64)
        xt = tl.load(x_ptr + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                     mask=in_group[None, :], other=0.0)                                # (BK, BM)
        d = tl.load(dy_ptr + rows[:, None] * stride_dm + ns[None, :] * stride_dn,
                    mask=in_group[:, None], other=0.0)                                 # (BM, BN)
        if DOT_IN_FP32:
            xt = xt.to(tl.float32)
            d = d.to(tl.float32)
        acc = tl.dot(xt, d, acc, input_precision=INPUT_PRECISION)
    out = (dw_ptr + g.to(tl.int64) * stride_wg
           + offs_k.to(tl.int64)[:, None] * stride_wk + offs_n[None, :] * stride_wn)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers

def group_offsets(sizes, device) -> torch.Tensor:
    """``[0, M_0, M_0 + M_1, …, M]`` as int32 on ``device`` (the kernels' group boundaries)."""
    offsets = [0]
    for rows in sizes:
        offsets.append(offsets[-1] + rows)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def grouped_gemm_triton(x, w, sizes, offsets):
    """``y (M, N)``, ``y[rows_g] = x[rows_g] @ w[g]``; ``w`` may be any strided (G, K, N) view."""
    (M, K), (G, _, N) = x.shape, w.shape
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) + G, triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _backend.launch(
        _grouped_gemm_kernel, grid, x, w, y, offsets, G, N, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        INPUT_PRECISION=_input_precision(x.dtype),
        DOT_IN_FP32=not x.is_cuda and x.dtype != torch.float32,
        cpu_meta=dict(CPU_META, **even_tiles(CPU_META, N=N)))
    return y


def grouped_wgrad_triton(x, dy, sizes, offsets):
    """``dw (G, K, N)``, ``dw[g] = x[rows_g]ᵀ @ dy[rows_g]`` (zeros for an empty group)."""
    (_, K), N, G = x.shape, dy.shape[1], len(sizes)
    dw = torch.empty((G, K, N), device=x.device, dtype=x.dtype)
    if dw.numel() == 0:
        return dw
    grid = lambda meta: (G, triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _backend.launch(
        _grouped_wgrad_kernel, grid, x, dy, dw, offsets, N, K,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        INPUT_PRECISION=_input_precision(x.dtype),
        DOT_IN_FP32=not x.is_cuda and x.dtype != torch.float32,
        cpu_meta=dict(CPU_META, **even_tiles(CPU_META, N=N, K=K)))
    return dw


# ----------------------------------------------------------------------------- torch paths

def grouped_gemm_torch(x, w, sizes, offsets=None):
    """The CPU path: one ``mm`` per non-empty group, written into its slice of one output."""
    y = torch.empty((x.shape[0], w.shape[2]), device=x.device, dtype=x.dtype)
    start = 0
    for g, rows in enumerate(sizes):
        if rows:
            torch.mm(x[start:start + rows], w[g], out=y[start:start + rows])
        start += rows
    return y


def grouped_wgrad_torch(x, dy, sizes, offsets=None):
    dw = torch.empty((len(sizes), x.shape[1], dy.shape[1]), device=x.device, dtype=x.dtype)
    start = 0
    for g, rows in enumerate(sizes):
        if rows:
            torch.mm(x[start:start + rows].t(), dy[start:start + rows], out=dw[g])
        else:
            dw[g].zero_()
        start += rows
    return dw


def grouped_gemm_reference(x, w, sizes):
    """A loop of ``torch.matmul`` over the groups in fp32 (fp64 for fp64 inputs), concatenated;
    autograd gives its gradients. The tests' reference."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    parts, start = [], 0
    for g, rows in enumerate(sizes):
        parts.append(torch.matmul(x[start:start + rows].to(compute), w[g].to(compute)))
        start += rows
    return torch.cat(parts).to(x.dtype)


_PATHS = {  # path: (forward and dgrad GEMM, wgrad GEMM)
    "triton": (grouped_gemm_triton, grouped_wgrad_triton),
    "torch": (grouped_gemm_torch, grouped_wgrad_torch),
}


# ----------------------------------------------------------------------------- autograd

class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, sizes, offsets, path):
        ctx.save_for_backward(x, w, offsets)
        ctx.sizes, ctx.path = sizes, path
        return _PATHS[path][0](x, w, sizes, offsets)          # (M, N)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors                     # (M, K), (G, K, N), (G+1,)
        gemm, wgrad = _PATHS[ctx.path]
        dy = dy.to(x.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = gemm(dy, w.transpose(1, 2), ctx.sizes, offsets)   # (M, N) @ (N, K) per group
        if ctx.needs_input_grad[1]:
            if weight_grads_deferred(w):                            # zero-bubble I: wgrad in W
                defer_grad_of(w, functools.partial(_deferred_wgrad, w, x, dy, ctx.sizes,
                                                   offsets, ctx.path))
            else:
                dw = wgrad(x, dy, ctx.sizes, offsets)              # (G, K, M_g) @ (M_g, N)
        return dx, dw, None, None, None


def _deferred_wgrad(w, x, dy, sizes, offsets, path) -> None:
    """W's half of the backward: the wgrad GEMM the I pass held back, put where autograd's
    gradient would have gone (``main_grad`` or ``w.grad``)."""
    add_deferred_grad(w, _PATHS[path][1](x, dy, sizes, offsets))  # (G, K, N)
    deferred_grad_done(w)


def _sizes(tokens_per_group) -> tuple[int, ...]:
    if isinstance(tokens_per_group, torch.Tensor):
        tokens_per_group = tokens_per_group.tolist()
    return tuple(int(rows) for rows in tokens_per_group)


def _validate(x, w, sizes):
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_gemm needs x (M, K) and w (G, K, N), got x {tuple(x.shape)} "
                         f"and w {tuple(w.shape)}")
    if len(sizes) != w.shape[0]:
        raise ValueError(f"tokens_per_group has {len(sizes)} entries but w holds {w.shape[0]} "
                         "groups")
    if any(rows < 0 for rows in sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(f"tokens_per_group {list(sizes)} must be >= 0 and sum to the "
                         f"{x.shape[0]} rows of x")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share one dtype of {DTYPES}, got {x.dtype} and {w.dtype}")


def grouped_gemm(x, w, tokens_per_group, *, backend=None):
    """``y[rows_g] = x[rows_g] @ w[g]`` for consecutive row groups of sizes ``tokens_per_group``
    (a list of ints or an int tensor; host values are needed to size the launch). ``x (M, K)``,
    ``w (G, K, N)`` → ``y (M, N)``; differentiable in x and w (see the module docstring)."""
    sizes = _sizes(tokens_per_group)
    _validate(x, w, sizes)
    path = _backend.resolve(backend, x, w)
    offsets = group_offsets(sizes, x.device) if path == "triton" else None
    return _GroupedGemm.apply(x, w, sizes, offsets, path)
