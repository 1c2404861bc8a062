"""One-command GPU check of tpfuse.kernels (target: one H200, < 5 minutes): correctness of every op
in bf16 against torch, then speed against torch, printed as one table.

    python benchmarks/gpu_check.py                 # full shapes
    python benchmarks/gpu_check.py --quick         # smaller shapes (about a minute)
    python benchmarks/gpu_check.py --cpu-dry-run   # tiny shapes on CPU through Triton's interpreter:
                                                   # exercises this script without a GPU

Correctness: each op's Triton path (backend="triton") on bf16 inputs against torch in fp32 on the same
bf16 inputs, forward and every gradient; the metric is max|ours − torch| / max|torch|, which must stay
≤ 2e-2 (bf16 keeps 8 bits: one rounding is ≤ 3.9e-3 relative; a few roundings of inputs, outputs and
16-bit intermediates fit well inside 2e-2, a wrong result does not).
Speed: matmul TFLOP/s vs torch.matmul (goal ≥ 0.90×), flash_attention fwd+bwd TFLOP/s vs SDPA's flash
backend (goal ≥ 0.80×), layer_norm / rms_norm / cross_entropy / bias_dropout_add GB/s vs torch.
Exit status: 0 when every check passes (or there is no GPU), 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

TOLERANCE = 2e-2
TIME_BUDGET_S = 270.0  # stop starting new sections past this, to stay inside 5 minutes

# Compile time dominates a cold run (every autotune config of every kernel specialisation is built):
# the full check's GEMM is a multiple of 16 but of no tile size (masked tails, and its backward GEMMs
# reuse the speed run's specialisation); --quick and the CPU tests cover shapes that are not.
SHAPES = {  # name: (correctness shapes, speed shapes)
    "full": {
        "mm_check": (1008, 1040, 1104), "mm_acts": ("gelu",), "mm_speed": [(8192, 8192, 8192), (16384, 12288, 3072)],
        "attn_check": (2, 8, 2, 1000, 128), "attn_speed": (4, 32, 32, 4096, 128),
        "rows_check": (4097, 1031), "rows_speed": (16384, 8192),
        "ce_check": (1000, 50304), "ce_speed": (16384, 50304),
    },
    "quick": {
        "mm_check": (257, 263, 269), "mm_acts": ("gelu", None), "mm_speed": [(4096, 4096, 4096), (8192, 6144, 1536)],
        "attn_check": (1, 4, 2, 257, 64), "attn_speed": (2, 16, 16, 2048, 128),
        "rows_check": (1031, 517), "rows_speed": (8192, 4096),
        "ce_check": (257, 5003), "ce_speed": (4096, 50304),
    },
    "dry": {
        "mm_check": (37, 53, 61), "mm_acts": ("gelu", None), "mm_speed": [(64, 64, 64)],
        "attn_check": (1, 2, 1, 67, 16), "attn_speed": (1, 2, 2, 64, 16),
        "rows_check": (67, 61), "rows_speed": (64, 128),
        "ce_check": (37, 101), "ce_speed": (64, 512),
    },
}


class Report:
    """Collects table rows: (section, what, ours, torch, ratio / error, status)."""

    def __init__(self):
        self.rows, self.failed, self.start = [], False, time.perf_counter()

    def add(self, section, what, ours="", ref="", value="", status="", bad=False):
        self.rows.append((section, what, ours, ref, value, status))
        self.failed |= bad

    def check(self, section, what, err):
        ok = math.isfinite(err) and err <= TOLERANCE
        self.add(section, what, "", "", f"{err:.2e}", "PASS" if ok else "FAIL", bad=not ok)

    def elapsed(self):
        return time.perf_counter() - self.start

    def print(self, header):
        cols = ("section", "what", "ours", "torch", "err / ratio", "status")
        rows = [cols] + [tuple(str(c) for c in r) for r in self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        line = "-+-".join("-" * w for w in widths)
        print(f"\n{header}\n{line}")
        for i, r in enumerate(rows):
            print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
            if i == 0:
                print(line)
        print(line)


def rel_err(ours, ref):
    ours, ref = ours.detach().float(), ref.detach().float()
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def grads_of(out, leaves, grad_out):
    return torch.autograd.grad(out, leaves, grad_out)


def make_timer(device):
    """ms per call: triton's do_bench (median) on GPU, a short perf_counter loop on CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn, grad_to_none=None: triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                                                     return_mode="median")

    def cpu_time(fn, grad_to_none=None):
        fn()
        start = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - start) / 2 * 1e3
    return cpu_time


def randn(*shape, device, scale=1.0, requires_grad=False):
    return (torch.randn(*shape, device=device) * scale).bfloat16().requires_grad_(requires_grad)


# ----------------------------------------------------------------------------- correctness (bf16)

def check_matmul(rep, dev, shapes):
    from tpfuse.kernels import matmul
    M, N, K = shapes["mm_check"]
    a = randn(M, K, device=dev, requires_grad=True)
    w = randn(N, K, device=dev, scale=K**-0.5, requires_grad=True)  # linear layer: a @ wᵀ
    bias = randn(N, device=dev, requires_grad=True)
    dy = randn(M, N, device=dev)
    for act in shapes["mm_acts"]:
        ours = matmul(a, w.t(), bias, act, backend="triton")
        ref_z = a.float() @ w.float().t() + bias.float()
        ref = F.gelu(ref_z) if act else ref_z
        what = f"{M}x{N}x{K} bias+{act or 'none'}"
        rep.check("matmul", f"{what} fwd", rel_err(ours, ref))
        for name, g, g_ref in zip(("da", "dw", "dbias"), grads_of(ours, [a, w, bias], dy),
                                  grads_of(ref, [a, w, bias], dy.float())):
            rep.check("matmul", f"{what} {name}", rel_err(g, g_ref))


def check_norms(rep, dev, shapes):
    from tpfuse.kernels import layer_norm, rms_norm
    rows, width = shapes["rows_check"]
    x = randn(rows, width, device=dev, scale=2.0, requires_grad=True)
    w, b = randn(width, device=dev, requires_grad=True), randn(width, device=dev, requires_grad=True)
    dy = randn(rows, width, device=dev)
    ours = layer_norm(x, w, b, 1e-5, backend="triton")
    ref = F.layer_norm(x.float(), (width,), w.float(), b.float(), 1e-5)
    rep.check("layer_norm", f"{rows}x{width} fwd", rel_err(ours, ref))
    for name, g, g_ref in zip(("dx", "dw", "db"), grads_of(ours, [x, w, b], dy), grads_of(ref, [x, w, b], dy.float())):
        rep.check("layer_norm", f"{rows}x{width} {name}", rel_err(g, g_ref))
    ours = rms_norm(x, w, 1e-5, backend="triton")
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    rep.check("rms_norm", f"{rows}x{width} fwd", rel_err(ours, ref))
    for name, g, g_ref in zip(("dx", "dw"), grads_of(ours, [x, w], dy), grads_of(ref, [x, w], dy.float())):
        rep.check("rms_norm", f"{rows}x{width} {name}", rel_err(g, g_ref))


def check_attention(rep, dev, shapes):
    from tpfuse.kernels import flash_attention
    b, h, h_kv, s, d = shapes["attn_check"]
    q = randn(b, h, s, d, device=dev, requires_grad=True)
    k, v = randn(b, h_kv, s, d, device=dev, requires_grad=True), randn(b, h_kv, s, d, device=dev, requires_grad=True)
    dy = randn(b, h, s, d, device=dev)
    ours = flash_attention(q, k, v, causal=True, backend="triton")
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    what = f"b{b} h{h}/{h_kv} s{s} d{d} causal"
    rep.check("flash_attention", f"{what} fwd", rel_err(ours, ref))
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads_of(ours, [q, k, v], dy), grads_of(ref, [q, k, v], dy.float())):
        rep.check("flash_attention", f"{what} {name}", rel_err(g, g_ref))


def check_cross_entropy(rep, dev, shapes):
    from tpfuse.kernels import cross_entropy
    n, vocab = shapes["ce_check"]
    logits = randn(n, vocab, device=dev, scale=3.0, requires_grad=True)
    target = torch.randint(0, vocab, (n,), device=dev)
    target[::7] = -100  # ignored rows
    ours = cross_entropy(logits, target, backend="triton")
    ref = F.cross_entropy(logits.float(), target, ignore_index=-100, reduction="none")
    rep.check("cross_entropy", f"{n}x{vocab} loss", rel_err(ours, ref))
    grad_loss = torch.rand(n, device=dev)
    rep.check("cross_entropy", f"{n}x{vocab} dlogits",
              rel_err(grads_of(ours, [logits], grad_loss)[0], grads_of(ref, [logits], grad_loss)[0]))


def check_bias_dropout_add(rep, dev, shapes):
    from tpfuse.kernels import bias_dropout_add
    rows, width = shapes["rows_check"]
    x, residual = randn(rows, width, device=dev, requires_grad=True), randn(rows, width, device=dev)
    bias = randn(width, device=dev)
    ours = bias_dropout_add(x, bias, residual, 0.1, False, backend="triton")
    rep.check("bias_dropout_add", "eval: residual + x + bias", rel_err(ours, residual.float() + (x.float() + bias.float())))
    p, seed = 0.1, 1234
    ones, zeros = torch.ones_like(x), torch.zeros_like(residual)
    probe = bias_dropout_add(ones, None, zeros, p, True, seed, backend="triton").float()  # 1/(1-p) or 0
    keep = (probe != 0).float()
    n = keep.numel()
    kept_fraction_sigmas = abs(keep.sum().item() - n * (1 - p)) / math.sqrt(n * p * (1 - p))
    scaled = (probe[probe != 0] * (1 - p) - 1).abs().max().item() < 1e-2  # kept values scaled by 1/(1-p)
    ok = kept_fraction_sigmas <= 5 and scaled
    rep.add("bias_dropout_add", f"keep fraction (p={p})", "", "", f"{kept_fraction_sigmas:.1f} sigma",
            "PASS" if ok else "FAIL", bad=not ok)
    ours = bias_dropout_add(x, bias, residual, p, True, seed, backend="triton")
    ref = residual.float() + keep * (x.float() + bias.float()) / (1 - p)
    rep.check("bias_dropout_add", "train fwd (same mask)", rel_err(ours, ref))
    dy = randn(rows, width, device=dev)
    rep.check("bias_dropout_add", "train dx (same mask)", rel_err(grads_of(ours, [x], dy)[0], keep * dy.float() / (1 - p)))


# ----------------------------------------------------------------------------- speed

def speed_row(rep, section, what, ours_ms, torch_ms, unit_amount, unit, goal=None):
    """unit_amount: FLOPs or bytes per call → rate in T{unit}/s or G{unit}/s."""
    scale, suffix = (1e12, "TFLOP/s") if unit == "flop" else (1e9, "GB/s")
    ours_rate, torch_rate = unit_amount / (ours_ms * 1e-3) / scale, unit_amount / (torch_ms * 1e-3) / scale
    ratio = ours_rate / torch_rate
    status = "" if goal is None else (f"goal ≥ {goal:.2f}: " + ("met" if ratio >= goal else "missed"))
    rep.add(section, what, f"{ours_rate:.4g} {suffix}", f"{torch_rate:.4g} {suffix}", f"{ratio:.2f}x", status)


def speed_matmul(rep, dev, shapes, timer):
    from tpfuse.kernels import matmul
    for M, N, K in shapes["mm_speed"]:
        a, b = randn(M, K, device=dev), randn(K, N, device=dev, scale=K**-0.5)
        with torch.no_grad():
            ours = timer(lambda: matmul(a, b, backend="triton"))
            ref = timer(lambda: torch.matmul(a, b))
        speed_row(rep, "matmul bf16", f"{M}x{N}x{K}", ours, ref, 2.0 * M * N * K, "flop", goal=0.90)
        best = getattr(sys.modules["tpfuse.kernels.matmul"]._matmul_kernel, "best_config", None)
        if best is not None and dev.type == "cuda":  # the autotuner's pick, for reading the numbers
            tile = "x".join(str(best.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            rep.add("matmul bf16", f"  tuned tile {tile}, {best.num_stages} stages, {best.num_warps} warps")
        del a, b


def _sdpa_flash_context(dev):
    if dev.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def speed_attention(rep, dev, shapes, timer):
    from tpfuse.kernels import flash_attention
    b, h, h_kv, s, d = shapes["attn_speed"]
    q = randn(b, h, s, d, device=dev, requires_grad=True)
    k, v = randn(b, h_kv, s, d, device=dev, requires_grad=True), randn(b, h_kv, s, d, device=dev, requires_grad=True)
    dy = randn(b, h, s, d, device=dev)
    fwd_flops = 4.0 * b * h * s * s * d / 2  # two GEMMs of 2·s·s·d per head, half of them masked (causal)
    ours_fn = lambda: flash_attention(q, k, v, causal=True, backend="triton")  # noqa: E731
    ref_fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    what = f"b{b} h{h} s{s} d{d} causal"
    with _sdpa_flash_context(dev):
        with torch.no_grad():
            ours, ref = timer(ours_fn), timer(ref_fn)
        speed_row(rep, "flash_attention", f"{what} fwd", ours, ref, fwd_flops, "flop")
        ours = timer(lambda: ours_fn().backward(dy), grad_to_none=[q, k, v])
        ref = timer(lambda: ref_fn().backward(dy), grad_to_none=[q, k, v])
    # backward = 5 GEMMs vs forward's 2 → fwd+bwd = 3.5 × forward
    speed_row(rep, "flash_attention", f"{what} fwd+bwd", ours, ref, 3.5 * fwd_flops, "flop", goal=0.80)


def speed_rows(rep, dev, shapes, timer):
    """layer_norm, rms_norm, bias_dropout_add: bytes moved / time (fwd: read x, write y)."""
    from tpfuse.kernels import bias_dropout_add, layer_norm, rms_norm
    rows, width = shapes["rows_speed"]
    x = randn(rows, width, device=dev, requires_grad=True)
    w, b = randn(width, device=dev, requires_grad=True), randn(width, device=dev, requires_grad=True)
    dy, residual = randn(rows, width, device=dev), randn(rows, width, device=dev)
    elem = x.element_size() * rows * width
    rms_torch = getattr(F, "rms_norm", None)
    cases = {
        "layer_norm": (lambda: layer_norm(x, w, b, 1e-5, backend="triton"),
                       lambda: F.layer_norm(x, (width,), w, b, 1e-5)),
        "rms_norm": (lambda: rms_norm(x, w, 1e-5, backend="triton"),
                     lambda: rms_torch(x, (width,), w, 1e-5)),
    }
    for name, (ours_fn, ref_fn) in cases.items():
        with torch.no_grad():
            speed_row(rep, name, f"{rows}x{width} fwd", timer(ours_fn), timer(ref_fn), 2 * elem, "byte")
        # fwd (read x, write y) + bwd (read x, dy; write dx): 5 passes over (rows, width)
        ours = timer(lambda: ours_fn().backward(dy), grad_to_none=[x, w, b])
        ref = timer(lambda: ref_fn().backward(dy), grad_to_none=[x, w, b])
        speed_row(rep, name, f"{rows}x{width} fwd+bwd", ours, ref, 5 * elem, "byte")
    with torch.no_grad():  # read x, residual; write out
        ours = timer(lambda: bias_dropout_add(x, b, residual, 0.1, True, 7, backend="triton"))
        ref = timer(lambda: residual + F.dropout(x + b, 0.1, training=True))
    speed_row(rep, "bias_dropout_add", f"{rows}x{width} fwd p=0.1", ours, ref, 3 * elem, "byte")


def speed_cross_entropy(rep, dev, shapes, timer):
    from tpfuse.kernels import cross_entropy
    n, vocab = shapes["ce_speed"]
    logits = randn(n, vocab, device=dev, scale=3.0, requires_grad=True)
    target = torch.randint(0, vocab, (n,), device=dev)
    grad_loss = torch.ones(n, device=dev)
    ours_fn = lambda: cross_entropy(logits, target, backend="triton")  # noqa: E731
    ref_fn = lambda: F.cross_entropy(logits, target, reduction="none")  # noqa: E731
    logit_bytes = logits.numel() * logits.element_size()
    with torch.no_grad():
        speed_row(rep, "cross_entropy", f"{n}x{vocab} fwd", timer(ours_fn), timer(ref_fn), logit_bytes, "byte")
    ours = timer(lambda: ours_fn().backward(grad_loss), grad_to_none=[logits])
    ref = timer(lambda: ref_fn().float().backward(grad_loss), grad_to_none=[logits])
    # fwd reads the logits; bwd reads them again and writes dlogits
    speed_row(rep, "cross_entropy", f"{n}x{vocab} fwd+bwd", ours, ref, 3 * logit_bytes, "byte")


# ----------------------------------------------------------------------------- main

SECTIONS = [
    ("correctness", check_matmul), ("correctness", check_norms), ("correctness", check_attention),
    ("correctness", check_cross_entropy), ("correctness", check_bias_dropout_add),
    ("speed", speed_matmul), ("speed", speed_attention), ("speed", speed_rows), ("speed", speed_cross_entropy),
]


def run_sections(rep, dev, shapes, timer):
    for kind, section in SECTIONS:
        name = section.__name__
        if rep.elapsed() > TIME_BUDGET_S:
            rep.add(name, "skipped: time budget spent", status="SKIPPED", bad=True)
            continue
        started = time.perf_counter()
        try:
            section(rep, dev, shapes) if kind == "correctness" else section(rep, dev, shapes, timer)
        except Exception as exc:  # one broken op must not hide the others' results
            traceback.print_exc()
            rep.add(name, f"error: {type(exc).__name__}: {exc}"[:120], status="ERROR", bad=True)
        print(f"[gpu_check] {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        dev, mode = torch.device("cpu"), "dry"
    elif not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to measure. Run it on a GPU "
              "(or pass --cpu-dry-run to exercise the script through Triton's interpreter).")
        return 0
    else:
        dev, mode = torch.device("cuda"), "quick" if args.quick else "full"
    torch.manual_seed(0)
    rep = Report()
    run_sections(rep, dev, SHAPES[mode], make_timer(dev))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (interpreter dry run)"
    header = (f"tpfuse gpu_check ({mode}) on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{rep.elapsed():.0f} s; correctness metric max|ours-torch|/max|torch| ≤ {TOLERANCE}")
    rep.print(header)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
