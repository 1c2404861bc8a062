"""GPU check of the MoE kernels (target: one H200, about a minute): correctness in bf16 against fp32
torch, then speed of the grouped GEMM against a per-expert loop of ``torch.matmul`` (and
``torch._grouped_mm`` where this torch has it), and of token permutation against its torch path.

    python benchmarks/gpu_moe_check.py                # 64 experts, 16K tokens top-8, h 2048, F 1408
    python benchmarks/gpu_moe_check.py --cpu-dry-run  # tiny shapes through Triton's interpreter

Correctness metric: max|ours − ref| / max|ref| ≤ 2e-2 (bf16 keeps 8 bits: a few roundings of
inputs and outputs stay far inside it; a wrong group or row is O(1)). Exit status 0 when every
check passes (or there is no GPU without --cpu-dry-run), 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from tpfuse.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from tpfuse.kernels.moe_permute import permute_tokens, unpermute_tokens

TOLERANCE = 2e-2
SHAPES = {"full": dict(experts=64, tokens=16384, topk=8, hidden=2048, ffn=1408, reps=20),
          "dry": dict(experts=4, tokens=24, topk=2, hidden=32, ffn=48, reps=1)}


def _sizes(experts, rows, gen, device):
    weights = torch.rand(experts, generator=gen) + 0.5             # uneven, like real routing
    sizes = torch.distributions.Multinomial(rows, weights / weights.sum()).sample()
    return [int(n) for n in sizes]


def _time(fn, reps, device):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _rel_err(ours, ref):
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check_grouped_gemm(shape, device, rows):
    gen = torch.Generator().manual_seed(0)
    e, k, n, reps = shape["experts"], shape["hidden"], shape["ffn"], shape["reps"]
    sizes = _sizes(e, shape["tokens"] * shape["topk"], gen, device)
    x = torch.randn(sum(sizes), k, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(e, k, n, generator=gen) / k**0.5).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(sum(sizes), n, generator=gen).to(device, torch.bfloat16)
    y = grouped_gemm(x, w, sizes, backend="triton")
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    y_ref = grouped_gemm_reference(x32, w32, sizes)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, [x32, w32], dy.float())
    for what, ours, ref in (("fwd", y, y_ref), ("dgrad", dx, dx_ref), ("wgrad", dw, dw_ref)):
        err = _rel_err(ours, ref)
        rows.append(("grouped_gemm", what, f"rel err {err:.2e}", "", err <= TOLERANCE))
    flops = 2 * sum(sizes) * k * n

    def loop():
        out, start = [], 0
        for g, m in enumerate(sizes):
            out.append(x[start:start + m] @ w[g])
            start += m
        return torch.cat(out)

    peers = {"triton grouped": lambda: grouped_gemm(x, w, sizes, backend="triton"),
             "loop of matmul": loop}
    if hasattr(torch, "_grouped_mm") and device.type == "cuda":
        offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
        peers["torch._grouped_mm"] = lambda: torch._grouped_mm(x, w, offs=offs)
    times = {}
    with torch.no_grad():
        for name, fn in peers.items():
            try:
                times[name] = _time(fn, reps, device)
            except (RuntimeError, NotImplementedError) as error:   # a peer this build lacks
                rows.append(("grouped_gemm fwd", name, "not run",
                             f"{type(error).__name__}: {str(error).splitlines()[0][:80]}", True))
    for name, t in times.items():
        rows.append(("grouped_gemm fwd", name, f"{flops / t / 1e12:.1f} TFLOP/s",
                     f"{times['loop of matmul'] / t:.2f}× loop", True))

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), [x, w], dy)
    for name in ("triton grouped", "loop of matmul"):
        t = _time(fwd_bwd(peers[name]), reps, device)
        rows.append(("grouped_gemm fwd+bwd", name, f"{3 * flops / t / 1e12:.1f} TFLOP/s", "", True))


def check_permute(shape, device, rows):
    gen = torch.Generator().manual_seed(1)
    t, k, h, reps = shape["tokens"], shape["topk"], shape["hidden"], shape["reps"]
    row_map = torch.randperm(t * k, generator=gen).view(t, k).to(device)
    probs = torch.rand(t, k, generator=gen).to(device)
    x = torch.randn(t, h, generator=gen).to(device, torch.bfloat16)
    for what, fn in (("permute", lambda b: permute_tokens(x, row_map, t * k, backend=b)),
                     ("unpermute", lambda b: unpermute_tokens(
                         permute_tokens(x, row_map, t * k, backend="torch"), row_map, probs,
                         backend=b))):
        err = _rel_err(fn("triton"), fn("torch"))
        ok = err <= TOLERANCE
        moved = 2 * t * k * h * x.element_size()
        times = {b: _time(lambda b=b: fn(b), reps, device) for b in ("triton", "torch")}
        rows.append((what, "triton vs torch path", f"{moved / times['triton'] / 1e9:.0f} GB/s",
                     f"{times['torch'] / times['triton']:.2f}× torch; rel err {err:.1e}", ok))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no GPU: nothing to check (use --cpu-dry-run to exercise the script)")
        return 0
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    shape = SHAPES["dry" if args.cpu_dry_run else "full"]
    rows = []
    check_grouped_gemm(shape, device, rows)
    check_permute(shape, device, rows)
    for section, what, value, extra, ok in rows:
        print(f"{'ok  ' if ok else 'FAIL'} {section:22s} {what:22s} {value:18s} {extra}")
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
