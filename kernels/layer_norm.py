"""LayerNorm over the last dim with fp32 statistics: forward and backward (dx, dweight, dbias).

Per row x (N,):  μ = Σx/N,  σ⁻¹ = rstd = 1/√(Σ(x−μ)²/N + eps),  x̂ = (x−μ)·rstd,  y = x̂·w + b.
Backward (saved: x, w and the fp32 per-row μ and rstd, so nothing is recomputed but x̂):
  dx = rstd · (w⊙dy − x̂·mean(x̂⊙w⊙dy) − mean(w⊙dy))
  dw = Σ_rows dy⊙x̂,   db = Σ_rows dy
The backward kernel gives each program a contiguous block of rows; it writes that block's dx and its
partial dw/db sums (fp32, one row per program), which torch then adds up: no atomics, deterministic.
Rows wider than ``CHUNK_N`` are processed in column chunks (forward: three passes over the row;
backward: the per-row sums c1 = mean(x̂⊙w⊙dy), c2 = mean(w⊙dy) first, then the chunks).

File shape: Triton kernels → launchers → plain-torch reference → autograd Function → ``layer_norm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import backend as _backend

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- Triton kernels
# Rows up to CHUNK_N wide live in registers (one load per element); wider rows loop over column
# chunks of BLOCK_N (forward: three passes over the row, which stays in L1/L2; backward: a per-row
# statistics kernel, then a (row block, column chunk) kernel). The backward row loops are software
# pipelined (``tl.range(..., num_stages=NUM_STAGES)``: the next rows' x and dy load by cp.async
# into shared memory while this one computes) over a persistent grid (``backward_programs``).

@triton.jit
def _layer_norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                           stride_x, stride_y, N, eps,
                           HAS_BIAS: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * stride_x, y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        centered = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / N + eps)
        y = centered * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            total += tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(total, axis=0) / N
        squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = start + cols < N
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            centered = tl.where(mask, x - mean, 0.0)
            squares += centered * centered
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            mask = start + cols < N
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _layer_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr,
                           stride_x, stride_dy, stride_dx, M, N, rows_per_program,
                           BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Rows [pid·rows_per_program, ...) of a width ≤ BLOCK_N: dx, and this block's dw/db sums.
    The two row means come out of one two-operand reduction (one round of barriers per row)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in tl.range(row_start, row_end, num_stages=NUM_STAGES):
        row64 = tl.cast(row, tl.int64)  # the interpreter hands loop variables over as Python ints
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        w_dy = w * dy
        sum_xhat_wdy, sum_wdy = tl.reduce((x_hat * w_dy, w_dy), 0, _add_pair)
        dx = (w_dy - (x_hat * (sum_xhat_wdy / N) + sum_wdy / N)) * rstd
        tl.store(dx_ptr + row64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
        db_acc += dy
    tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=mask)
    tl.store(db_part_ptr + pid * N + cols, db_acc, mask=mask)


@triton.jit
def _layer_norm_bwd_row_sums_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, c1_ptr, c2_ptr,
                                    stride_x, stride_dy, N, BLOCK_N: tl.constexpr,
                                    NUM_STAGES: tl.constexpr):
    """Wide rows, step 1: c1 = mean(x̂⊙w⊙dy), c2 = mean(w⊙dy) of one row, over column chunks."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    sum_xhat_wdy = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sum_wdy = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        mask = start + cols < N
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + start + cols, mask=mask, other=0.0).to(tl.float32)
        w_dy = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32) * dy
        sum_xhat_wdy += tl.where(mask, (x - mean) * rstd, 0.0) * w_dy
        sum_wdy += w_dy
    total_xhat_wdy, total_wdy = tl.reduce((sum_xhat_wdy, sum_wdy), 0, _add_pair)
    tl.store(c1_ptr + row, total_xhat_wdy / N)
    tl.store(c2_ptr + row, total_wdy / N)


@triton.jit
def _layer_norm_bwd_chunk_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, c1_ptr, c2_ptr,
                                 dw_part_ptr, db_part_ptr, stride_x, stride_dy, stride_dx, M, N,
                                 rows_per_program, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Wide rows, step 2: program (row block, column chunk) writes dx of its chunk,
    dx = rstd·(w⊙dy − x̂·c1 − c2), and the block's dw/db sums of those columns."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in tl.range(row_start, row_end, num_stages=NUM_STAGES):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        dx = (w * dy - (x_hat * tl.load(c1_ptr + row) + tl.load(c2_ptr + row))) * rstd
        tl.store(dx_ptr + row64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
        db_acc += dy
    tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=mask)
    tl.store(db_part_ptr + pid * N + cols, db_acc, mask=mask)


# ----------------------------------------------------------------------------- launchers

CHUNK_N = 16384        # widest row held in registers at once; wider rows loop over chunks
CPU_CHUNK_N = 256      # the interpreter's chunk, small so the tests' rows cross several chunks
BWD_STAGES = 3         # backward row loops: x and dy of the next two rows in flight (cp.async)
BWD_COLUMNS_PER_SM = 8192  # backward state (w, dw, db, x, dy, x̂ in fp32: ~7 registers a column)
                           # of this many columns fills an SM's 64K registers


def row_launch_params(n_cols: int, element_size: int, is_cuda: bool, backward: bool = False) -> dict:
    """Block width and, on GPU, warps (and the backward's pipelining depth). The block is the next
    power of two ≥ n_cols up to the chunk width (CHUNK_N; the backward holds x, dy, w, x̂ and two
    accumulators per column and keeps pipelined copies of x and dy in shared memory, so its chunk
    holds 16 KB of one operand's row); ``ONE_BLOCK`` tells whether a row fits in one. Warps give
    each thread 8 (forward) to 16 (backward, more live vectors) columns at most up to 16 warps:
    enough loads in flight without spilling the per-thread vectors."""
    chunk = CHUNK_N if is_cuda else CPU_CHUNK_N
    if is_cuda and backward:  # 16 KB of a row per operand: 8K bf16 / 4K fp32 columns (ptxas: no spills)
        chunk = min(chunk, 16384 // element_size)
    block = min(triton.next_power_of_2(n_cols), chunk)
    params = {"BLOCK_N": block}
    if backward:
        params["NUM_STAGES"] = BWD_STAGES
    if is_cuda:
        params["num_warps"] = min(max(block // 256, 1), 16)
    return params


def backward_programs(n_rows: int, device: torch.device, block_n: int) -> int:
    """How many programs share the rows in backward. GPU: a persistent grid, as many programs as
    fit on the GPU at once (SMs × BWD_COLUMNS_PER_SM // block_n: one 8K-wide program per SM, eight
    1K-wide ones), so every program streams its rows in one pipelined loop and there are few
    partial dw/db rows to add up; a handful interpreted."""
    if device.type == "cuda":
        per_sm = max(1, BWD_COLUMNS_PER_SM // block_n)
        return max(1, min(n_rows, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n_rows, 4))


def layer_norm_fwd_triton(x2d, weight, bias, eps):
    """(M, N) → y (M, N) in x's dtype, mean and rstd (M,) fp32."""
    M, N = x2d.shape
    y = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    mean = torch.empty((M,), device=x2d.device, dtype=torch.float32)
    rstd = torch.empty((M,), device=x2d.device, dtype=torch.float32)
    if M:
        params = row_launch_params(N, x2d.element_size(), x2d.is_cuda)
        _backend.launch(_layer_norm_fwd_kernel, (M,), x2d, weight, bias if bias is not None else weight,
                        y, mean, rstd, x2d.stride(0), y.stride(0), N, eps, HAS_BIAS=bias is not None,
                        ONE_BLOCK=params["BLOCK_N"] >= N, **params)
    return y, mean, rstd


def layer_norm_bwd_triton(dy2d, x2d, weight, mean, rstd, stages=None):
    """→ dx (M, N) in x's dtype, dw and db (N,) fp32. ``stages``: the row loops' pipelining depth
    (default BWD_STAGES; benchmarks/gpu_check.py times the alternatives)."""
    M, N = x2d.shape
    dx = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    params = row_launch_params(N, x2d.element_size(), x2d.is_cuda, backward=True)
    params["NUM_STAGES"] = stages or params["NUM_STAGES"]
    programs = backward_programs(M, x2d.device, params["BLOCK_N"])
    rows_per_program = triton.cdiv(M, programs) if M else 1
    dw_part = torch.empty((programs, N), device=x2d.device, dtype=torch.float32)
    db_part = torch.empty((programs, N), device=x2d.device, dtype=torch.float32)
    if not M:
        dw_part.zero_(), db_part.zero_()
    elif params["BLOCK_N"] >= N:
        _backend.launch(_layer_norm_bwd_kernel, (programs,), x2d, weight, dy2d, dx, mean, rstd,
                        dw_part, db_part, x2d.stride(0), dy2d.stride(0), dx.stride(0), M, N,
                        rows_per_program, **params)
    else:
        c1 = torch.empty((M,), device=x2d.device, dtype=torch.float32)
        c2 = torch.empty((M,), device=x2d.device, dtype=torch.float32)
        _backend.launch(_layer_norm_bwd_row_sums_kernel, (M,), x2d, weight, dy2d, mean, rstd, c1, c2,
                        x2d.stride(0), dy2d.stride(0), N, **params)
        grid = (programs, triton.cdiv(N, params["BLOCK_N"]))
        _backend.launch(_layer_norm_bwd_chunk_kernel, grid, x2d, weight, dy2d, dx, mean, rstd, c1, c2,
                        dw_part, db_part, x2d.stride(0), dy2d.stride(0), dx.stride(0), M, N,
                        rows_per_program, **params)
    return dx, dw_part.sum(0), db_part.sum(0)


# ----------------------------------------------------------------------------- torch paths

def layer_norm_reference(x, weight, bias, eps=1e-5):
    """The plain composition of torch ops, statistics in fp32 (fp64 for fp64 input)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).pow(2).mean(-1, keepdim=True)
    y = (xc - mean) * torch.rsqrt(var + eps) * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def layer_norm_torch(x, weight, bias, eps):
    """The fast torch path: ATen's fused layer_norm (its own autograd); 16-bit inputs are
    normalised in fp32 (ATen's 16-bit backward rounds w⊙dy to 16 bits)."""
    n = x.shape[-1]
    if x.dtype == torch.float32:
        return F.layer_norm(x, (n,), weight.float(), bias.float() if bias is not None else None, eps)
    y = F.layer_norm(x.float(), (n,), weight.float(), bias.float() if bias is not None else None, eps)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- autograd

class _LayerNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, eps):
        weight = weight.contiguous()  # the kernels index w and b with unit stride
        bias = bias.contiguous() if bias is not None else None
        y, mean, rstd = layer_norm_fwd_triton(x2d, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dx, dw, db = layer_norm_bwd_triton(dy, x2d, weight, mean, rstd)
        db = db.to(ctx.bias_dtype) if ctx.has_bias else None
        return dx, dw.to(weight.dtype), db, None


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x (..., N) as (M, N) with unit column stride (the kernels take a row stride only)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def validate_norm_args(op, x, weight, bias, eps):
    n = x.shape[-1] if x.dim() else None
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name}.dtype must be one of {DTYPES}, got {t.dtype}")
    if weight is None or tuple(weight.shape) != (n,):
        raise ValueError(f"{op}: weight must have shape ({n},) (the last dim of x), got "
                         f"{None if weight is None else tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{op}: bias must have shape ({n},), got {tuple(bias.shape)}")
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")


def layer_norm(x, weight, bias, eps=1e-5, *, backend=None):
    """LayerNorm of ``x (..., N)`` over the last dim with ``weight (N,)`` and ``bias (N,)`` (or
    None); output in x's dtype, statistics in fp32."""
    validate_norm_args("layer_norm", x, weight, bias, eps)
    if _backend.resolve(backend, x, weight, bias) == "torch":
        return layer_norm_torch(x, weight, bias, eps)
    y = _LayerNormTriton.apply(rows_view(x), weight, bias, eps)  # (M, N)
    return y.view(x.shape)
