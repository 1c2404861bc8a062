"""The cases of ``gpu_check.py``: each one builds its bf16 inputs once, validates ours against torch
at exactly those shapes (``check`` → {what: relative error}), then is timed on the same tensors
(``timings``), so checking and timing share every kernel specialisation (one compile each)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = {  # training shapes: MLP of a 3072-hidden model over 16K tokens, 32×128 heads at 4K tokens
    "full": {"mlp": (16384, 3072, 12288), "square": 8192, "attn": (4, 32, 8, 4096, 128),
             "rows": (16384, 8192), "ce": (16384, 50304)},
    "quick": {"mlp": (4096, 1536, 6144), "square": 4096, "attn": (2, 16, 4, 2048, 128),
              "rows": (8192, 4096), "ce": (4096, 50304)},
    # the dry run (Triton's interpreter on a CPU): ragged tiny shapes, the first case of each family
    # (``one_per_family``), the launchers' default norm-backward depth only
    "dry": {"mlp": (24, 32, 40), "square": 32, "attn": (1, 2, 1, 33, 16), "rows": (19, 61), "ce": (13, 101),
            "one_per_family": True},
}


@dataclasses.dataclass
class Timing:
    name: str
    ours: Callable
    ref: Callable
    amount: float          # FLOPs or bytes per call
    unit: str              # "flop" | "byte"
    goal: float | None = None


@dataclasses.dataclass
class Case:
    section: str
    name: str
    check: Callable        # () -> {what: relative error}
    timings: list
    grad_to_none: list = dataclasses.field(default_factory=list)
    tensors: list = dataclasses.field(default_factory=list)

    def release(self):
        self.tensors.clear()
        self.grad_to_none.clear()


def _randn(*shape, device, scale=1.0, grad=False):
    return (torch.randn(*shape, device=device) * scale).bfloat16().requires_grad_(grad)


def _err(ours, ref):
    ours, ref = ours.detach().float(), ref.detach().float()
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _grads(out, leaves, grad_out):
    return torch.autograd.grad(out, leaves, grad_out)


# ----------------------------------------------------------------------------- matmul

def matmul_cases(dev, shapes):
    from tpfuse.kernels import matmul
    from tpfuse.kernels.matmul import MatmulOptions
    tokens, hidden, ffn = shapes["mlp"]
    x = _randn(tokens, hidden, device=dev)                        # (M, K)
    w = _randn(ffn, hidden, device=dev, scale=hidden ** -0.5)     # (N, K): the linear layer's weight
    bias = _randn(ffn, device=dev)
    g = _randn(tokens, ffn, device=dev)                           # dL/dy (M, N)
    # the pointer kernel's ragged tiles on a transposed operand: a width that is a multiple of 16 but
    # not of the tile (its rows wrap with a modulo, benchmarks/RESULTS.md "Hopper compile report")
    g_ragged = _randn(tokens, ffn + 16, device=dev)
    pointer = MatmulOptions(kernel="pointer")
    layouts = [  # (name, ours, torch, fp32 exact, n of the (tokens, hidden, n) GEMM)
        ("linear fwd x@wᵀ+b, gelu", lambda: matmul(x, w.t(), bias, "gelu", backend="triton"),
         lambda: F.gelu(torch.addmm(bias, x, w.t())),
         lambda: F.gelu(x.float() @ w.float().t() + bias.float()), ffn),
        ("dgrad g@w", lambda: matmul(g, w, backend="triton"), lambda: g @ w,
         lambda: g.float() @ w.float(), ffn),
        ("wgrad gᵀ@x", lambda: matmul(g.t(), x, backend="triton"), lambda: g.t() @ x,
         lambda: g.float().t() @ x.float(), ffn),
        ("wgrad gᵀ@x, pointer kernel, ragged tiles",
         lambda: matmul(g_ragged.t(), x, backend="triton", options=pointer), lambda: g_ragged.t() @ x,
         lambda: g_ragged.float().t() @ x.float(), ffn + 16),
    ]
    n = shapes["square"]
    a, b = _randn(n, n, device=dev), _randn(n, n, device=dev, scale=n ** -0.5)
    cases = []
    for name, ours, ref, exact, width in layouts:
        what = f"{name} {tokens}x{hidden}x{width}"
        cases.append(Case("matmul bf16", what, lambda o=ours, e=exact: {"out": _err(o(), e())},
                          [Timing(what, ours, ref, 2.0 * tokens * hidden * width, "flop",
                                  goal=None if "pointer" in name else 0.90)],        # (the fallback: no goal)
                          tensors=[x, w, bias, g, g_ragged]))
    what = f"square {n}³"
    cases.append(Case("matmul bf16", what, lambda: {"out": _err(matmul(a, b, backend="triton"), a.float() @ b.float())},
                      [Timing(what, lambda: matmul(a, b, backend="triton"), lambda: a @ b, 2.0 * n ** 3, "flop",
                              goal=0.90)], tensors=[a, b]))
    return cases


# ----------------------------------------------------------------------------- attention

def _sdpa_backend(dev, name="FLASH_ATTENTION"):
    """SDPA restricted to one backend on CUDA (FLASH_ATTENTION or CUDNN_ATTENTION); any on CPU."""
    if dev.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, name))


def _cudnn_runs(dev, q, k, v, causal, gqa) -> bool:
    """Whether SDPA's cuDNN backend runs these inputs (forward and backward) here."""
    if dev.type != "cuda":
        return False
    try:
        with _sdpa_backend(dev, "CUDNN_ATTENTION"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            out.sum().backward()
        for t in (q, k, v):
            t.grad = None
        return True
    except (RuntimeError, AttributeError, NotImplementedError):   # "No available kernel", ...
        for t in (q, k, v):
            t.grad = None
        return False


def attention_cases(dev, shapes):
    from tpfuse.kernels import flash_attention
    b, h, h_kv_gqa, s, d = shapes["attn"]
    cases = []
    for causal, h_kv in ((True, h_kv_gqa), (True, h), (False, h)):
        q = _randn(b, h, s, d, device=dev, grad=True)
        k, v = _randn(b, h_kv, s, d, device=dev, grad=True), _randn(b, h_kv, s, d, device=dev, grad=True)
        dy = _randn(b, h, s, d, device=dev)
        what = f"b{b} h{h}/{h_kv} s{s} d{d} {'causal' if causal else 'full'}"
        ours = lambda q=q, k=k, v=v, c=causal: flash_attention(q, k, v, causal=c, backend="triton")  # noqa: E731
        gqa = h_kv != h

        def ref(q=q, k=k, v=v, c=causal, gqa=gqa, backend="FLASH_ATTENTION"):
            with _sdpa_backend(dev, backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=gqa)

        def cudnn(q=q, k=k, v=v, c=causal, gqa=gqa):
            return ref(q, k, v, c, gqa, backend="CUDNN_ATTENTION")

        def check(q=q, k=k, v=v, dy=dy, c=causal, ours=ours):
            out = ours()
            exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=c, enable_gqa=True)
            errs = {"fwd": _err(out, exact)}
            for name, mine, want in zip(("dq", "dk", "dv"), _grads(out, [q, k, v], dy),
                                        _grads(exact, [q, k, v], dy.float())):
                errs[name] = _err(mine, want)
            return errs

        fwd_flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        fwd_bwd = lambda f, dy=dy: f().backward(dy)  # noqa: E731
        timings = [Timing(f"{what} fwd", lambda o=ours: _no_grad(o), lambda r=ref: _no_grad(r), fwd_flops, "flop", 1.0),
                   # backward = 5 GEMMs vs forward's 2 → fwd+bwd = 3.5 × forward
                   Timing(f"{what} fwd+bwd", lambda o=ours: fwd_bwd(o), lambda r=ref: fwd_bwd(r), 3.5 * fwd_flops,
                          "flop", 0.80)]
        if _cudnn_runs(dev, q, k, v, causal, gqa):      # the same two against the cuDNN backend
            timings += [Timing(f"{what} fwd vs cuDNN", lambda o=ours: _no_grad(o),
                               lambda r=cudnn: _no_grad(r), fwd_flops, "flop", 1.0),
                        Timing(f"{what} fwd+bwd vs cuDNN", lambda o=ours: fwd_bwd(o),
                               lambda r=cudnn: fwd_bwd(r), 3.5 * fwd_flops, "flop", 0.80)]
        cases.append(Case("flash_attention", what, check, timings, grad_to_none=[q, k, v], tensors=[q, k, v, dy]))
    return cases


def _no_grad(fn):
    with torch.no_grad():
        return fn()


# ----------------------------------------------------------------------------- row-wise ops

def row_cases(dev, shapes):
    from tpfuse.kernels import bias_dropout_add, layer_norm, rms_norm
    rows, width = shapes["rows"]
    x = _randn(rows, width, device=dev, scale=2.0, grad=True)
    w, b = _randn(width, device=dev, grad=True), _randn(width, device=dev, grad=True)
    dy, residual = _randn(rows, width, device=dev), _randn(rows, width, device=dev)
    nbytes = x.element_size() * rows * width
    rms_torch = getattr(F, "rms_norm", None)

    def rms_exact(xx, ww):
        xf = xx.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * ww.float()

    norms = {
        "layer_norm": (lambda: layer_norm(x, w, b, 1e-5, backend="triton"), lambda: F.layer_norm(x, (width,), w, b, 1e-5),
                       lambda: F.layer_norm(x.float(), (width,), w.float(), b.float(), 1e-5), [x, w, b]),
        "rms_norm": (lambda: rms_norm(x, w, 1e-5, backend="triton"), lambda: rms_torch(x, (width,), w, 1e-5),
                     lambda: rms_exact(x, w), [x, w]),
    }
    cases = []
    for name, (ours, ref, exact, leaves) in norms.items():
        def check(ours=ours, exact=exact, leaves=leaves):
            out, want = ours(), exact()
            errs = {"fwd": _err(out, want)}
            for i, (mine, good) in enumerate(zip(_grads(out, leaves, dy), _grads(want, leaves, dy.float()))):
                errs[("dx", "dw", "db")[i]] = _err(mine, good)
            return errs
        # fwd: read x, write y; fwd+bwd adds read x, dy, write dx: 5 passes over (rows, width)
        timings = [Timing(f"{rows}x{width} fwd", lambda o=ours: _no_grad(o), lambda r=ref: _no_grad(r), 2 * nbytes, "byte"),
                   Timing(f"{rows}x{width} fwd+bwd", lambda o=ours: o().backward(dy), lambda r=ref: r().backward(dy),
                          5 * nbytes, "byte")]
        cases.append(Case(name, f"{rows}x{width}", check, timings, grad_to_none=[x, w, b]))

    p, seed = 0.1, 1234

    def bda_check():
        ones, zeros = torch.ones_like(x), torch.zeros_like(residual)
        keep = (bias_dropout_add(ones, None, zeros, p, True, seed, backend="triton") != 0).float()
        out = bias_dropout_add(x, b, residual, p, True, seed, backend="triton")
        want = residual.float() + keep * (x.float() + b.float()) / (1 - p)
        kept, count = keep.mean().item(), keep.numel()
        sigmas = abs(kept - (1 - p)) * count / (count * p * (1 - p)) ** 0.5   # binomial deviation
        return {"fwd": _err(out, want), "dx": _err(_grads(out, [x], dy)[0], keep * dy.float() / (1 - p)),
                "keep fraction (0 if within 5 sigma)": 0.0 if sigmas <= 5 else float("inf")}

    timings = [Timing(f"{rows}x{width} fwd p={p}",
                      lambda: _no_grad(lambda: bias_dropout_add(x, b, residual, p, True, seed, backend="triton")),
                      lambda: _no_grad(lambda: residual + F.dropout(x + b, p, training=True)), 3 * nbytes, "byte")]
    cases.append(Case("bias_dropout_add", f"{rows}x{width}", bda_check, timings, tensors=[x, w, b, dy, residual]))
    return cases


def cross_entropy_cases(dev, shapes):
    from tpfuse.kernels import cross_entropy
    n, vocab = shapes["ce"]
    logits = _randn(n, vocab, device=dev, scale=3.0, grad=True)
    target = torch.randint(0, vocab, (n,), device=dev)
    target[::7] = -100
    grad_loss = torch.rand(n, device=dev)
    ours = lambda: cross_entropy(logits, target, backend="triton")  # noqa: E731
    ref = lambda: F.cross_entropy(logits, target, reduction="none")  # noqa: E731

    def check():
        loss, want = ours(), F.cross_entropy(logits.float(), target, reduction="none")
        return {"loss": _err(loss, want),
                "dlogits": _err(_grads(loss, [logits], grad_loss)[0], _grads(want, [logits], grad_loss)[0])}

    nbytes = logits.numel() * logits.element_size()
    timings = [Timing(f"{n}x{vocab} fwd", lambda: _no_grad(ours), lambda: _no_grad(ref), nbytes, "byte"),
               # fwd reads the logits; bwd reads them again and writes dlogits
               Timing(f"{n}x{vocab} fwd+bwd", lambda: ours().backward(grad_loss),
                      lambda: ref().float().backward(grad_loss), 3 * nbytes, "byte")]
    return [Case("cross_entropy", f"{n}x{vocab}", check, timings, grad_to_none=[logits])]


def all_cases(dev, shapes):
    """Built lazily, family by family, so one family's tensors are freed before the next's; with
    ``shapes["one_per_family"]`` only the first case of each section (matmul: the linear forward
    with its bias + gelu epilogue; attention: causal GQA)."""
    seen = set()
    for family in (matmul_cases, attention_cases, row_cases, cross_entropy_cases):
        for case in family(dev, shapes):
            if shapes.get("one_per_family") and case.section in seen:
                continue
            seen.add(case.section)
            yield case


# ----------------------------------------------------------------------------- variants

def norm_backward_variants(dev, shapes):
    """{group: [(label, fn, bytes)]}: the norm backward (kernel + dw/db partial sums, no autograd)
    at each row-loop pipelining depth, to see on the GPU which depth the launchers should pick.
    Bytes: read x and dy, write dx (the partial sums are not counted)."""
    import importlib
    ln, rms = (importlib.import_module(f"tpfuse.kernels.{name}") for name in ("layer_norm", "rms_norm"))
    rows, width = shapes["rows"]
    x = _randn(rows, width, device=dev, scale=2.0)
    dy = _randn(rows, width, device=dev)
    w, b = _randn(width, device=dev), _randn(width, device=dev)
    _, mean, rstd = ln.layer_norm_fwd_triton(x, w, b, 1e-5)
    _, rms_rstd = rms.rms_norm_fwd_triton(x, w, 1e-5)
    nbytes = 3 * x.numel() * x.element_size()
    groups = {}
    for name, run in (("layer_norm bwd", lambda s: ln.layer_norm_bwd_triton(dy, x, w, mean, rstd, stages=s)),
                      ("rms_norm bwd", lambda s: rms.rms_norm_bwd_triton(dy, x, w, rms_rstd, stages=s))):
        groups[f"{name} {rows}x{width}"] = [
            (f"row stages={s}" + (" (default)" if s == ln.BWD_STAGES else ""), lambda s=s, run=run: run(s), nbytes)
            for s in ((ln.BWD_STAGES,) if shapes.get("one_per_family") else (2, 3, 4))]
    return groups


def autotuner_choices():
    """(kernel, chosen config) of the autotuned row-wise kernels after the cases ran them."""
    import importlib
    ce = importlib.import_module("tpfuse.kernels.cross_entropy")
    out = []
    for kernel in (ce._shard_stats_kernel, ce._shard_grad_kernel):
        for key, config in getattr(kernel, "cache", {}).items():
            chosen = ", ".join(f"{k}={v}" for k, v in config.kwargs.items())
            out.append((f"cross_entropy.{kernel.fn.__name__} (V={key[0]})",
                        f"{chosen}, warps={config.num_warps}"))
    return out
