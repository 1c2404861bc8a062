"""GPU check of context parallelism's attention work on one device: every cp rank's share run in
one process, on the flash kernels (Triton on a GPU), against the full-sequence kernel.

    python benchmarks/gpu_context_parallel_check.py               # one GPU, bf16, about a minute
    python benchmarks/gpu_context_parallel_check.py --cpu-dry-run # tiny fp32 shapes on the CPU
    python benchmarks/gpu_context_parallel_check.py --budget-s 14 # start no row after 14 s (the
                                                                  # rest: SKIPPED, not failed)

Rank r of cp holds query chunks r and 2·cp−1−r (c = s / (2·cp) tokens each) and, over the whole
sequence's K/V, runs exactly the block calls ring and all_gather attention run
(``attend_key_chunks`` / ``..._backward`` over ``ChunkPlan``: the c × c pairs with a visible key,
their offsets, window and document ids). For cp = 2, 4, 8 and causal / documents / window /
documents + window masks:

- correctness: rank r's out and dq against rows of ``flash_attention`` on the whole sequence, and
  dk, dv summed over the ranks against its dk, dv; max|diff| / max|ref| ≤ 2e-2 in bf16 (one bf16
  rounding is ≤ 3.9e-3 relative; the lse merge of fp32 partials adds no more), 1e-4 in fp32;
- balance: forward + backward time of each rank's calls (synchronised wall time, median of 5):
  max / mean over the ranks (1.00 = Megatron's layout balances the causal work) and cp × mean /
  the full kernel's time (the cost of cutting the work into c × c calls; 1.00 = free).

Communication is not in it (one GPU cannot hold a cp group): benchmarks/test_bench_context_parallel.py
measures the ring's exchanges on gloo, ≥ 2 GPUs with NCCL would measure them on devices.
Exit status: 0 when every check passes (or there is no GPU), 1 otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tpfuse.kernels.flash_attention import flash_attention
from tpfuse.parallel.context_split import split_sequence
from tpfuse.tp_layers.attention_blocks import (ChunkPlan, attend_key_chunks,
                                               attend_key_chunks_backward, default_scale)

SHAPES = {  # name: (b, heads, kv heads, s, d, window, dtype, device, timing rounds)
    "gpu": (1, 16, 4, 16384, 128, 1024, torch.bfloat16, "cuda", 5),
    "cpu-dry-run": (1, 4, 2, 64, 16, 5, torch.float32, "cpu", 1),
}
MASKS = ("causal", "documents", "window", "documents+window")


def _inputs(shape, seed=0):
    b, h, g, s, d, _, dtype, device, _ = shape
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(b, n, s, d, generator=gen).to(device, dtype) for n in (h, g, g, h)]
    lengths = torch.randint(1, max(2, s // 8) + 1, (b, s), generator=gen)
    ids = torch.stack([torch.repeat_interleave(torch.arange(s), row)[:s] for row in lengths])
    return tensors, ids.to(device)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, rounds):
    """(result of the last call, median wall seconds over ``rounds`` calls; on a GPU after one
    warm-up call, which compiles and autotunes the kernels)."""
    result, times = fn() if device == "cuda" else None, []
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def full_sequence(q, k, v, dout, window, ids):
    """(out, dq, dk, dv) of flash_attention on the whole sequence."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, causal=True, window_size=window, q_document_ids=ids,
                          k_document_ids=ids)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def rank_share(q, kv, dout, cp, rank, window, ids):
    """(out, dq, dkv) of cp rank ``rank``: its query chunks over the whole sequence's K/V."""
    c = q.shape[2] // (2 * cp)
    plan = ChunkPlan(cp, rank, c, default_scale(q.shape[-1], None), True, window, ids)
    q_r, dout_r = (split_sequence(t, cp, rank, dim=2).contiguous() for t in (q, dout))
    b, h, _, d = q.shape
    out = torch.zeros(b, h, 2 * c, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, 2 * c), float("-inf"), dtype=torch.float32, device=q.device)
    attend_key_chunks(q_r, kv, plan, range(2 * cp), out, lse)
    out = out.to(q.dtype)
    dq = torch.zeros(q_r.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    attend_key_chunks_backward(dout_r, q_r, kv, out, lse, plan, range(2 * cp), dq, dkv)
    return out, dq, dkv


def _error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def check(shape, cp, mask):
    """One row: (worst error, max/mean rank time, cp·mean / full time)."""
    (q, k, v, dout), ids = _inputs(shape)
    window = shape[5] if "window" in mask else None
    ids = ids if "documents" in mask else None
    device, rounds = shape[7], shape[8]
    ref, full_time = _timed(lambda: full_sequence(q, k, v, dout, window, ids), device, rounds)
    kv = torch.stack([k, v])                                         # (2, b, g, s, d)
    dkv_sum, errors, times = torch.zeros(kv.shape, device=q.device), [], []
    for rank in range(cp):
        (out, dq, dkv), seconds = _timed(lambda: rank_share(q, kv, dout, cp, rank, window, ids),
                                         device, rounds)
        errors += [_error(out, split_sequence(ref[0], cp, rank, 2)),
                   _error(dq, split_sequence(ref[1], cp, rank, 2))]
        dkv_sum += dkv
        times.append(seconds)
    errors += [_error(dkv_sum[0], ref[2]), _error(dkv_sum[1], ref[3])]
    mean = statistics.mean(times)
    return max(errors), max(times) / mean, cp * mean / full_time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="tiny fp32 shapes on the CPU (exercises the script without a GPU)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no (cp, mask) row after this many seconds")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("CUDA is not available on this machine; nothing to measure")
        return 0
    shape = SHAPES["cpu-dry-run" if args.cpu_dry_run else "gpu"]
    tolerance = 2e-2 if shape[6] == torch.bfloat16 else 1e-4
    b, h, g, s, d, window, dtype, device, _ = shape
    print(f"b {b}, heads {h}, kv heads {g}, s {s}, d {d}, window {window}, {dtype}, {device}; "
          f"tolerance {tolerance:g}")
    print("| cp | mask | max error | rank time max/mean | cp·mean / full kernel | status |")
    print("|---|---|---|---|---|---|")
    failed, started = False, time.perf_counter()
    for cp in (2, 4, 8):
        for mask in MASKS:
            if time.perf_counter() - started > args.budget_s:
                print(f"| {cp} | {mask} | | | | SKIPPED (time budget) |", flush=True)
                continue
            error, imbalance, overhead = check(shape, cp, mask)
            status = "PASS" if error <= tolerance else "FAIL"
            failed |= status == "FAIL"
            print(f"| {cp} | {mask} | {error:.2e} | {imbalance:.2f} | {overhead:.2f} | {status} |",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
