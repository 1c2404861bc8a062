"""All-gather + GEMM: the column-parallel input side of sequence-parallel tensor parallelism.

Each of tp ranks holds a sequence shard ``x_r (s/tp, b, h)`` and a weight shard ``w (n/tp, h)``
(n_local = n/tp output features). With ``x = cat_r x_r`` gathered along the sequence (dim 0):

  forward  z = x @ wᵀ + bias                         (s, b, n_local);   y = act(z)
  backward g = dy ⊙ act'(z)                          (s, b, n_local)
           dgrad  dx_r  = reduce_scatter_s(g @ w)    (s/tp, b, h)       = matmul_reduce_scatter
           wgrad  dw    = gᵀ · x                     (n_local, h)       needs the gathered x
                  dbias = Σ_{s,b} g                  (n_local,)

Fused pipeline (``ring_all_gather``): the gather is split into tp chunks passed around a ring; the
GEMM of the local chunk runs first, then the chunk from rank r+1, r+2, ... each as soon as it is
present while the next is in flight. Backward runs the dual (``ring_reduce_scatter`` of ``g @ w``,
partial for rank r+1, r+2, ... sent while the next is computed) with the wgrad GEMM of each chunk
interleaved, so both GEMMs hide the transfers; each chunk GEMM writes its rows of the output in
place and the weight gradient accumulates in place (fp32, into ``main_grad`` when set). If the
gathered x was not kept (``keep_gathered=False``: only the shard is saved) its shards travel in the
dgrad ring itself, each step carrying a dgrad partial and an x shard between the same two peers,
and each shard's wgrad share runs as soon as it has arrived.

Below the size threshold (``comm_gemm_common.should_fuse``) the same algebra runs as one all-gather
then one GEMM (backward: one GEMM then one reduce-scatter). If the caller uses the returned gathered
x elsewhere, its gradient is added to ``g @ w`` before the reduce-scatter.

On CUDA with ``options.symm_mem`` (``CommOptions(symm_mem=True)``) the forward runs the symmetric-memory
kernel of ``symm_mem_ag_matmul.py`` instead (peer shards staged by the copy engine with per-shard
signals while the GEMM runs; only when every rank of the group is on this node).
"""
from __future__ import annotations

import torch

from tpfuse.parallel.comm_options import options_or_default
from tpfuse.parallel.mappings import (all_gather_first_dim, group_rank, group_size,
                                      reduce_scatter_first_dim)

from . import comm_gemm_common as common
from .wgrad import accumulate_wgrad, weight_grad, wgrad_accumulator, wgrad_for_autograd
from .wgrad_deferral import weight_grads_deferred

def _symm_mem_applies(x_shard, group, options) -> bool:
    if not (options.symm_mem and x_shard.is_cuda):
        return False
    from . import symm_mem_ag_matmul
    return symm_mem_ag_matmul.available(group)


def _forward_chunks(x_shard, w, bias, group, activation, fused, path, options):
    """→ (y, saved, x_full): the gathered input and act(x_full @ wᵀ + bias), chunk by chunk, each
    chunk's GEMM writing its rows of y (and of z for gelu) in place."""
    if not fused:
        x_full = all_gather_first_dim(x_shard, group)                 # (s, b, h)
        y, saved = common.linear(x_full, w, path, bias, activation)
        return y, saved, x_full
    if _symm_mem_applies(x_shard, group, options):
        from . import symm_mem_ag_matmul
        return symm_mem_ag_matmul.forward(x_shard, w, bias, group, activation, save_preact=True)
    rows = x_shard.shape[0]
    out_shape = (rows * group_size(group),) + tuple(x_shard.shape[1:-1]) + (w.shape[0],)
    y = torch.empty(out_shape, dtype=x_shard.dtype, device=x_shard.device)  # (s, b, n_local)
    z = torch.empty_like(y) if activation in ("gelu", "gelu_tanh") else None  # (s, b, n_local)

    def on_chunk(src, x_chunk):                                       # x_chunk (s/tp, b, h)
        chunk = slice(src * rows, (src + 1) * rows)
        common.linear(x_chunk, w, path, bias, activation, out=y[chunk],
                      preact_out=None if z is None else z[chunk])

    x_full = common.ring_all_gather(x_shard, group, on_chunk)
    return y, (z if z is not None else y if activation == "relu" else None), x_full


class _AllGatherMatmul(torch.autograd.Function):
    """forward: all-gather s then GEMM (+bias, act); backward: GEMM then reduce-scatter s (dgrad),
    gathered-x GEMM (wgrad, into main_grad when set), row sum (dbias)."""

    @staticmethod
    def forward(ctx, x_shard, w, bias, group, activation, fused, keep_gathered, path, options):
        y, saved, x_full = _forward_chunks(x_shard, w, bias, group, activation, fused, path,
                                           options)
        ctx.save_for_backward(x_full if keep_gathered else x_shard, w, saved)
        ctx.group, ctx.activation, ctx.fused, ctx.path = group, activation, fused, path
        ctx.keep_gathered, ctx.has_bias, ctx.options = keep_gathered, bias is not None, options
        return y, x_full

    @staticmethod
    def backward(ctx, dy, dx_full_extra):
        kept, w, saved = ctx.saved_tensors
        g = common.activation_grad(dy, saved, ctx.activation, ctx.path)  # (s, b, n_local)
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = g.reshape(-1, g.shape[-1]).sum(0, dtype=torch.float32).to(w.dtype)
        run = _backward_fused if ctx.fused else _backward_plain
        dx_shard, dw = run(ctx, g, kept, w, dx_full_extra)
        return dx_shard, dw, dbias, None, None, None, None, None, None


def _dgrad_rows(g, w, extra, lo, hi, path):
    """Rows [lo, hi) of g @ w (+ the gathered-x gradient from other users): (rows, b, h)."""
    part = common.dgrad(g[lo:hi], w, path)
    return part if extra is None else part.add_(extra[lo:hi])


def _backward_plain(ctx, g, kept, w, extra):
    """One GEMM then one reduce-scatter; a shard-only forward re-gathers x asynchronously while
    the dgrad GEMM and its reduce-scatter run, then the wgrad GEMM."""
    group, want_dw = ctx.group, ctx.needs_input_grad[1]
    regather = None
    if want_dw and not ctx.keep_gathered:
        regather = all_gather_first_dim(kept, group, async_op=True)  # (x_full, work)
    dx_full = _dgrad_rows(g, w, extra, 0, g.shape[0], ctx.path)      # (s, b, h)
    dx_shard = reduce_scatter_first_dim(dx_full, group, ctx.options)  # (s/tp, b, h)
    dw = None
    if want_dw:
        x_full = kept
        if regather is not None:
            x_full, work = regather
            common._wait([work])
        dw = weight_grad(w, g, x_full, backend=ctx.path)
    return dx_shard, dw


def _backward_fused(ctx, g, kept, w, extra):
    """The dgrad ring (partials for r+1, r+2, ... sent while the next is computed); the weight
    gradient accumulates in place, chunk by chunk: from the kept gathered x, or — shard-only
    forward — from each peer's shard as it arrives in the same ring (re-gathered, never kept)."""
    group, path = ctx.group, ctx.path
    tp = group_size(group)
    rows = g.shape[0] // tp
    want_dw = ctx.needs_input_grad[1]
    defer = want_dw and weight_grads_deferred(w)   # zero-bubble I pass: dw is W's, in one GEMM
    dw = wgrad_accumulator(w) if want_dw and not defer else None  # main_grad or fp32 zeros
    x_full = kept if defer and ctx.keep_gathered else None
    if defer and not ctx.keep_gathered:                             # W needs the gathered x
        x_full = torch.empty(g.shape[:-1] + kept.shape[-1:], dtype=kept.dtype,
                             device=kept.device)                    # (s, b, h)

    def partial_for(dst):                                           # dgrad rows of rank dst
        return _dgrad_rows(g, w, extra, dst * rows, (dst + 1) * rows, path)

    def wgrad_chunk(src, x_chunk):                                  # x_chunk (s/tp, b, h)
        if defer:
            x_full[src * rows:(src + 1) * rows] = x_chunk
        else:
            accumulate_wgrad(dw, g[src * rows:(src + 1) * rows], x_chunk, backend=path)

    if want_dw and ctx.keep_gathered and not defer:
        def after_partial(dst):                 # this chunk's share while its partial flies
            wgrad_chunk(dst, kept[dst * rows:(dst + 1) * rows])
        dx_shard = common.ring_reduce_scatter(partial_for, group, after_partial)
    elif want_dw and not ctx.keep_gathered:
        dx_shard = common.ring_reduce_scatter(partial_for, group, gather=kept.contiguous(),
                                              on_gathered=wgrad_chunk)
    else:
        dx_shard = common.ring_reduce_scatter(partial_for, group)   # (s/tp, b, h)
    if defer:
        return dx_shard, weight_grad(w, g, x_full, backend=path)    # queued for W: None
    return dx_shard, (wgrad_for_autograd(w, dw) if want_dw else None)


def all_gather_matmul(x_shard, w, group, bias=None, activation=None, return_gathered=False, *,
                      keep_gathered=True, backend=None, options=None):
    """``act(all_gather_s(x_shard) @ wᵀ + bias)``: x_shard (s/tp, b, h), w (n_local, h) →
    y (s, b, n_local) [, x (s, b, h) gathered when ``return_gathered``].

    ``keep_gathered=False`` saves only the shard for backward and re-gathers it there, in the
    dgrad ring (the activation memory of sequence parallelism, Korthikanti et al.). ``backend`` is
    resolved once for all the op's GEMMs (``tpfuse.kernels.matmul`` paths). ``options``
    (``parallel.comm_options.CommOptions``, None: the defaults): the fused pipeline's size
    threshold, the symmetric-memory forward, the plain path's reduce-scatter strategy."""
    common.validate_linear("all_gather_matmul", x_shard, w, bias, activation)
    options = options_or_default(options)
    tp = group_size(group)
    fused = common.should_fuse(common.gemm_flops(x_shard, w.shape[0], tp), tp, x_shard.device.type,
                               options)
    path = common.gemm_path(backend, x_shard, w, bias)
    y, x_full = _AllGatherMatmul.apply(x_shard, w, bias, group, activation, fused,
                                       bool(keep_gathered), path, options)
    return (y, x_full) if return_gathered else y


def all_gather_matmul_reference(x_shard, w, group, bias=None, activation=None):
    """The unfused composition: all-gather along s (autograd: reduce-scatter), then one GEMM."""
    from tpfuse.parallel.mappings import gather_from_sequence_parallel_region
    x_full = gather_from_sequence_parallel_region(x_shard, group)        # (s, b, h)
    from tpfuse.kernels.matmul import matmul
    return matmul(x_full, w.t(), bias, activation)                        # (s, b, n_local)
