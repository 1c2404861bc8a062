"""All-gather + GEMM in one Triton kernel over CUDA symmetric memory (one NVLink node; opt-in).

Every rank of the group owns a symmetric buffer ``A_r (M_r, K)`` (``torch.distributed.
_symmetric_memory``: each rank can address every peer's buffer by pointer) and a symmetric flag
array ``flags (tp,)`` int32. One forward:

  1. copy x_shard into the local buffer A_r;                          (current stream)
  2. publish: store ``epoch`` into flags[r] of every peer (release, system scope);
  3. the GEMM kernel: tile (pid_m, pid_n) of y = act(cat_r A_r @ wᵀ + bias). Tiles are swizzled so
     each rank starts on its own rows, pid_m' = (pid_m + r · tiles_per_rank) mod tiles_m; before
     loading a tile's A rows the program spins (acquire, system scope) on the local
     flags[src] >= epoch of every source rank src its rows come from, then reads those rows
     straight from the peer's buffer over NVLink. The pid_n = 0 programs also store the A tile they
     loaded into the local gathered x (kept for the wgrad GEMM), so the gather costs no extra pass;
  4. a symmetric-memory barrier: nobody overwrites its buffer while a peer may still read it.
``epoch`` grows by one per call (the same on every rank, calls being collective), so flags are
never reset.

Algebra as in ``ag_matmul.py`` (forward only: the backward of the op runs the NCCL ring path).
Requires CUDA tensors, an initialised NCCL group whose ranks share one node, torch's symmetric
memory; ``available()`` says whether it can run here. Never used on CPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tpfuse.parallel.mappings import group_rank, group_size

_ACT_CODE = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _publish_kernel(flag_ptrs, rank, epoch, TP: tl.constexpr):
    """flags[rank] = epoch on every peer (release: the shard copy before it is visible first)."""
    for peer in tl.static_range(TP):
        peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer_flags + rank, epoch, sem="release", scope="sys")


@triton.jit
def _epilogue_activation(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:                                   # gelu (erf)
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACTIVATION == 2:                                 # gelu (tanh), tanh(u) = 2σ(2u) − 1
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        z = 0.5 * z * (1.0 + (2.0 * tl.sigmoid(2.0 * u) - 1.0))
    elif ACTIVATION == 3:                                 # relu
        z = tl.maximum(z, 0.0)
    return z


@triton.jit
def _symm_ag_matmul_kernel(
        a_ptrs, flags_ptr, w_ptr, bias_ptr, y_ptr, z_ptr, x_out_ptr,
        M_r, N, K, epoch, rank, tp, stride_wn, stride_wk,
        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_Z: tl.constexpr,
        WRITE_A: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    M = M_r * tp
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = (tl.program_id(0) + rank * tl.cdiv(M_r, BLOCK_M)) % tiles_m   # own rows first
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows = tl.where(mask_m, offs_m, 0)
    src = rows // M_r                                                  # source rank of each row

    # wait until every peer whose rows this tile reads has published its shard
    first_src = (pid_m * BLOCK_M) // M_r
    last_src = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1) // M_r
    for s in range(first_src, last_src + 1):
        if s != rank:
            while tl.atomic_add(flags_ptr + s, 0, sem="acquire", scope="sys") < epoch:
                pass

    dtype = w_ptr.dtype.element_ty
    row_base = tl.load(a_ptrs + src).to(tl.pointer_type(dtype))       # (BLOCK_M,) peer buffers
    row_ptr = row_base + (rows - src * M_r).to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        a = tl.load(row_ptr[:, None] + offs_k[None, :], mask=a_mask, other=0.0)
        if WRITE_A:
            if pid_n == 0:
                tl.store(x_out_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], a,
                         mask=a_mask)
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)      # (BLOCK_K, BLOCK_N) of wᵀ
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SAVE_Z:
        tl.store(z_ptr + out_offs, acc.to(z_ptr.dtype.element_ty), mask=out_mask)
    acc = _epilogue_activation(acc, ACTIVATION)
    tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------- launcher

class _Workspace:
    """One group's symmetric buffer (M_r, K) of a dtype, its flags and pointer tables."""

    def __init__(self, group, shape, dtype, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.data = symm_mem.empty(shape, dtype=dtype, device=device)          # (M_r, K)
        self.handle = symm_mem.rendezvous(self.data, group)
        self.flags = symm_mem.empty(group_size(group), dtype=torch.int32, device=device)
        self.flags.zero_()
        self.flag_handle = symm_mem.rendezvous(self.flags, group)
        self.a_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(self.flag_handle.buffer_ptrs, dtype=torch.int64,
                                      device=device)
        self.epoch = 0
        self.handle.barrier(channel=0)            # every rank's flags are zero before any publish


_workspaces: dict = {}


def _workspace(group, shape, dtype, device) -> _Workspace:
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    key = (group.group_name, tuple(shape), dtype, device)
    if key not in _workspaces:
        _workspaces[key] = _Workspace(group, shape, dtype, device)
    return _workspaces[key]


def available() -> bool:
    """CUDA, an initialised process group and torch's symmetric memory are all present."""
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def forward(x_shard, w, bias, group, activation, save_preact):
    """→ (y, saved, x_full) like ``ag_matmul._forward_chunks``: x_shard (s/tp, b, h) CUDA,
    w (n_local, h) → y (s, b, n_local), z or y for the backward, gathered x (s, b, h)."""
    tp, rank = group_size(group), group_rank(group)
    K = x_shard.shape[-1]
    m_r = math.prod(x_shard.shape[:-1])                                     # rows per rank
    ws = _workspace(group, (m_r, K), x_shard.dtype, x_shard.device)
    ws.epoch += 1
    ws.data.copy_(x_shard.reshape(m_r, K))
    _publish_kernel[(1,)](ws.flag_ptrs, rank, ws.epoch, TP=tp)

    N = w.shape[0]
    keeps_z = save_preact and activation in ("gelu", "gelu_tanh")
    y = torch.empty((tp * m_r, N), dtype=x_shard.dtype, device=x_shard.device)
    z = torch.empty_like(y) if keeps_z else y
    x_full = torch.empty((tp * m_r, K), dtype=x_shard.dtype, device=x_shard.device)
    grid = (triton.cdiv(tp * m_r, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _symm_ag_matmul_kernel[grid](
        ws.a_ptrs, ws.flags, w, bias if bias is not None else y, y, z, x_full,
        m_r, N, K, ws.epoch, rank, tp, w.stride(0), w.stride(1),
        HAS_BIAS=bias is not None, ACTIVATION=_ACT_CODE[activation], SAVE_Z=keeps_z,
        WRITE_A=True, INPUT_PRECISION="ieee" if x_shard.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=8, num_stages=3)
    ws.handle.barrier(channel=0)                  # peers are done reading our buffer

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
