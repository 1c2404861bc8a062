"""Shared pieces of the fused comm+GEMM ops (``ag_matmul.py``, ``matmul_rs.py``).

- the **size threshold** below which the ops run the plain collective + one GEMM instead of the
  chunked, overlapped pipeline (fused pipelines lose on small GEMMs in every published system);
- the two **ring schedules** with a per-chunk callback, so the GEMM of a chunk runs while the next
  chunk is in flight:
  ``ring_all_gather``: chunks arrive local first, then from rank r+1, r+2, ... (forwarded around the
  ring: each rank sends to r-1 and receives from r+1);
  ``ring_reduce_scatter``: the partial output for rank r+1, r+2, ... is computed and sent straight to
  its owner while the next one is computed, the local chunk last; partials are summed in fp32;
- ``linear`` / ``dgrad`` / ``activation_grad``: the GEMM pieces, straight on matmul's path
  functions (one backend resolution per op, outputs written into slices of the whole result).

Communication is ``torch.distributed.batch_isend_irecv`` (gloo: async send/recv on the transport
threads; NCCL: one grouped launch on the communicator's stream, and ``work.wait()`` makes the
compute stream wait on it, so the GEMMs on the compute stream overlap the transfer).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tpfuse.parallel.comm_options import CommOptions, options_or_default
from tpfuse.parallel.mappings import group_rank, group_size

ACTIVATIONS = (None, "gelu", "gelu_tanh", "relu")

# ----------------------------------------------------------------------------- size threshold

# Per-rank forward GEMM FLOPs (2·rows·k·n) from which the overlapped pipeline is used, by device.
# cpu: measured (gloo, tp=2, 1 thread per rank, fp32; benchmarks/test_bench_fused_comm_cpu.py::
#      test_threshold_sweep, numbers in benchmarks/FUSED_COMM_RESULTS.md): the fused pipeline was
#      slower at every size <= 2.1e9 (seq/fused 0.41-0.90) and on par from 4.3e9 (0.79-1.23).
# cuda: not measured here (no GPU in this session): Triton-distributed's published crossover,
#      ~100 GFLOP per GPU; benchmarks/gpu_fused_comm_check.py measures it on a GPU node.
# ``CommOptions.fused_min_flops`` (the trainer's --fused-comm-min-flops) overrides both.
DEFAULT_MIN_FLOPS = {"cpu": 4e9, "cuda": 1e11}


def get_fused_min_flops(device_type: str = "cpu", options: CommOptions | None = None) -> float:
    """The threshold in force for tensors on ``device_type`` ("cpu", "cuda", ...): the one of
    ``options`` (a ``parallel.comm_options.CommOptions``), else the per-device default."""
    flops = options_or_default(options).fused_min_flops
    if flops is not None:
        return flops
    return DEFAULT_MIN_FLOPS.get(device_type, DEFAULT_MIN_FLOPS["cuda"])


def should_fuse(flops: float, tp: int, device_type: str = "cpu",
                options: CommOptions | None = None) -> bool:
    """Fused pipeline for a GEMM of ``flops`` per rank over ``tp`` ranks on ``device_type``?"""
    return tp > 1 and flops >= get_fused_min_flops(device_type, options)


def gemm_flops(x: torch.Tensor, n: int, tp_rows: int = 1) -> float:
    """FLOPs of ``x (rows, ..., k) @ (k, n)`` with rows multiplied by ``tp_rows``."""
    return 2.0 * x.numel() * tp_rows * n


# ----------------------------------------------------------------------------- validation

def validate_linear(op: str, x, w, bias=None, activation=None) -> None:
    """ValueError naming the offending argument: x (s, ..., k), w (n, k), bias (n,)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be (s, b, k) sequence-first, got shape {tuple(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: w must be (n, k) with k = x.shape[-1] = {x.shape[-1]}, "
                         f"got w shape {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"{op}: x and w dtypes must match, got {x.dtype} and {w.dtype}")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"{op}: bias must have shape ({w.shape[0]},), got {tuple(bias.shape)}")


# ----------------------------------------------------------------------------- GEMM pieces
# The ops validate once and resolve the backend once ("triton" | "torch"); every chunk's GEMM then
# goes straight to matmul's path functions (``kernels.matmul.PATHS``): no nested autograd
# Function, no per-chunk validation, outputs written into the caller's slices.

def gemm_path(backend, *tensors) -> str:
    from tpfuse.kernels.backend import resolve      # imported late: matmul.py imports triton
    return resolve(backend, *tensors)


def _paths(path):
    from tpfuse.kernels.matmul import PATHS
    return PATHS[path]


def linear(x, w, path, bias=None, activation=None, *, out=None, preact_out=None):
    """``act(x @ wᵀ + bias)`` → ``(y, saved)`` with saved what ``activation_grad`` needs (z for
    gelu*, y for relu, None otherwise), one GEMM with the bias and activation in its epilogue.
    x (..., k), w (n, k); ``out`` / ``preact_out`` (..., n) views (e.g. row slices of the
    whole output) are written in place."""
    n = w.shape[0]
    rows = x.reshape(-1, x.shape[-1])                                   # (M, k)
    flat = lambda t: None if t is None else t.view(-1, n)               # noqa: E731  (M, n)
    y2d, saved2d = _paths(path)[0](rows, w.t(), bias, activation, x.dtype, out=flat(out),
                                   preact_out=flat(preact_out))
    y = out if out is not None else y2d.view(*x.shape[:-1], n)
    if saved2d is None or saved2d is y2d:                               # nothing, or relu's y
        return y, (None if saved2d is None else y)
    return y, (preact_out if preact_out is not None else saved2d.view(*x.shape[:-1], n))


def dgrad(g, w, path, *, out=None):
    """``g @ w``: g (..., n), w (n, k) → (..., k) (into ``out`` when given)."""
    rows = g.reshape(-1, g.shape[-1])
    flat_out = None if out is None else out.view(-1, w.shape[1])
    result = _paths(path)[2](rows, w, g.dtype, out=flat_out)
    return out if out is not None else result.view(*g.shape[:-1], w.shape[1])


def activation_grad(dy, saved, activation, path):
    """``dy ⊙ act'(z)`` from what ``linear`` saved (z for gelu*, y for relu)."""
    if activation is None:
        return dy
    return _paths(path)[1](dy, saved, activation, dy.dtype)


# ----------------------------------------------------------------------------- ring schedules

_exposed_comm_s = 0.0          # host seconds spent blocked in ring waits (see take_exposed_comm_s)


def _post(ops):
    """Start the transfers (host time spent here counts as exposed: gloo may write part of a
    message synchronously)."""
    global _exposed_comm_s
    start = time.perf_counter()
    works = dist.batch_isend_irecv(ops)
    _exposed_comm_s += time.perf_counter() - start
    return works


def _wait(works) -> None:
    global _exposed_comm_s
    start = time.perf_counter()
    for work in works:
        if work is not None:                       # None: a no-op collective (group size 1)
            work.wait()
    _exposed_comm_s += time.perf_counter() - start


def take_exposed_comm_s() -> float:
    """Seconds the host spent starting and waiting for ring transfers since the last call (then
    reset): the communication the GEMMs did not hide. Meaningful on CPU/gloo, where ``wait`` blocks until the
    data is there; on CUDA ``wait`` only orders streams and returns at once."""
    global _exposed_comm_s
    seconds, _exposed_comm_s = _exposed_comm_s, 0.0
    return seconds


def _global(group, rank_in_group: int) -> int:
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


def ring_all_gather(x_shard, group, on_chunk):
    """Gather ``x_shard (s/tp, ...)`` into ``(s, ...)`` around a ring, calling
    ``on_chunk(src, chunk)`` for src = r, r+1, ..., r-1 as soon as that chunk is present while the
    next one is in flight. Returns the gathered tensor."""
    tp, r = group_size(group), group_rank(group)
    x_shard = x_shard.contiguous()
    rows = x_shard.shape[0]
    full = torch.empty((tp * rows,) + tuple(x_shard.shape[1:]), dtype=x_shard.dtype,
                       device=x_shard.device)                       # (s, ...)
    chunk = lambda c: full[c * rows:(c + 1) * rows]                  # noqa: E731  (s/tp, ...)
    chunk(r).copy_(x_shard)
    prev_rank, next_rank = _global(group, (r - 1) % tp), _global(group, (r + 1) % tp)
    for step in range(tp):
        src = (r + step) % tp
        works = []
        if step < tp - 1:
            ops = [dist.P2POp(dist.isend, chunk(src), prev_rank, group, tag=step),
                   dist.P2POp(dist.irecv, chunk((src + 1) % tp), next_rank, group, tag=step)]
            works = _post(ops)
        on_chunk(src, chunk(src))
        _wait(works)
    return full


def ring_reduce_scatter(partial_for, group, after_partial=None, *, gather=None, on_gathered=None):
    """``Σ_ranks partial`` for this rank's chunk: ``partial_for(dst)`` returns this rank's partial
    output rows destined for rank dst. Computed for dst = r+1, r+2, ... and sent to dst while the
    next is computed; the local one last. ``after_partial(dst)`` (optional) runs right after each
    partial is handed off (its transfer posted; for the local one, before the last wait), so extra
    work such as a wgrad GEMM also hides the transfers. Received partials are summed in fp32;
    returns the sum in the partials' dtype.

    ``gather`` (optional, this rank's shard ``(s/tp, ...)``) is all-gathered in the same ring: each
    step also sends it to dst and receives the shard of src = r − step (the same two peers, one
    batched launch); ``on_gathered(src, shard)`` runs for the local shard while the first
    transfers fly, then for each peer's shard as soon as it is there (the backward's re-gathered
    input: its weight-gradient share is computed while the next step's transfers fly)."""
    tp, r = group_size(group), group_rank(group)
    after_partial = after_partial or (lambda dst: None)
    pending = None                          # (works, received partial, src, received shard)
    acc = None                              # fp32 running sum of received partials

    def drain(acc, pending):
        works, received, src, shard = pending
        _wait(works)
        if shard is not None:
            on_gathered(src, shard)
        return received.float() if acc is None else acc.add_(received)

    for step in range(1, tp):
        dst, src = (r + step) % tp, (r - step) % tp
        part = partial_for(dst).contiguous()                         # (s/tp, ..., n)
        received = torch.empty_like(part)
        peer_dst, peer_src = _global(group, dst), _global(group, src)
        ops = [dist.P2POp(dist.isend, part, peer_dst, group, tag=step),
               dist.P2POp(dist.irecv, received, peer_src, group, tag=step)]
        shard = None
        if gather is not None:
            shard = torch.empty_like(gather)
            ops += [dist.P2POp(dist.isend, gather, peer_dst, group, tag=tp + step),
                    dist.P2POp(dist.irecv, shard, peer_src, group, tag=tp + step)]
        works = _post(ops)
        after_partial(dst)
        if step == 1 and gather is not None:
            on_gathered(r, gather)
        if pending is not None:
            acc = drain(acc, pending)
        pending = (works, received, src, shard)
    local = partial_for(r)
    after_partial(r)
    if tp == 1 and gather is not None:
        on_gathered(r, gather)
    if pending is not None:
        acc = drain(acc, pending)
    if acc is None:
        return local
    return acc.add_(local).to(local.dtype)
