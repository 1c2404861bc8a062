"""GEMM + reduce-scatter: the row-parallel output side of sequence-parallel tensor parallelism.

Each of tp ranks holds the full sequence of a hidden shard ``x (s, b, k_local)`` and a weight shard
``w (n, k_local)``; the layer's output is the sum over ranks of their partial products, of which
rank r keeps its sequence chunk:

  forward  y_r = reduce_scatter_s(x @ wᵀ)            (s/tp, b, n)
  backward dgrad  dx = all_gather_s(dy_r) @ w        (s, b, k_local)   = all_gather_matmul of dy
           wgrad  dw = all_gather_s(dy_r)ᵀ · x       (n, k_local)

(The row-parallel bias is added by the caller after the reduction, so there is none here.)

Fused pipeline (``ring_reduce_scatter``): the partial output rows destined for rank r+1, r+2, ...
are computed and sent straight to their owner while the next partial is computed; the local chunk
is computed last; received partials are summed in fp32. Backward is the dual ``ring_all_gather`` of
dy: as each chunk of dy arrives its dgrad rows and its share of the wgrad GEMM are computed.
Below the size threshold: one GEMM then one reduce-scatter (backward: all-gather then two GEMMs).
"""
from __future__ import annotations

import torch

from tpfuse.parallel.comm_options import options_or_default
from tpfuse.parallel.mappings import (all_gather_first_dim, check_divisible, group_size,
                                      reduce_scatter_first_dim)

from . import comm_gemm_common as common
from .wgrad import accumulate_wgrad, weight_grad, wgrad_accumulator, wgrad_for_autograd
from .wgrad_deferral import weight_grads_deferred


class _MatmulReduceScatter(torch.autograd.Function):
    """forward: GEMM then reduce-scatter s; backward: all-gather s then GEMMs (dgrad, wgrad)."""

    @staticmethod
    def forward(ctx, x, w, group, fused, path, options):
        tp = group_size(group)
        rows = x.shape[0] // tp
        if fused:
            y_shard = common.ring_reduce_scatter(                   # (s/tp, b, n)
                lambda dst: common.linear(x[dst * rows:(dst + 1) * rows], w, path)[0], group)
        else:
            y_shard = reduce_scatter_first_dim(common.linear(x, w, path)[0], group, options)
        ctx.save_for_backward(x, w)
        ctx.group, ctx.fused, ctx.path = group, fused, path
        return y_shard

    @staticmethod
    def backward(ctx, dy_shard):                                    # (s/tp, b, n)
        x, w = ctx.saved_tensors
        run = _backward_fused if ctx.fused else _backward_plain
        dx, dw = run(ctx, dy_shard, x, w)
        return dx, dw, None, None, None, None


def _backward_plain(ctx, dy_shard, x, w):
    dy = all_gather_first_dim(dy_shard, ctx.group)                  # (s, b, n)
    dx = common.dgrad(dy, w, ctx.path)                              # (s, b, k_local)
    dw = weight_grad(w, dy, x, backend=ctx.path) if ctx.needs_input_grad[1] else None
    return dx, dw


def _backward_fused(ctx, dy_shard, x, w):
    """As each dy chunk arrives: its dgrad rows written in place into dx, its wgrad share
    accumulated in place (fp32, into main_grad when set)."""
    rows = dy_shard.shape[0]
    want_dw = ctx.needs_input_grad[1]
    defer = want_dw and weight_grads_deferred(w)   # zero-bubble I pass: dw is W's, in one GEMM
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)       # (s, b, k_local)
    dw = wgrad_accumulator(w) if want_dw and not defer else None  # main_grad or fp32 zeros

    def on_chunk(src, dy_chunk):                                    # dy_chunk (s/tp, b, n)
        lo, hi = src * rows, (src + 1) * rows
        common.dgrad(dy_chunk, w, ctx.path, out=dx[lo:hi])
        if dw is not None:
            accumulate_wgrad(dw, dy_chunk, x[lo:hi], backend=ctx.path)

    dy = common.ring_all_gather(dy_shard, ctx.group, on_chunk)     # (s, b, n)
    if defer:
        return dx, weight_grad(w, dy, x, backend=ctx.path)         # queued for W: None
    return dx, (wgrad_for_autograd(w, dw) if want_dw else None)


def matmul_reduce_scatter(x, w, group, *, backend=None, options=None):
    """``reduce_scatter_s(x @ wᵀ)``: x (s, b, k_local), w (n, k_local) → (s/tp, b, n).
    ``backend`` is resolved once for all the op's GEMMs (``tpfuse.kernels.matmul`` paths);
    ``options`` (``parallel.comm_options.CommOptions``, None: the defaults) gives the fused
    pipeline's size threshold and the plain path's reduce-scatter strategy."""
    common.validate_linear("matmul_reduce_scatter", x, w)
    options = options_or_default(options)
    tp = group_size(group)
    check_divisible(x, 0, tp, "matmul_reduce_scatter")
    fused = common.should_fuse(common.gemm_flops(x, w.shape[0]), tp, x.device.type, options)
    return _MatmulReduceScatter.apply(x, w, group, fused, common.gemm_path(backend, x, w), options)


def matmul_reduce_scatter_reference(x, w, group):
    """The unfused composition: one GEMM, then reduce-scatter along s (autograd: all-gather)."""
    from tpfuse.kernels.matmul import matmul
    from tpfuse.parallel.mappings import reduce_scatter_to_sequence_parallel_region
    return reduce_scatter_to_sequence_parallel_region(matmul(x, w.t()), group)
