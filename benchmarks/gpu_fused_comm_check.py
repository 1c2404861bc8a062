"""GPU check of the fused comm+GEMM ops: correctness, then fused vs sequential timings (bf16).

    torchrun --nproc-per-node=<GPUs on one node> benchmarks/gpu_fused_comm_check.py [--tokens 16384]
    python3 benchmarks/gpu_fused_comm_check.py           # one GPU: no communication to hide

tp = the number of processes (one GPU each, NCCL). For a GPT MLP (h, 4h) over tp ranks it runs
``all_gather_matmul`` (fc1: x_shard (s/tp, 1, h) @ w (4h/tp, h)ᵀ, gelu epilogue) and
``matmul_reduce_scatter`` (fc2: x (s, 1, 4h/tp) @ w (h, 4h/tp)ᵀ) and prints, forward and
forward+backward: the collectives alone, the GEMMs alone, the sequential op (threshold ∞: one
collective then one GEMM), the fused ring pipeline (threshold 0) and, for all_gather_matmul's
forward, the symmetric-memory Triton kernel; the ratio sequential / fused and the share of the
communication time hidden, (comm + GEMM − fused) / comm. With a single GPU nothing is emulated:
only the GEMM timings are printed (there is no communication to hide). Exits 0 without CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def _init() -> None:
    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        from tpfuse.parallel.launch import free_port
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)


def _time_ms(fn, iters=10) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (CUDA events, after 2 warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    slowest = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)         # a step lasts until the slowest rank
    return slowest.item()


def _layer(op, tokens, hidden, tp):
    torch.manual_seed(1234 + dist.get_rank())
    kw = dict(device="cuda", dtype=torch.bfloat16)
    ffn = 4 * hidden
    if op == "ag":
        return (torch.randn(tokens // tp, 1, hidden, **kw), torch.randn(ffn // tp, hidden, **kw) * 0.02,
                torch.randn(tokens, 1, ffn // tp, **kw))
    return (torch.randn(tokens, 1, ffn // tp, **kw), torch.randn(hidden, ffn // tp, **kw) * 0.02,
            torch.randn(tokens // tp, 1, hidden, **kw))


def _run(op, x, w, dy, backward, mode):
    from tpfuse.kernels import ag_matmul
    from tpfuse.kernels.matmul import matmul
    from tpfuse.parallel.comm_options import CommOptions

    group = dist.group.WORLD
    tp = dist.get_world_size()
    if mode == "gemm":                                     # same GEMMs, full rows, no comm
        x = torch.cat([x] * tp) if op == "ag" else x
        dy = torch.cat([dy] * tp) if op == "rs" else dy
        group = None
    x, w = x.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
    options = CommOptions(fused_min_flops=float("inf") if mode == "sequential" else 0,
                          symm_mem=mode == "symm")
    with torch.set_grad_enabled(backward):
        if mode == "gemm":
            y = matmul(x, w.t(), activation="gelu" if op == "ag" else None)
        elif op == "ag":
            y = ag_matmul.all_gather_matmul(x, w, group, activation="gelu", options=options)
        else:
            from tpfuse.kernels.matmul_rs import matmul_reduce_scatter
            y = matmul_reduce_scatter(x, w, group, options=options)
        if backward:
            y.backward(dy)
    return y.detach(), (x.grad, w.grad) if backward else ()


def _comm(op, x, w, dy, backward):
    from tpfuse.parallel.mappings import all_gather_first_dim, reduce_scatter_first_dim

    group = dist.group.WORLD
    if op == "ag":
        gathered = all_gather_first_dim(x, group)
        if backward:
            reduce_scatter_first_dim(gathered, group)
    else:
        reduce_scatter_first_dim(torch.empty(x.shape[:-1] + w.shape[:1], dtype=x.dtype,
                                             device=x.device), group)
        if backward:
            all_gather_first_dim(dy, group)


def _check(op, x, w, dy, modes):
    """Every mode's output and grads against the sequential path (bf16: relative 2e-2)."""
    ref_y, ref_grads = _run(op, x, w, dy, True, "sequential")
    for mode in modes:
        y, grads = _run(op, x, w, dy, True, mode)
        for name, got, want in zip(("y", "dx", "dw"), (y,) + tuple(grads), (ref_y,) + ref_grads):
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            status = "ok" if err < 2e-2 else "MISMATCH"
            if dist.get_rank() == 0:
                print(f"check {op} {mode:>10} {name}: relative error {err:.2e} {status}")
            if status != "ok":
                raise SystemExit(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="s·b")
    parser.add_argument("--hidden", type=int, default=8192, help="h (the MLP is h → 4h → h)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_fused_comm_check: no CUDA device, nothing to check")
        return 0
    _init()
    tp = dist.get_world_size()
    from tpfuse.kernels import symm_mem_ag_matmul
    fused_modes = ["fused"] + (["symm"] if tp > 1 and symm_mem_ag_matmul.available() else [])
    lead = dist.get_rank() == 0
    if lead:
        print(f"tp={tp} on {torch.cuda.get_device_name()}, bf16, s·b={args.tokens}, "
              f"h={args.hidden}, 4h={4 * args.hidden}")
    rows = []
    for op in ("ag", "rs"):
        x, w, dy = _layer(op, args.tokens, args.hidden, tp)
        if tp > 1:
            _check(op, x, w, dy, [m for m in fused_modes if op == "ag" or m == "fused"])
        for backward in (False, True):
            t = {"gemm": _time_ms(lambda: _run(op, x, w, dy, backward, "gemm"))}
            if tp > 1:
                t["comm"] = _time_ms(lambda: _comm(op, x, w, dy, backward))
                modes = ["sequential"] + [m for m in fused_modes
                                          if m == "fused" or (op == "ag" and not backward)]
                for mode in modes:
                    t[mode] = _time_ms(lambda: _run(op, x, w, dy, backward, mode))
            rows.append((op, "fwd+bwd" if backward else "fwd", t))
    if lead:
        _print(rows, tp)
    dist.destroy_process_group()
    return 0


def _print(rows, tp):
    print("\n| op | pass | comm (ms) | GEMM (ms) | sequential (ms) | fused ring (ms) | symm (ms) | "
          "seq/fused | comm hidden (ring) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op, pass_, t in rows:
        cell = lambda k: f"{t[k]:.3f}" if k in t else "–"                  # noqa: E731
        ratio = f"{t['sequential'] / t['fused']:.3f}" if "fused" in t else "–"
        hidden = (f"{100 * (t['comm'] + t['gemm'] - t['fused']) / t['comm']:.0f}%"
                  if "fused" in t else "–")
        print(f"| {op} | {pass_} | {cell('comm')} | {cell('gemm')} | {cell('sequential')} | "
              f"{cell('fused')} | {cell('symm')} | {ratio} | {hidden} |")
    if tp == 1:
        print("\none GPU: no communication exists, so only the GEMMs were timed (nothing emulated).")


if __name__ == "__main__":
    sys.exit(main())
