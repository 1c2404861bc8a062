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

import dataclasses

import torch
import torch.nn.functional as F
import triton

from . import backend as _backend
from . import matmul_kernels as _kernels

ACTIVATIONS = (None, "gelu", "gelu_tanh", "relu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNELS = ("auto", "tma", "pointer")
_ACT_CODE = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}

# Interpreter meta-parameters: small tiles (every program runs in numpy). GROUP_M=2 makes the
# grouped ordering's short last group appear at test sizes; 3 persistent programs each walk
# several tiles; the TMA kernel runs its split epilogue, the pointer kernel the whole tile.
CPU_META = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
CPU_NUM_SMS = 3


@dataclasses.dataclass(frozen=True)
class MatmulOptions:
    """How the Triton GEMM chooses its kernel and tile configuration.

    ``kernel``: ``"auto"`` (the persistent TMA kernel on sm_90+ for 16-bit operands whose strides
    a TMA descriptor can describe, else the pointer kernel), ``"tma"`` or ``"pointer"`` (forced;
    both also run under the interpreter).
    ``autotune``: False (default): the tile comes from ``pinned_config`` — a pure function of the
    problem, so every rank of a job runs the same config, with no timing and no collective. True:
    Triton's autotuner times every config once per key (sizes, operand layouts, epilogue, dtypes);
    ranks may then settle on different tiles, so it is meant for tuning on one GPU.
    ``config``: one ``triton.Config`` to run (benchmarks, tests); overrides both.
    """
    kernel: str = "auto"
    autotune: bool = False
    config: triton.Config | None = None

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"MatmulOptions.kernel must be one of {KERNELS}, got {self.kernel!r}")


DEFAULT_OPTIONS = MatmulOptions()


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


def _tma_layout(t2d: torch.Tensor):
    """True (row-major) / False (column-major, a transpose) when a TMA descriptor can read the
    (R, C) matrix t2d — one unit stride, the other a multiple of 16 bytes, 16-byte aligned base —
    else None."""
    if t2d.data_ptr() % 16:
        return None
    unit_bytes = 16 // t2d.element_size()
    if t2d.stride(1) == 1 and t2d.stride(0) % unit_bytes == 0:
        return True
    if t2d.stride(0) == 1 and t2d.stride(1) % unit_bytes == 0:
        return False
    return None


def _num_sms(device) -> int:
    if device.type != "cuda":
        return CPU_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def pinned_config(M: int, N: int, dtype: torch.dtype, kernel: str, num_sms: int) -> triton.Config:
    """The largest tile (listed largest first) that still gives every SM at least one output
    tile; the smallest one for small problems. fp32 operands take 32-deep K tiles (64-deep
    ones at 3+ stages do not fit in 227 KB of shared memory)."""
    if kernel == "tma":
        shapes = _kernels.TMA_SHAPES
    else:
        shapes = _kernels.POINTER_SHAPES if dtype != torch.float32 else _kernels.POINTER_SHAPES_FP32
    for bm, bn, bk, stages, warps in shapes:
        if triton.cdiv(M, bm) * triton.cdiv(N, bn) >= num_sms:
            break
    return _kernels.make_configs([(bm, bn, bk, stages, warps)])[0]


def _choose_kernel(a2d, b, options) -> tuple[str, bool | None, bool | None]:
    """(kernel, a row-major?, b row-major?) for this call."""
    a_row, b_row = _tma_layout(a2d), _tma_layout(b)
    tma_ok = a2d.dtype != torch.float32 and a_row is not None and b_row is not None
    if options.kernel == "auto":
        on_hopper = a2d.is_cuda and torch.cuda.get_device_capability(a2d.device)[0] >= 9
        use_tma = tma_ok and on_hopper
    else:
        use_tma = options.kernel == "tma"
        if use_tma and not tma_ok:
            raise ValueError("MatmulOptions(kernel='tma') needs 16-bit operands with one unit stride "
                             f"and 16-byte aligned strides, got a {a2d.dtype} {tuple(a2d.stride())} "
                             f"and b {tuple(b.stride())}")
    return ("tma" if use_tma else "pointer"), a_row, b_row


def _launch_tma(a2d, b, bias, y, z, epilogue, a_row, b_row, options):
    from triton.tools.tensor_descriptor import TensorDescriptor

    (M, K), N = a2d.shape, b.shape[1]
    on_cpu, num_sms = not a2d.is_cuda, _num_sms(a2d.device)
    if on_cpu or not options.autotune:
        config = options.config or pinned_config(M, N, a2d.dtype, "tma", num_sms)
        meta = dict(config.kwargs, EPILOGUE_SPLIT=config.kwargs["BLOCK_N"] >= 256)
        launch_opts = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        if on_cpu:
            meta, launch_opts = dict(CPU_META, EPILOGUE_SPLIT=True), {}
        bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
        kernel = _kernels._matmul_tma_kernel
    else:  # block shapes set per config by the autotuner's pre_hook
        bm = bn = bk = 16
        meta, launch_opts, kernel = {}, {}, _kernels.tma_kernel_autotuned
    a_desc = (TensorDescriptor.from_tensor(a2d, [bm, bk]) if a_row
              else TensorDescriptor.from_tensor(a2d.t(), [bk, bm]))       # storage (K, M)
    b_desc = (TensorDescriptor.from_tensor(b, [bk, bn]) if b_row
              else TensorDescriptor.from_tensor(b.t(), [bn, bk]))         # storage (N, K)

    def grid(m):
        return (min(num_sms, triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"])),)

    _backend.launch(kernel, grid, a_desc, b_desc, bias, y, z, M, N, K, y.stride(0), y.stride(1),
                    A_ROW_MAJOR=a_row, B_ROW_MAJOR=b_row, **epilogue,
                    DOT_IN_FP32=on_cpu and a2d.dtype != torch.float32, NUM_SMS=num_sms,
                    **meta, **launch_opts)


def _launch_pointer(a2d, b, bias, y, z, epilogue, a_row, b_row, options):
    (M, K), N = a2d.shape, b.shape[1]
    on_cpu = not a2d.is_cuda
    common = dict(A_ROW_MAJOR=bool(a_row), B_ROW_MAJOR=bool(b_row), **epilogue,
                  INPUT_PRECISION=_input_precision(a2d.dtype),
                  DOT_IN_FP32=on_cpu and a2d.dtype != torch.float32)
    grid = lambda m: (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)  # noqa: E731
    args = (a2d, b, bias, y, z, M, N, K, a2d.stride(0), a2d.stride(1), b.stride(0), b.stride(1),
            y.stride(0), y.stride(1))
    if options.autotune and not on_cpu and options.config is None:
        return _backend.launch(_kernels.matmul_kernel_autotuned, grid, *args, **common)
    config = options.config or pinned_config(M, N, a2d.dtype, "pointer", _num_sms(a2d.device))
    meta = dict(CPU_META) if on_cpu else dict(config.kwargs)
    launch_opts = {} if on_cpu else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    meta.update(EVEN_M=M % meta["BLOCK_M"] == 0, EVEN_N=N % meta["BLOCK_N"] == 0,
                EPILOGUE_SPLIT=meta["BLOCK_N"] >= 256)
    _backend.launch(_kernels._matmul_kernel, grid, *args, **common, **meta, **launch_opts)


def matmul_triton(a2d, b, bias=None, activation=None, out_dtype=None, save_preact=False, *,
                  out=None, preact_out=None, options=None):
    """Launch the fused GEMM on (M, K) @ (K, N): returns ``(y, z)`` with z the pre-activation when
    ``save_preact`` (else None). Strides go to the kernel; nothing is made contiguous. ``out`` /
    ``preact_out``: (M, N) tensors (any strides, e.g. row slices of a larger output) to write
    into instead of allocating."""
    (M, K), N = a2d.shape, b.shape[1]
    out_dtype = out_dtype or a2d.dtype
    y = out if out is not None else torch.empty((M, N), device=a2d.device, dtype=out_dtype)
    z = None
    if save_preact:
        z = preact_out if preact_out is not None else torch.empty((M, N), device=a2d.device,
                                                                  dtype=out_dtype)
    if M == 0 or N == 0:
        return y, z
    if K == 0:  # the kernels' descriptors need K > 0: act(0 + bias)
        zero = torch.zeros((M, N), device=a2d.device, dtype=torch.float32)
        z_full = zero + bias.float() if bias is not None else zero
        if z is not None:
            z.copy_(z_full)
        y.copy_(_activation_torch(z_full, activation))
        return y, z
    options = options or DEFAULT_OPTIONS
    kernel, a_row, b_row = _choose_kernel(a2d, b, options)
    epilogue = dict(HAS_BIAS=bias is not None, ACTIVATION=_ACT_CODE[activation],
                    SAVE_PREACT=save_preact)
    launcher = _launch_tma if kernel == "tma" else _launch_pointer
    launcher(a2d, b, bias if bias is not None else y, y, z if z is not None else y, epilogue,
             a_row, b_row, options)
    return y, z


def matmul_triton_forward(a2d, b, bias, activation, out_dtype, *, out=None, preact_out=None,
                          options=None):
    """``(y, saved)`` with saved = z for gelu*, y for relu, None otherwise (see module docstring)."""
    save_z = activation in ("gelu", "gelu_tanh")
    y, z = matmul_triton(a2d, b, bias, activation, out_dtype, save_preact=save_z, out=out,
                         preact_out=preact_out, options=options)
    return y, (z if save_z else y if activation == "relu" else None)


def activation_grad_triton(dy: torch.Tensor, saved: torch.Tensor, activation: str, dtype) -> torch.Tensor:
    """g = dy ⊙ act'(z) in ``dtype`` (the GEMM operand dtype of the backward)."""
    dy, saved = dy.contiguous(), saved.contiguous()
    g = torch.empty(dy.shape, device=dy.device, dtype=dtype)
    n = dy.numel()
    if n:
        block = 1024 if dy.is_cuda else 256
        _backend.launch(_kernels._activation_grad_kernel, (triton.cdiv(n, block),), dy, saved, g, n,
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


def matmul_torch_forward(a2d, b, bias, activation, out_dtype, *, out=None, preact_out=None,
                         options=None):
    """The fast torch path: one addmm (bias fused), the activation in place where it can be.
    Returns ``(y, saved)`` with saved = z for gelu*, y for relu, None otherwise. ``out`` /
    ``preact_out`` (optional) receive y / z (the GEMM writes into them when the dtypes match)."""
    del options  # the torch path has no tiles to choose
    compute = promoted(a2d.dtype, out_dtype)
    a2d, b = cast(a2d, compute), cast(b, compute)
    gelu = activation in ("gelu", "gelu_tanh")
    target = preact_out if gelu else out
    direct = target is not None and target.dtype == compute
    kwargs = {"out": target} if direct else {}
    z = torch.addmm(cast(bias, compute), a2d, b, **kwargs) if bias is not None else torch.mm(a2d, b, **kwargs)
    if gelu:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        if out is not None and out.dtype == compute:
            y = torch.ops.aten.gelu.out(z, approximate=approximate, out=out)
        else:
            y = _into(out, F.gelu(z, approximate=approximate))
        return y, _into(preact_out, z) if not direct else z
    if activation == "relu":
        z = z.relu_()
    y = z if direct else _into(out, cast(z, out_dtype))
    return y, (y if activation == "relu" else None)


def _into(out, value):
    """``value`` written into ``out`` (converted to its dtype), or value itself when no out."""
    return value if out is None else out.copy_(value)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when t has that dtype already (the common case: a call
    into ATen costs more than the GEMM's bookkeeping on small layers)."""
    return t if t.dtype == dtype else t.to(dtype)


def promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if a == b else torch.promote_types(a, b)


def activation_grad_torch(dy, saved, activation, dtype):
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        g = torch.ops.aten.gelu_backward(dy, cast(saved, dy.dtype), approximate=approximate)
    else:
        g = torch.ops.aten.threshold_backward(dy, cast(saved, dy.dtype), 0)
    return cast(g, dtype)


def _gemm_torch(x, w, out_dtype, out=None, options=None):
    compute = promoted(x.dtype, w.dtype)
    x, w = cast(x, compute), cast(w, compute)
    if out is not None and out.dtype == compute:
        return torch.mm(x, w, out=out)
    return _into(out, cast(torch.mm(x, w), out_dtype))


def _gemm_triton(x, w, out_dtype, out=None, options=None):
    compute = torch.promote_types(x.dtype, w.dtype)
    return matmul_triton(x.to(compute), w.to(compute), out_dtype=out_dtype, out=out,
                         options=options)[0]


# path: (forward → (y, saved), g = dy ⊙ act'(z), plain GEMM for dgrad / wgrad); the fused
# comm-GEMMs call these directly (no nested autograd Function, no re-validation per chunk)
PATHS = {
    "triton": (matmul_triton_forward, activation_grad_triton, _gemm_triton),
    "torch": (matmul_torch_forward, activation_grad_torch, _gemm_torch),
}


# ----------------------------------------------------------------------------- autograd

class _FusedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a2d, b, bias, activation, out_dtype, path, options):
        forward_fn = PATHS[path][0]
        y, saved = forward_fn(a2d, b, bias, activation, out_dtype, options=options)  # (M, N)
        ctx.save_for_backward(a2d, b, saved)
        ctx.activation, ctx.path, ctx.has_bias = activation, path, bias is not None
        ctx.options = options
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        a2d, b, saved = ctx.saved_tensors  # (M, K), (K, N), (M, N) or None
        _, act_grad, gemm = PATHS[ctx.path]
        opts = ctx.options
        g = act_grad(dy, saved, ctx.activation, a2d.dtype) if ctx.activation else dy.to(a2d.dtype)
        da = db = dbias = None
        if ctx.needs_input_grad[0]:
            da = gemm(g, b.t(), a2d.dtype, options=opts)  # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            if b.t().is_contiguous() and not b.is_contiguous():
                # b is w.t() of a contiguous weight w (N, K): produce dw = gᵀ a (N, K) contiguous
                # and hand back its transpose, so autograd stores w.grad without a layout copy
                db = gemm(g.t(), a2d, b.dtype, options=opts).t()  # ((N, M) @ (M, K))ᵀ
            else:
                db = gemm(a2d.t(), g, b.dtype, options=opts)  # (K, M) @ (M, N)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)  # (N,)
        return da, db, dbias, None, None, None, None


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


def matmul(a, b, bias=None, activation=None, out_dtype=None, *, backend=None, options=None):
    """``act(a @ b + bias)`` with fp32 accumulation; ``a (..., K)``, ``b (K, N)``, ``bias (N,)``,
    activation ``None | "gelu" | "gelu_tanh" | "relu"``, output ``(..., N)`` in ``out_dtype``
    (default a's dtype). Differentiable in a, b and bias (see the module docstring).
    ``options``: a ``MatmulOptions`` (kernel and tile choice of the Triton path)."""
    _validate(a, b, bias, activation, out_dtype)
    if options is not None and not isinstance(options, MatmulOptions):
        raise ValueError(f"options must be a MatmulOptions, got {type(options).__name__}")
    path = _backend.resolve(backend, a, b, bias)
    a2d = as_matrix(a)  # (M, K), a view unless a's leading dims cannot merge
    y = _FusedMatmul.apply(a2d, b, bias, activation, out_dtype or a.dtype, path, options)  # (M, N)
    return y.view(*a.shape[:-1], b.shape[1])  # a view made outside the Function: in-place safe
