"""All-gather + GEMM over CUDA symmetric memory (one NVLink node; opt-in): the peer shards are
staged into local memory by the copy engine while the GEMM already runs on the shards present.

Every rank of the group owns a symmetric buffer ``A_r (M_r, K)`` (``torch.distributed.
_symmetric_memory``: each rank can address every peer's buffer). One forward (the design of
PyTorch's async-TP ``fused_all_gather_matmul`` and of Triton-distributed's AG-GEMM):

  1. copy x_shard into the local symmetric buffer; a symmetric-memory barrier (every shard is
     published before any peer reads it);
  2. the local gathered input ``x_full (tp·M_r, K)`` and per-shard signals ``ready (tp,)`` (zeros):
     the own shard is copied into its rows and ``ready[r]`` set at once; on a side stream, for
     src = r+1, r+2, ... the copy engine copies peer src's buffer over NVLink into its rows
     (``Tensor.copy_``, a DMA, no SMs) and then writes ``ready[src] = 1`` with
     ``cuStreamWriteValue32`` (a stream memory operation, fenced after the copy, no SMs);
  3. the GEMM kernel (on the compute stream, concurrently): tile (pid_m, pid_n) of
     y = act(x_full @ wᵀ + bias), tiles swizzled so each rank starts with its own rows,
     pid_m' = (pid_m + r · tiles_per_rank) mod tiles_m; before the main loop a tile spins (acquire)
     until ``ready[src]`` is set for every shard its rows come from, then reads them from local
     memory with ordinary vectorised loads;
  4. the compute stream waits for the side stream; a barrier, so nobody overwrites its buffer while
     a peer may still copy from it.
No SM ever waits on work that needs an SM (copies and signals are copy-engine / stream memory
operations), so a grid of spinning tiles cannot deadlock. ``x_full`` is returned for the backward.

Algebra as in ``ag_matmul.py`` (forward only; the backward runs the NCCL ring path). Requires
CUDA, an initialised group whose ranks share one node (``same_node`` checks hostnames once per
group), torch's symmetric memory with ``stream_write_value32``; ``available(group)`` says whether
it can run here. Never used on CPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tpfuse.parallel.mappings import group_rank, group_size

from .matmul_kernels import _epilogue

_ACT_CODE = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 128, 128, 64, 8, 4


# ----------------------------------------------------------------------------- Triton kernel

@triton.jit
def _staged_ag_matmul_kernel(
        a_ptr, ready_ptr, w_ptr, bias_ptr, y_ptr, z_ptr,
        M_r, N, K, rank, tp, stride_am, stride_wn, stride_wk,
        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PREACT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    M = M_r * tp
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = (tl.program_id(0) + rank * tl.cdiv(M_r, BLOCK_M)) % tiles_m   # own rows first
    pid_n = tl.program_id(1)
    # wait until every shard this tile's rows come from has been staged locally
    first_src = (pid_m * BLOCK_M) // M_r
    last_src = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1) // M_r
    for src in range(first_src, last_src + 1):
        while tl.atomic_add(ready_ptr + src, 0, sem="acquire", scope="gpu") == 0:
            pass

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                    mask=offs_k[None, :] < K, other=0.0)                      # (BM, BK)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=offs_k[:, None] < K, other=0.0)                      # (BK, BN) of wᵀ
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    _epilogue(acc, pid_m, pid_n, M, N, bias_ptr, y_ptr, z_ptr, N, 1, HAS_BIAS, ACTIVATION,
              SAVE_PREACT, BLOCK_M, BLOCK_N, False)


# ----------------------------------------------------------------------------- launcher

class _Workspace:
    """One group's symmetric buffer (M_r, K) of a dtype, and the side stream of the copies."""

    def __init__(self, group, shape, dtype, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.data = symm_mem.empty(shape, dtype=dtype, device=device)          # (M_r, K)
        self.handle = symm_mem.rendezvous(self.data, group)
        self.stream = torch.cuda.Stream(device=device, priority=-1)


_workspaces: dict = {}
_same_node: dict = {}


def _group_name(group):
    import torch.distributed as dist
    return (group if group is not None else dist.group.WORLD).group_name


def _workspace(group, shape, dtype, device) -> _Workspace:
    import torch.distributed as dist

    key = (_group_name(group), tuple(shape), dtype, device)
    if key not in _workspaces:
        _workspaces[key] = _Workspace(group if group is not None else dist.group.WORLD, shape,
                                      dtype, device)
    return _workspaces[key]


def same_node(group) -> bool:
    """Whether every rank of ``group`` runs on this host (NVLink peers): one all-gather of host
    names per group, cached. Collective: every rank of the group calls it at the same point."""
    import socket

    import torch.distributed as dist

    name = _group_name(group)
    if name not in _same_node:
        hosts = [None] * group_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _same_node[name] = len(set(hosts)) == 1
    return _same_node[name]


def available(group=None) -> bool:
    """CUDA, an initialised process group whose ranks share one node, and torch's symmetric
    memory with copy-engine signal writes are all present. Collective (see ``same_node``)."""
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return False
    try:
        from torch._C._distributed_c10d import _SymmetricMemory
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    if not hasattr(_SymmetricMemory, "stream_write_value32"):
        return False
    return same_node(group)


def _stage_peers(ws, x_full, ready, rank, tp, m_r):
    """On the side stream: each peer's shard into its rows of x_full, then its ready flag."""
    from torch._C._distributed_c10d import _SymmetricMemory

    for step in range(1, tp):
        src = (rank + step) % tp
        peer = ws.handle.get_buffer(src, tuple(ws.data.shape), ws.data.dtype)
        x_full[src * m_r:(src + 1) * m_r].copy_(peer)                  # copy engine, NVLink
        _SymmetricMemory.stream_write_value32(ready, src, 1)            # after the copy


def forward(x_shard, w, bias, group, activation, save_preact):
    """→ (y, saved, x_full) like ``ag_matmul._forward_chunks``: x_shard (s/tp, b, h) CUDA,
    w (n_local, h) → y (s, b, n_local), z or y for the backward, gathered x (s, b, h)."""
    from torch._C._distributed_c10d import _SymmetricMemory

    tp, rank = group_size(group), group_rank(group)
    K = x_shard.shape[-1]
    m_r = math.prod(x_shard.shape[:-1])                                     # rows per rank
    ws = _workspace(group, (m_r, K), x_shard.dtype, x_shard.device)
    ws.data.copy_(x_shard.reshape(m_r, K))
    ws.handle.barrier(channel=0)                   # every shard is in its buffer
    x_full = torch.empty((tp * m_r, K), dtype=x_shard.dtype, device=x_shard.device)
    ready = torch.zeros(tp, dtype=torch.uint32, device=x_shard.device)
    x_full[rank * m_r:(rank + 1) * m_r].copy_(ws.data)
    _SymmetricMemory.stream_write_value32(ready, rank, 1)
    current = torch.cuda.current_stream()
    ws.stream.wait_stream(current)                 # the side stream sees x_full / ready allocated
    with torch.cuda.stream(ws.stream):
        _stage_peers(ws, x_full, ready, rank, tp, m_r)

    N = w.shape[0]
    keeps_z = save_preact and activation in ("gelu", "gelu_tanh")
    y = torch.empty((tp * m_r, N), dtype=x_shard.dtype, device=x_shard.device)
    z = torch.empty_like(y) if keeps_z else y
    grid = (triton.cdiv(tp * m_r, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _staged_ag_matmul_kernel[grid](
        x_full, ready, w, bias if bias is not None else y, y, z,
        m_r, N, K, rank, tp, x_full.stride(0), w.stride(0), w.stride(1),
        HAS_BIAS=bias is not None, ACTIVATION=_ACT_CODE[activation], SAVE_PREACT=keeps_z,
        INPUT_PRECISION="ieee" if x_shard.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    current.wait_stream(ws.stream)                 # x_full complete for its other users
    x_full.record_stream(ws.stream)
    ready.record_stream(ws.stream)
    ws.handle.barrier(channel=0)                   # peers are done copying from our buffer

    lead = (tp * x_shard.shape[0],) + tuple(x_shard.shape[1:-1])
    saved = z if keeps_z else (y if activation == "relu" and save_preact else None)
    return (y.view(*lead, N), saved.view(*lead, N) if saved is not None else None,
            x_full.view(*lead, K))


def forward_reference(x_shard, w, bias, group, activation):
    """The plain-torch composition the kernel must match: all-gather along s, then one GEMM."""
    from tpfuse.parallel.mappings import all_gather_first_dim

    z = torch.nn.functional.linear(all_gather_first_dim(x_shard, group).float(), w.float(),
                                   bias.float() if bias is not None else None)
    acts = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}
    return acts[activation](z).to(x_shard.dtype)
