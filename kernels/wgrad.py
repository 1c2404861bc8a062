"""Weight gradients accumulated in fp32 straight into ``param.main_grad`` (gradient-accumulation
fusion), and the linear op whose backward uses it.

A linear layer ``y = x @ wᵀ`` (x ``(..., k)``, w ``(n, k)``, g = dL/dy ``(..., n)``) has the weight
gradient, summed over every token row m of every micro-batch::

    dw = Σ_micro-batches  gᵀ · x           (n, k)       gᵀ (n, M) · x (M, k)

When the trainer has given ``w`` a persistent gradient buffer ``w.main_grad`` (fp32, or the
reduced-gradient dtype), each micro-batch's GEMM accumulates into it in its epilogue::

    main_grad[n, k] ← main_grad[n, k] + Σ_m g[m, n] · x[m, k]      (fp32 accumulator)

so no low-precision ``dw`` tensor is ever formed, and autograd is handed ``None`` for ``w``: its
``AccumulateGrad`` node still runs once per backward (with nothing to add), which is what the
data-parallel hooks on that node (``training/data_parallel.py``) count. Without ``main_grad`` the
same GEMM runs into a fresh fp32 tensor that autograd receives cast to w's dtype.

``weight_grad(weight, grad_output, input)`` is the one entry point of every TP linear layer (the
plain path below and the ring comm-GEMMs of ``ag_matmul.py`` / ``matmul_rs.py``): a function of
explicit tensors, so a pipeline schedule may run it later (zero-bubble "W") instead of inside
backward. A deferred GEMM counts in ``weight.deferred_wgrads`` until W has run it, so the
data-parallel hooks do not take the weight's gradient for complete before then. The ring GEMMs, which produce ``dw`` chunk by chunk, use its three steps:
``wgrad_accumulator`` → ``accumulate_wgrad`` per chunk → ``wgrad_for_autograd``.

File shape: Triton kernel → launcher → torch path and fp64 reference → the helpers → autograd
Function of the linear op.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import backend as _backend
from .comm_gemm_common import validate_linear
from .matmul import (PATHS, _input_precision, activation_grad_torch, activation_grad_triton,
                     as_matrix, cast, matmul_torch_forward, matmul_triton_forward)
from .matmul_kernels import dot_over_reduction, even_tile_rules, even_tiles, tile_indices
from .wgrad_deferral import (add_deferred_grad, defer_grad_of, deferred_grad_done,
                              weight_grads_deferred)

CPU_META = {"BLOCK_N": 16, "BLOCK_K": 32, "BLOCK_M": 32}


def _hopper_configs():
    """(BLOCK_N, BLOCK_K, BLOCK_M, stages, warps) for sm_90: the reduction dim is the token count M
    (large), the output (n, k) is a weight (large), so big square-ish tiles with deep pipelines."""
    # pruned by kernels/sm90_report.py: with the fp32 main_grad tile loaded in the epilogue,
    # 128×256 / 256×128 at 8 warps and 128×128 at 4 warps spill (192-392 bytes), so cannot win
    shapes = [(128, 128, 64, 4, 8), (64, 128, 64, 4, 4), (64, 64, 32, 5, 2)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_M": bm}, num_stages=s,
                          num_warps=w) for bn, bk, bm, s, w in shapes]


# ----------------------------------------------------------------------------- Triton kernel

# restore_value: autotuning runs every config on the real arguments; the accumulator must not
# collect those trial sums
@triton.autotune(configs=_hopper_configs(), key=["N", "K", "M"], restore_value=["out_ptr"])
@triton.heuristics(even_tile_rules("N", "K"))
@triton.jit
def _wgrad_accumulate_kernel(
    g_ptr, x_ptr, out_ptr,
    N, K, M,
    stride_gm, stride_gn, stride_xm, stride_xk, stride_on, stride_ok,
    INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One (BLOCK_N, BLOCK_K) tile of out += gᵀ · x: gᵀ is read through g's strides (no copy),
    the products are summed over M in fp32, and the epilogue adds the tile already in ``out``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    cols_g = tile_indices(offs_n, N, BLOCK_N, EVEN_N).to(tl.int64)   # past the edge: wrapped, never stored
    cols_x = tile_indices(offs_k, K, BLOCK_K, EVEN_K).to(tl.int64)
    gt_ptrs = g_ptr + offs_m[None, :].to(tl.int64) * stride_gm + cols_g[:, None] * stride_gn
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + cols_x[None, :] * stride_xk
    acc = dot_over_reduction(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), gt_ptrs, x_ptrs, M,
                             stride_gm, stride_xm, BLOCK_M, INPUT_PRECISION, DOT_IN_FP32)  # (BN, BK)
    out_offsets = offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :] * stride_ok
    out_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    previous = tl.load(out_ptr + out_offsets, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, (previous + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------- launcher

def wgrad_accumulate_triton(out: torch.Tensor, g2d: torch.Tensor, x2d: torch.Tensor) -> None:
    """``out (n, k) += g2dᵀ (n, M) · x2d (M, k)`` with one kernel; strides are passed, nothing
    is copied."""
    (M, N), K = g2d.shape, x2d.shape[1]
    if N == 0 or K == 0 or M == 0:
        return
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K, meta["BLOCK_K"]))  # noqa: E731
    _backend.launch(
        _wgrad_accumulate_kernel, grid, g2d, x2d, out, N, K, M,
        g2d.stride(0), g2d.stride(1), x2d.stride(0), x2d.stride(1), out.stride(0), out.stride(1),
        INPUT_PRECISION=_input_precision(g2d.dtype),
        DOT_IN_FP32=not g2d.is_cuda and g2d.dtype != torch.float32,
        cpu_meta=dict(CPU_META, **even_tiles(CPU_META, N=N, K=K)))


# ----------------------------------------------------------------------------- torch paths

def wgrad_accumulate_torch(out: torch.Tensor, g2d: torch.Tensor, x2d: torch.Tensor) -> None:
    """The torch path: one ``addmm_`` into an fp32 ``out`` (16-bit operands are upcast first, so
    the products are summed in fp32 as the kernel does); a 16-bit ``out`` gets the fp32 product
    added with one rounding."""
    g2d, x2d = cast(g2d, torch.float32), cast(x2d, torch.float32)
    if out.dtype == torch.float32:
        out.addmm_(g2d.t(), x2d)
    else:
        out.add_(torch.mm(g2d.t(), x2d))


def wgrad_reference(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """gᵀ · x over all leading dims in float64: the tests' reference."""
    return g.reshape(-1, g.shape[-1]).double().t() @ x.reshape(-1, x.shape[-1]).double()


_ACCUMULATE = {"triton": wgrad_accumulate_triton, "torch": wgrad_accumulate_torch}


# ----------------------------------------------------------------------------- the helpers

def accumulate_wgrad(out: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor, *,
                     backend=None) -> None:
    """``out += grad_outputᵀ · input`` summed over all leading dims: grad_output ``(..., n)``,
    input ``(..., k)``, out ``(n, k)`` (fp32, or a 16-bit reduced-gradient dtype)."""
    g2d, x2d = as_matrix(grad_output), as_matrix(input)
    if g2d.shape[0] != x2d.shape[0] or out.shape != (g2d.shape[1], x2d.shape[1]):
        raise ValueError(f"accumulate_wgrad: grad_output {tuple(grad_output.shape)} and input "
                         f"{tuple(input.shape)} do not give out's shape {tuple(out.shape)}")
    path = _backend.resolve(backend, out, g2d, x2d)
    _ACCUMULATE[path](out, g2d, x2d)


def new_wgrad(grad_output: torch.Tensor, input: torch.Tensor, *, backend=None) -> torch.Tensor:
    """``grad_outputᵀ · input`` summed over all leading dims, as a new fp32 ``(n, k)`` tensor (no
    ``main_grad`` to accumulate into): the torch path's one ``mm`` writes it (a zero fill and an
    accumulating GEMM would touch it twice), the kernel accumulates into fresh zeros."""
    g2d, x2d = as_matrix(grad_output), as_matrix(input)                  # (M, n), (M, k)
    if g2d.shape[0] != x2d.shape[0]:
        raise ValueError(f"new_wgrad: grad_output {tuple(grad_output.shape)} and input "
                         f"{tuple(input.shape)} differ in their leading dims")
    if _backend.resolve(backend, g2d, x2d) == "torch":
        return torch.mm(cast(g2d, torch.float32).t(), cast(x2d, torch.float32))
    out = torch.zeros((g2d.shape[1], x2d.shape[1]), dtype=torch.float32, device=g2d.device)
    accumulate_wgrad(out, g2d, x2d, backend="triton")
    return out


def wgrad_accumulator(weight: torch.Tensor) -> torch.Tensor:
    """Where ``weight``'s gradient contributions go: its persistent ``main_grad`` buffer when the
    trainer set one, else a fresh fp32 zero tensor of weight's shape."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        return main_grad
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def wgrad_for_autograd(weight: torch.Tensor, accumulator: torch.Tensor):
    """What the autograd Function returns for ``weight``: None when the gradient went into
    ``weight.main_grad`` (the data-parallel hooks still fire), else the fp32 sum in w's dtype."""
    if accumulator is getattr(weight, "main_grad", None):
        return None
    return accumulator.to(weight.dtype)


def weight_grad(weight: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor, *,
                backend=None):
    """The weight gradient of ``y = input @ weightᵀ``: ``grad_outputᵀ · input`` accumulated in
    fp32 into ``weight.main_grad`` (returns None), or returned in weight's dtype when there is
    none. grad_output ``(..., n)``, input ``(..., k)``, weight ``(n, k)``.

    Inside a zero-bubble I pass (``wgrad_deferral``) the GEMM is queued for the W action instead
    and autograd gets None; W then accumulates into ``main_grad``, or into ``weight.grad``."""
    if weight_grads_deferred(weight):
        defer_grad_of(weight, functools.partial(deferred_weight_grad, weight, grad_output, input,
                                                backend))
        return None
    return _weight_grad_now(weight, grad_output, input, backend)


def _weight_grad_now(weight, grad_output, input, backend):
    """The GEMM of ``weight_grad``: accumulated into ``main_grad`` (None), else a new ``(n, k)``
    tensor in weight's dtype."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        accumulate_wgrad(main_grad, grad_output, input, backend=backend)
        return None
    return cast(new_wgrad(grad_output, input, backend=backend), weight.dtype)


def deferred_weight_grad(weight, grad_output, input, backend=None) -> None:
    """The W half of ``weight_grad``: autograd got None in the I pass, so the GEMM accumulates
    into ``main_grad``, else its result is added to ``weight.grad`` (created when absent); then
    ``deferred_grad_done`` (the data-parallel buffers learn when the contribution is complete)."""
    dw = _weight_grad_now(weight, grad_output, input, backend)       # None: in main_grad
    if dw is not None:
        add_deferred_grad(weight, dw)
    deferred_grad_done(weight)


# ----------------------------------------------------------------------------- the linear op

_FORWARD = {"triton": matmul_triton_forward, "torch": matmul_torch_forward}   # → (y, saved)
_ACTIVATION_GRAD = {"triton": activation_grad_triton, "torch": activation_grad_torch}


class _LinearWithGradAccumulation(torch.autograd.Function):
    """forward: ``act(x @ wᵀ + bias)`` by matmul's fused-epilogue paths; backward: dgrad
    ``g @ w`` by ``matmul``, wgrad by ``weight_grad`` (into main_grad), dbias = Σ_rows g."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, activation, path):
        y, saved = _FORWARD[path](x2d, weight.t(), bias, activation, x2d.dtype)  # (M, n)
        ctx.save_for_backward(x2d, weight, saved)
        ctx.activation, ctx.path = activation, path
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):                                                   # (M, n)
        x2d, weight, saved = ctx.saved_tensors                               # (M, k), (n, k)
        g = cast(dy, x2d.dtype)
        if ctx.activation:                                                   # dy ⊙ act'(z)
            g = _ACTIVATION_GRAD[ctx.path](dy, saved, ctx.activation, x2d.dtype)
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            dx = PATHS[ctx.path][2](g, weight, x2d.dtype)                    # (M, n) @ (n, k)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(weight, g, x2d, backend=ctx.path)               # (n, k) or None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            dbias = cast(g.sum(0, dtype=torch.float32), ctx.bias_dtype)      # (n,)
        return dx, dw, dbias, None, None


def linear_with_grad_accumulation(x, weight, bias=None, activation=None, *, backend=None):
    """``act(x @ weightᵀ + bias)``: x ``(..., k)``, weight ``(n, k)``, bias ``(n,)`` → ``(..., n)``
    in x's dtype, as ``matmul(x, weight.t(), bias, activation)``; the weight gradient goes
    through ``weight_grad`` (fp32 into ``weight.main_grad`` when the trainer set one)."""
    validate_linear("linear_with_grad_accumulation", x, weight, bias, activation)
    path = _backend.resolve(backend, x, weight, bias)
    x2d = as_matrix(x)                                                    # (M, k)
    y = _LinearWithGradAccumulation.apply(x2d, weight, bias, activation, path)
    return y.view(*x.shape[:-1], weight.shape[0])
