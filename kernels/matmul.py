"""GEMM with the bias and activation fused into the epilogue: ``y = act(a @ b + bias)``.

Shapes: ``a (..., K)``, ``b (K, N)``, ``bias (N,)`` → ``y (..., N)``; a linear layer ``x @ wᵀ`` is
``matmul(x, w.t(), bias)`` (the transpose is passed to the kernel as strides, never copied).

Algebra (z is the pre-activation, ⊙ elementwise, rows of ``a`` flattened to M):
  forward  z = a @ b + bias            (M, N);  y = act(z)
  backward g = dy ⊙ act'(z)             (M, N)   (g = dy without activation)
           dgrad  da    = g @ bᵀ        (M, K)
           wgrad  db    = aᵀ @ g        (K, N)
                  dbias = Σ_rows g      (N,)
What backward keeps: ``a`` and ``b`` always; for gelu / gelu_tanh the pre-activation z (one extra
(M, N) tensor, written by the same epilogue, so nothing is recomputed); for relu the output y, since
relu'(z) = [z > 0] = [y > 0]; nothing more without an activation. Both backends follow this rule,
and both backward GEMMs reuse the forward kernel on transposed views (strides, no copies).

File shape: Triton kernels → launchers → plain-torch reference → autograd Function → ``matmul``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import backend as _backend

ACTIVATIONS = (None, "gelu", "gelu_tanh", "relu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACT_CODE = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Interpreter meta-parameters: small tiles (every program runs in numpy). GROUP_M=2 makes the
# grouped ordering's short last group appear at test sizes.
CPU_META = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}


def _hopper_configs():
    """Tile shapes for sm_90 (H100/H200): large 128×256 tiles with 3–4 pipeline stages and 8 warps
    for big GEMMs, smaller tiles for skinny / small problems."""
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps); 8 configs keep first-call tuning short
        (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8),
        (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 32, 5, 2),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_stages=stages, num_warps=warps)
            for bm, bn, bk, stages, warps in shapes]


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _apply_activation(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:  # gelu (erf)
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACTIVATION == 2:  # gelu, tanh approximation; tanh(u) = 2σ(2u) − 1
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        z = z * tl.sigmoid(2.0 * u)  # 0.5·z·(1 + tanh u) = z·σ(2u)
    elif ACTIVATION == 3:  # relu
        z = tl.maximum(z, 0.0)
    return z


@triton.autotune(configs=_hopper_configs(), key=["M", "N", "K"])
@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, y_ptr, z_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PREACT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of y = act(a @ b + bias); z (same strides as y) gets a @ b + bias
    when SAVE_PREACT. Tiles are visited in groups of GROUP_M rows so consecutive programs share
    columns of b (and rows of a) in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows / columns past the edge wrap around (their results are never stored), so loads need
    # only the K mask; int64 so huge operands (e.g. vocab GEMMs) cannot overflow the offsets
    rows_a = (offs_m % M).to(tl.int64)
    cols_b = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn  # (BK, BN)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if DOT_IN_FP32:  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += bias[None, :]
    out_offsets = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SAVE_PREACT:
        tl.store(z_ptr + out_offsets, acc.to(z_ptr.dtype.element_ty), mask=out_mask)
    acc = _apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + out_offsets, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _activation_grad_kernel(dy_ptr, saved_ptr, g_ptr, n_elements,
                            ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """g = dy ⊙ act'(z) over flat contiguous tensors; ``saved`` is z (gelu*) or y (relu)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(saved_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 1:  # Φ(z) + z·φ(z)
        slope = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACTIVATION == 2:  # ½(1 + t) + ½·z·(1 − t²)·c·(1 + 3·0.044715·z²),  t = tanh(c(z + 0.044715 z³))
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        slope = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    else:  # relu, from the saved output: y > 0 ⇔ z > 0
        slope = tl.where(z > 0.0, 1.0, 0.0)
    tl.store(g_ptr + offs, (dy * slope).to(g_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers

def as_matrix(a: torch.Tensor) -> torch.Tensor:
    """``a (..., K)`` as an (M, K) matrix: a view whenever the leading dims can be merged (any
    2-D tensor, transposed or strided, is passed as is); a copy only when they cannot."""
    if a.dim() == 2:
        return a
    return a.reshape(-1, a.shape[-1])


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"  # like torch.matmul: true fp32 unless TF32 was allowed
    return "tf32"  # fp32 with TF32 allowed; ignored for 16-bit operands


def matmul_triton(a2d, b, bias=None, activation=None, out_dtype=None, save_preact=False):
    """Launch the fused GEMM on (M, K) @ (K, N): returns ``(y, z)`` with z the pre-activation when
    ``save_preact`` (else None). Strides go to the kernel; nothing is made contiguous."""
    (M, K), N = a2d.shape, b.shape[1]
    out_dtype = out_dtype or a2d.dtype
    y = torch.empty((M, N), device=a2d.device, dtype=out_dtype)
    z = torch.empty((M, N), device=a2d.device, dtype=out_dtype) if save_preact else None
    if M == 0 or N == 0:
        return y, z
    on_cpu = not a2d.is_cuda
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _backend.launch(
        _matmul_kernel, grid,
        a2d, b, bias if bias is not None else y, y, z if z is not None else y,
        M, N, K,
        a2d.stride(0), a2d.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, ACTIVATION=_ACT_CODE[activation], SAVE_PREACT=save_preact,
        INPUT_PRECISION=_input_precision(a2d.dtype),
        DOT_IN_FP32=on_cpu and a2d.dtype == torch.bfloat16,
        cpu_meta=CPU_META,
    )
    return y, z


def matmul_triton_forward(a2d, b, bias, activation, out_dtype):
    """``(y, saved)`` with saved = z for gelu*, y for relu, None otherwise (see module docstring)."""
    save_z = activation in ("gelu", "gelu_tanh")
    y, z = matmul_triton(a2d, b, bias, activation, out_dtype, save_preact=save_z)
    return y, (z if save_z else y if activation == "relu" else None)


def activation_grad_triton(dy: torch.Tensor, saved: torch.Tensor, activation: str, dtype) -> torch.Tensor:
    """g = dy ⊙ act'(z) in ``dtype`` (the GEMM operand dtype of the backward)."""
    dy, saved = dy.contiguous(), saved.contiguous()
    g = torch.empty(dy.shape, device=dy.device, dtype=dtype)
    n = dy.numel()
    if n:
        block = 1024 if dy.is_cuda else 256
        _backend.launch(_activation_grad_kernel, (triton.cdiv(n, block),), dy, saved, g, n,
                        ACTIVATION=_ACT_CODE[activation], BLOCK=block)
    return g


# ----------------------------------------------------------------------------- torch paths

def matmul_reference(a, b, bias=None, activation=None, out_dtype=None):
    """The plain composition of torch ops (matmul, then bias, then activation), computed in fp32
    (fp64 for fp64 inputs); autograd gives its gradients. The tests' reference."""
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    z = a.to(compute) @ b.to(compute)
    if bias is not None:
        z = z + bias.to(compute)
    y = _activation_torch(z, activation)
    return y.to(out_dtype or a.dtype)


def _activation_torch(z, activation):
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "relu":
        return F.relu(z)
    return z


def matmul_torch_forward(a2d, b, bias, activation, out_dtype):
    """The fast torch path: one addmm (bias fused), the activation in place where it can be.
    Returns ``(y, saved)`` with saved = z for gelu*, y for relu, None otherwise."""
    compute = torch.promote_types(a2d.dtype, out_dtype)
    a2d, b = a2d.to(compute), b.to(compute)
    z = torch.addmm(bias.to(compute), a2d, b) if bias is not None else torch.mm(a2d, b)
    if activation in ("gelu", "gelu_tanh"):
        y = F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")
        return y.to(out_dtype), z.to(out_dtype)
    if activation == "relu":
        y = z.relu_().to(out_dtype)
        return y, y
    return z.to(out_dtype), None


def activation_grad_torch(dy, saved, activation, dtype):
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        g = torch.ops.aten.gelu_backward(dy, saved.to(dy.dtype), approximate=approximate)
    else:
        g = torch.ops.aten.threshold_backward(dy, saved.to(dy.dtype), 0)
    return g.to(dtype)


def _gemm_torch(x, w, out_dtype):
    compute = torch.promote_types(x.dtype, w.dtype)
    return torch.mm(x.to(compute), w.to(compute)).to(out_dtype)


def _gemm_triton(x, w, out_dtype):
    compute = torch.promote_types(x.dtype, w.dtype)
    return matmul_triton(x.to(compute), w.to(compute), out_dtype=out_dtype)[0]


_PATHS = {  # path: (forward → (y, saved), g = dy ⊙ act'(z), plain GEMM for dgrad / wgrad)
    "triton": (matmul_triton_forward, activation_grad_triton, _gemm_triton),
    "torch": (matmul_torch_forward, activation_grad_torch, _gemm_torch),
}


# ----------------------------------------------------------------------------- autograd

class _FusedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a2d, b, bias, activation, out_dtype, path):
        forward_fn = _PATHS[path][0]
        y, saved = forward_fn(a2d, b, bias, activation, out_dtype)  # (M, N)
        ctx.save_for_backward(a2d, b, saved)
        ctx.activation, ctx.path, ctx.has_bias = activation, path, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        a2d, b, saved = ctx.saved_tensors  # (M, K), (K, N), (M, N) or None
        _, act_grad, gemm = _PATHS[ctx.path]
        g = act_grad(dy, saved, ctx.activation, a2d.dtype) if ctx.activation else dy.to(a2d.dtype)
        da = db = dbias = None
        if ctx.needs_input_grad[0]:
            da = gemm(g, b.t(), a2d.dtype)  # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            if b.t().is_contiguous() and not b.is_contiguous():
                # b is w.t() of a contiguous weight w (N, K): produce dw = gᵀ a (N, K) contiguous
                # and hand back its transpose, so autograd stores w.grad without a layout copy
                db = gemm(g.t(), a2d, b.dtype).t()  # ((N, M) @ (M, K))ᵀ
            else:
                db = gemm(a2d.t(), g, b.dtype)  # (K, M) @ (M, N)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)  # (N,)
        return da, db, dbias, None, None, None


def _validate(a, b, bias, activation, out_dtype):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if a.dim() < 1 or b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"matmul needs a (..., K) and b (K, N), got a {tuple(a.shape)} and b {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b), ("bias", bias)):
        if t is not None and t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype must be one of {DTYPES}, got {t.dtype}")
    if a.dtype != b.dtype:
        raise ValueError(f"a.dtype and b.dtype must match, got {a.dtype} and {b.dtype}")
    if bias is not None and tuple(bias.shape) != (b.shape[1],):
        raise ValueError(f"bias must have shape ({b.shape[1]},), got {tuple(bias.shape)}")
    if out_dtype is not None and out_dtype not in DTYPES:
        raise ValueError(f"out_dtype must be one of {DTYPES}, got {out_dtype}")


def matmul(a, b, bias=None, activation=None, out_dtype=None, *, backend=None):
    """``act(a @ b + bias)`` with fp32 accumulation; ``a (..., K)``, ``b (K, N)``, ``bias (N,)``,
    activation ``None | "gelu" | "gelu_tanh" | "relu"``, output ``(..., N)`` in ``out_dtype``
    (default a's dtype). Differentiable in a, b and bias (see the module docstring)."""
    _validate(a, b, bias, activation, out_dtype)
    path = _backend.resolve(backend, a, b, bias)
    a2d = as_matrix(a)  # (M, K), a view unless a's leading dims cannot merge
    y = _FusedMatmul.apply(a2d, b, bias, activation, out_dtype or a.dtype, path)  # (M, N)
    return y.view(*a.shape[:-1], b.shape[1])  # a view made outside the Function: in-place safe
