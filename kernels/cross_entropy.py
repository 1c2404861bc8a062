"""Cross-entropy over a (possibly vocab-sharded) logits matrix, built from two shard-local pieces.

Algebra, per row r with logits x (N, V), target t and ignore mask keep_r = (t_r != ignore_index):

    loss_r          = keep_r · (log Σ_j exp(x_rj) − x_r,t_r)
                    = keep_r · (log S_r + M_r − x_r,t_r),   M_r = max_j x_rj,  S_r = Σ_j exp(x_rj − M_r)
    dloss/dx_rj     = g_r · keep_r · (exp(x_rj − M_r) / S_r − [j == t_r])      (g = upstream grad)

The pieces:

- ``cross_entropy_shard_stats(x_shard, t, vocab_start)`` → ``(M_local, S_local, x_t_local)``: one pass
  over the local vocab columns ``[vocab_start, vocab_start + V_local)`` with an online max/sum
  (``S`` relative to the local max); ``x_t_local`` is 0 when the target lies outside the shard.
- ``cross_entropy_shard_grad(x_shard, t, vocab_start, M, S, g)`` → the gradient columns of the shard,
  given the *global* ``M`` and ``S``.

Single device = one shard with ``vocab_start = 0``. The vocab-parallel loss (tp_layers) combines
shards with two small all-reduces::

    M_local, S_local, xt_local = cross_entropy_shard_stats(x_shard, t, vocab_start)
    M = all_reduce(M_local, MAX)
    stacked = stack([S_local * exp(M_local - M), xt_local])       # rescale to the global max
    S, xt = all_reduce(stacked, SUM)                              # exactly one shard holds x_t
    loss = where(t == ignore_index, 0, log(S) + M - xt)
    backward: dx_shard = cross_entropy_shard_grad(x_shard, t, vocab_start, M, S, g, ignore_index)

File shape: Triton kernels → launchers → plain-torch reference → autograd Function → public op.
Logits may be fp32/bf16/fp16 (and of any leading shape ``(..., V)`` with targets ``(...)``); the
statistics and the loss are fp32, the gradient has the logits' dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import backend as _backend

_CPU_BLOCK_V = 64  # interpreter block: small, and < 203 so tests cross several vocab blocks


# ----------------------------------------------------------------------------- Triton kernels

# (BLOCK_V, warps, stages of the vocab loop): the autotuner times each on the GPU (key: V and dtype)
STATS_CONFIGS = ((2048, 4, 3), (4096, 4, 3), (4096, 8, 3), (8192, 8, 3), (8192, 16, 3))
GRAD_CONFIGS = ((2048, 4), (4096, 8), (8192, 16))
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x·log2 e)


@triton.jit
def _online_logsumexp(m, s, x):
    """(max, Σ exp(· − max)) of the columns seen so far, updated with the block x (fp32).
    −inf guard: while every column so far is −inf (masked vocabulary padding), exponentiate against
    0 instead of the max, so exp(−inf − (−inf)) never makes a NaN; the sum stays 0.
    exp(x − m) = 2^(x·log2e − m·log2e): one FMA and one ex2 per element."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    m_scaled = tl.where(m_new == -float("inf"), 0.0, m_new) * LOG2E
    s = s * tl.exp2(m * LOG2E - m_scaled) + tl.sum(tl.exp2(x * LOG2E - m_scaled), axis=0)
    return m_new, s


@triton.autotune(
    configs=[triton.Config({"BLOCK_V": bv, "NUM_STAGES": st}, num_warps=w) for bv, w, st in STATS_CONFIGS],
    key=["V"],
)
@triton.jit
def _shard_stats_kernel(logits_ptr, target_ptr, row_max_ptr, sum_exp_ptr, target_logit_ptr, loss_ptr,
                        bad_target_ptr, V, stride_row, vocab_start, ignore_index,
                        WRITE_LOSS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One program per row, one read of it: online max / sum-exp over the full vocab blocks
    (unmasked, cp.async pipelined), then the ragged tail block, plus the in-shard target logit.
    ``WRITE_LOSS`` (one shard = the whole vocabulary): also the row's loss, and a 1 in
    ``bad_target_ptr`` for a target outside [0, V) that is not ``ignore_index`` (checked on the
    device, so no host synchronisation)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    full = V - V % BLOCK_V
    for start in tl.range(0, full, BLOCK_V, num_stages=NUM_STAGES):
        m, s = _online_logsumexp(m, s, tl.load(row_ptr + start + cols).to(tl.float32))
    if full < V:
        tail = tl.load(row_ptr + full + cols, mask=full + cols < V, other=-float("inf"))
        m, s = _online_logsumexp(m, s, tail.to(tl.float32))
    target = tl.load(target_ptr + row)
    local = target - vocab_start
    in_shard = (local >= 0) & (local < V)
    x_t = tl.load(row_ptr + tl.where(in_shard, local, 0), mask=in_shard, other=0.0).to(tl.float32)
    x_t = tl.where(in_shard, x_t, 0.0)
    tl.store(row_max_ptr + row, m)
    tl.store(sum_exp_ptr + row, s)
    tl.store(target_logit_ptr + row, x_t)
    if WRITE_LOSS:
        ignored = target == ignore_index
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, tl.log(s) + m - x_t))
        bad = (target != ignore_index) & ((local < 0) | (local >= V))
        tl.atomic_max(bad_target_ptr, 1, mask=bad)  # rare: no traffic otherwise


@triton.autotune(configs=[triton.Config({"BLOCK_V": bv}, num_warps=w) for bv, w in GRAD_CONFIGS], key=["V"])
@triton.jit
def _shard_grad_kernel(logits_ptr, target_ptr, global_max_ptr, global_sum_ptr, grad_loss_ptr, dlogits_ptr,
                       V, stride_row, stride_grad_row, vocab_start, ignore_index, BLOCK_V: tl.constexpr):
    """Program (row, vocab block): g · keep · (exp(x − lse) − onehot(target − vocab_start)),
    lse = M + log S per row (no division per element: one FMA and one ex2)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = cols < V
    target = tl.load(target_ptr + row)
    g = tl.load(grad_loss_ptr + row).to(tl.float32)
    g = tl.where(target == ignore_index, 0.0, g)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=in_row, other=0.0).to(tl.float32)
    row_max = tl.load(global_max_ptr + row)
    row_sum = tl.load(global_sum_ptr + row)
    row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    # all −inf row (S = 0): lse = +inf makes p = 0, not NaN
    has_mass = row_sum > 0
    lse_scaled = tl.where(has_mass, (row_max + tl.log(tl.where(has_mass, row_sum, 1.0))) * LOG2E, float("inf"))
    p = tl.exp2(x * LOG2E - lse_scaled)
    dx = g * tl.where(cols == target - vocab_start, p - 1.0, p)
    tl.store(dlogits_ptr + row * stride_grad_row + cols, dx.to(dlogits_ptr.dtype.element_ty), mask=in_row)


# ----------------------------------------------------------------------------- launchers

def _as_rows(logits: torch.Tensor, target: torch.Tensor):
    """(..., V) logits and (...) targets → (N, V) rows with unit column stride and (N,) int64."""
    if logits.dim() < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(f"cross_entropy: logits shape {tuple(logits.shape)} must be target shape "
                         f"{tuple(target.shape)} plus a vocab dim")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"cross_entropy: target must hold integer class ids, got dtype {target.dtype}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"cross_entropy: logits dtype must be fp32/bf16/fp16, got {logits.dtype}")
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, target.reshape(-1).long()


def _stats_triton(rows, target, vocab_start, ignore_index=None):
    """→ (row_max, sum_exp, target_logit), plus (loss, bad_target flag (1,) int32) when
    ``ignore_index`` is given (the whole vocabulary in one shard)."""
    n, v = rows.shape
    write_loss = ignore_index is not None
    row_max, sum_exp, target_logit = (torch.empty((n,), device=rows.device, dtype=torch.float32)
                                      for _ in range(3))
    loss = torch.empty((n,), device=rows.device, dtype=torch.float32) if write_loss else row_max
    bad_target = torch.zeros((1,), device=rows.device, dtype=torch.int32) if write_loss else row_max
    if n:
        _backend.launch(_shard_stats_kernel, (n,), rows, target, row_max, sum_exp, target_logit, loss,
                        bad_target, v, rows.stride(0), vocab_start, ignore_index if write_loss else 0,
                        WRITE_LOSS=write_loss, cpu_meta={"BLOCK_V": _CPU_BLOCK_V, "NUM_STAGES": 2})
    stats = (row_max, sum_exp, target_logit)
    return stats + (loss, bad_target) if write_loss else stats


def _grad_triton(rows, target, vocab_start, global_max, global_sum_exp, grad_loss, ignore_index):
    n, v = rows.shape
    dlogits = torch.empty_like(rows, memory_format=torch.contiguous_format)  # every element written
    if n:
        grid = lambda meta: (n, triton.cdiv(v, meta["BLOCK_V"]))  # noqa: E731
        _backend.launch(_shard_grad_kernel, grid, rows, target, global_max.float().contiguous(),
                        global_sum_exp.float().contiguous(), grad_loss.float().contiguous(), dlogits,
                        v, rows.stride(0), dlogits.stride(0), vocab_start, ignore_index,
                        cpu_meta={"BLOCK_V": _CPU_BLOCK_V})
    return dlogits


# ----------------------------------------------------------------------------- plain-torch reference

def _stats_torch(rows, target, vocab_start):
    x = rows.float()                                                          # (N, V)
    row_max = x.amax(dim=-1)                                                  # (N,)
    finite_max = torch.where(row_max == float("-inf"), 0.0, row_max)          # −inf guard (kernel's)
    sum_exp = torch.exp(x - finite_max[:, None]).sum(dim=-1)                  # (N,) in [1, V], 0 if all −inf
    local = target - vocab_start
    in_shard = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(1, torch.where(in_shard, local, 0)[:, None]).squeeze(1)
    return row_max, sum_exp, torch.where(in_shard, picked, torch.zeros_like(picked))


def _grad_torch(rows, target, vocab_start, global_max, global_sum_exp, grad_loss, ignore_index):
    finite_max = torch.where(global_max == float("-inf"), 0.0, global_max.float())
    sums = global_sum_exp.float()
    global_lse = torch.where(sums > 0, finite_max + torch.log(sums), float("inf"))  # (N,); S = 0: p = 0
    probs = torch.exp(rows.float() - global_lse[:, None])                     # (N, V) fresh buffer
    local = target - vocab_start
    hit = torch.nonzero((local >= 0) & (local < rows.shape[-1])).squeeze(1)  # rows whose target is here
    probs[hit, local[hit]] -= 1.0                                             # − onehot
    g = torch.where(target == ignore_index, torch.zeros_like(grad_loss, dtype=torch.float32),
                    grad_loss.float())
    return probs.mul_(g[:, None]).to(rows.dtype)


def cross_entropy_reference(logits, target, ignore_index=-100):
    """Plain torch (explicit log-sum-exp, fp32) per-row loss; the ground truth for the kernels' tests."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    safe_target = torch.where(target == ignore_index, 0, target).long()
    x_t = x.gather(-1, safe_target[..., None]).squeeze(-1)
    return torch.where(target == ignore_index, torch.zeros_like(lse), lse - x_t)


# ----------------------------------------------------------------------------- public pieces

def _pick(backend, *tensors):
    return _backend.resolve(backend, *tensors)


def cross_entropy_shard_stats(logits_shard, target, vocab_start, *, backend=None):
    """``(row_max, sum_exp, target_logit)``, each fp32 of target's shape, over the local vocab shard.

    ``sum_exp = Σ_local exp(x − row_max)``; ``target_logit`` is 0 where the target is not in
    ``[vocab_start, vocab_start + V_local)`` (ignored targets included, as ignore_index < 0 or the
    caller masks the loss).
    """
    rows, flat_target = _as_rows(logits_shard, target)
    impl = _stats_triton if _pick(backend, rows) == "triton" else _stats_torch
    return tuple(t.reshape(target.shape) for t in impl(rows, flat_target, int(vocab_start)))


def cross_entropy_loss_from_stats(global_max, global_sum_exp, target_logit, target, ignore_index=-100):
    """Per-row loss from the combined stats: log Σ exp(z − max) + max − z_target; 0 where ignored."""
    loss = torch.log(global_sum_exp) + global_max - target_logit
    return torch.where(target == ignore_index, torch.zeros_like(loss), loss)


def cross_entropy_shard_grad(logits_shard, target, vocab_start, global_max, global_sum_exp, grad_loss,
                             ignore_index=-100, *, backend=None):
    """d loss / d logits_shard = grad_loss · (softmax − onehot) on the shard's columns; 0 on ignored rows.

    ``global_max`` and ``global_sum_exp`` are the all-shard row statistics (sum relative to the max).
    """
    rows, flat_target = _as_rows(logits_shard, target)
    impl = _grad_triton if _pick(backend, rows) == "triton" else _grad_torch
    dlogits = impl(rows, flat_target, int(vocab_start), global_max.reshape(-1), global_sum_exp.reshape(-1),
                   grad_loss.reshape(-1), int(ignore_index))
    return dlogits.reshape(logits_shard.shape)


class _CrossEntropy(torch.autograd.Function):
    """Single-device Triton cross-entropy: one shard (vocab_start = 0), no communication; the
    forward is one kernel (statistics, loss and the target-range flag in one read of the logits)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        rows, flat_target = _as_rows(logits, target)                               # (N, V), (N,)
        row_max, sum_exp, _, loss, bad_target = _stats_triton(rows, flat_target, 0, ignore_index)
        if rows.is_cuda:  # device-side check, no host synchronisation (as torch's CUDA loss)
            torch._assert_async(bad_target[0] == 0, _out_of_range_message(logits.shape[-1], ignore_index))
        ctx.save_for_backward(logits, target, row_max, sum_exp)
        ctx.ignore_index = ignore_index
        return loss.reshape(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, row_max, sum_exp = ctx.saved_tensors
        dlogits = cross_entropy_shard_grad(logits, target, 0, row_max, sum_exp, grad_loss, ctx.ignore_index,
                                           backend="triton")
        return dlogits, None, None


class TargetOutOfRangeError(IndexError, ValueError):
    """A target class id outside ``[0, V)`` that is not ``ignore_index`` (torch raises IndexError;
    tpfuse's bad-input errors are ValueErrors: this is both)."""


def _out_of_range_message(vocab_size, ignore_index, value="id", op="cross_entropy"):
    return (f"{op}: target {value} is out of bounds for a vocabulary of {vocab_size} (valid ids "
            f"0..{vocab_size - 1}, or ignore_index={ignore_index})")


def check_targets_in_range(target, vocab_size, ignore_index, op="cross_entropy"):
    """Raise ``TargetOutOfRangeError`` naming the first offending id (one device→host read). On a
    CUDA tensor the check is a device-side assertion instead (no host synchronisation: a bad id
    stops the job at the next synchronising call, as torch's own CUDA cross-entropy does)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if target.is_cuda:
        torch._assert_async(~bad.any(), _out_of_range_message(vocab_size, ignore_index, op=op))
    elif bool(bad.any()):
        value = int(target[bad].flatten()[0])
        raise TargetOutOfRangeError(_out_of_range_message(vocab_size, ignore_index, value, op))


def cross_entropy(logits, target, ignore_index=-100, *, backend=None):
    """Per-row loss ``(N,)`` fp32 (target's shape), 0 where ``target == ignore_index``.

    ``logits (..., V)`` fp32/bf16/fp16, ``target (...)`` integer in ``[0, V)`` or ``ignore_index``
    (anything else raises ``TargetOutOfRangeError``, an IndexError and ValueError, on both paths;
    on CUDA tensors it is a device-side assertion instead, checked inside the Triton kernel, so
    the loss never synchronises with the host). Differentiable w.r.t. logits.
    The torch path is ``F.cross_entropy(reduction="none")`` on fp32 logits (fastest on CPU); the
    Triton path is the shard pieces above with ``vocab_start = 0``, the loss fused into the
    statistics kernel.
    """
    _as_rows(logits, target)  # validate shapes / dtypes before choosing a path
    use_torch = _pick(backend, logits) == "torch"
    if use_torch or not logits.is_cuda:
        check_targets_in_range(target, logits.shape[-1], ignore_index)
    if use_torch:
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1).long(),
                               ignore_index=ignore_index, reduction="none")
        return loss.reshape(target.shape)
    return _CrossEntropy.apply(logits, target, int(ignore_index))
