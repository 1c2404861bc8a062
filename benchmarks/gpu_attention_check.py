"""GPU check of flash_attention's masks: correctness of every mask rule in bf16, then document-masked
(packed) and sliding-window attention timed against the unmasked causal kernel, and the atomic-dQ
backward against the deterministic one.

    python benchmarks/gpu_attention_check.py                # H100/H200 shapes (a few minutes on a cold cache)
    python benchmarks/gpu_attention_check.py --cpu-dry-run  # tiny shapes through Triton's interpreter

Correctness: the Triton path on bf16 inputs against ``attention_reference`` in fp32 on the same inputs,
forward and dq, dk, dv; max|ours − ref| / max|ref| ≤ 2e-2 (bf16 keeps 8 bits: a few roundings of inputs,
P and dS fit well inside, a wrong mask does not). Speed: milliseconds per call (triton's do_bench median)
and the ratio to the unmasked causal kernel on the same tensors — a packed batch of documents visits only
the tiles inside documents, so it should take a fraction of the unmasked time (the FLOP fraction is printed
beside it). Decoding: one s_q = 1 step over a KV cache's strided views, against SDPA. Exit status 1 when a
check fails.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

TOLERANCE = 2e-2
SHAPES = {  # (b, heads, kv_heads, s, d, mean document length, window); deterministic: the masks whose
    # deterministic backward is checked too (the dry run, through Triton's interpreter: causal only)
    "gpu": dict(check=(2, 8, 2, 1000, 128, 150, 200), speed=(4, 16, 4, 8192, 128, 1024, 1024),
                deterministic=None),
    "dry": dict(check=(1, 2, 1, 33, 16, 10, 7), speed=(1, 2, 1, 32, 16, 8, 8), deterministic=("causal",)),
}


def packed_ids(b, s, mean, device, seed=0):
    """(b, s) ids of documents with lengths uniform in [mean/2, 3·mean/2], packed back to back."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(mean // 2, 3 * mean // 2 + 1, (s,), generator=gen) for _ in range(b))
    rows = [torch.repeat_interleave(torch.arange(s), row_lengths)[:s] for row_lengths in lengths]
    return torch.stack(rows).to(device)


def mask_cases(b, s, mean, window, device):
    ids = packed_ids(b, s, mean, device)
    half = s // 2
    return {  # name: (first query row: the queries are rows [first, s) of the sequence, mask keywords)
        "causal": (0, dict()),
        "full": (0, dict(causal=False)),
        "window": (0, dict(window_size=window)),
        "documents": (0, dict(q_document_ids=ids, k_document_ids=ids)),
        "documents+window": (0, dict(q_document_ids=ids, k_document_ids=ids, window_size=window)),
        "query chunk after keys": (half, dict(q_offset=half, q_document_ids=ids[:, half:], k_document_ids=ids)),
        "decode": (s - 1, dict(q_offset=s - 1)),
    }


def rel_err(ours, ref):
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def inputs(b, h, h_kv, s, d, device):
    """q, k, v (leaves) and dO, bf16."""
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device=device, generator=gen).bfloat16().requires_grad_()  # noqa: E731
    return make(b, h, s, d), make(b, h_kv, s, d), make(b, h_kv, s, d), make(b, h, s, d).detach()


def check(device, shape, rows, deterministic_masks=None):
    """Every mask, with the atomic-dQ backward and (for ``deterministic_masks``, default all) the
    deterministic one."""
    from tpfuse.kernels.flash_attention import attention_reference, flash_attention
    b, h, h_kv, s, d, mean, window = shape
    failed = False
    for name, (first, kw) in mask_cases(b, s, mean, window, device).items():
        q, k, v, dy = inputs(b, h, h_kv, s, d, device)
        q, dy = q.detach()[:, :, first:].requires_grad_(), dy[:, :, first:]
        both = deterministic_masks is None or name in deterministic_masks
        for deterministic in ((False, True) if both else (False,)):
            ours = flash_attention(q, k, v, backend="triton", deterministic=deterministic, **kw)
            ref = attention_reference(q.float(), k.float(), v.float(), **kw)
            grads = torch.autograd.grad(ours, (q, k, v), dy)
            ref_grads = torch.autograd.grad(ref, (q, k, v), dy.float())
            errors = [rel_err(ours, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
            bad = max(errors) > TOLERANCE or any(e != e for e in errors)
            failed |= bad
            rows.append((f"{name}{' (deterministic)' if deterministic else ''}", "out dq dk dv rel err",
                         " ".join(f"{e:.1e}" for e in errors), "FAIL" if bad else "PASS"))
    return failed


def visible_fraction(kw, b, s_q, s, device):
    """The fraction of (query, key) pairs the mask keeps: the work a kernel that skips the rest does."""
    from tpfuse.kernels.flash_attention_mask import build_mask
    dummy_q, dummy_k = torch.empty(b, 1, s_q, 1, device=device), torch.empty(b, 1, s, 1, device=device)
    keywords = {key: value for key, value in kw.items() if key != "causal"}
    mask = build_mask(dummy_q, dummy_k, kw.get("causal", True), **keywords)
    return mask.visible(s_q, s, device).float().mean().item()


def speed(device, shape, rows, timer):
    from tpfuse.kernels.flash_attention import flash_attention
    b, h, h_kv, s, d, mean, window = shape
    q, k, v, dy = inputs(b, h, h_kv, s, d, device)
    cases = {name: kw for name, (first, kw) in mask_cases(b, s, mean, window, device).items() if first == 0}
    times = {}
    for name, kw in cases.items():
        for deterministic in ((False, True) if name == "causal" else (False,)):
            fn = lambda: flash_attention(q, k, v, backend="triton", deterministic=deterministic, **kw)  # noqa: E731
            with torch.no_grad():
                fwd = timer(fn)
            both = timer(lambda: fn().backward(dy), grad_to_none=[q, k, v])
            times[name, deterministic] = (fwd, both)
    base_fwd, base_both = times["causal", False]
    causal_fraction = visible_fraction({}, b, s, s, device)
    for (name, deterministic), (fwd, both) in times.items():
        flops = visible_fraction(cases[name], b, s, s, device) / causal_fraction
        rows.append((f"{name}{' (deterministic bwd)' if deterministic else ''}",
                     f"fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms",
                     f"vs causal: fwd {fwd / base_fwd:.2f}x, fwd+bwd {both / base_both:.2f}x",
                     f"visible pairs {flops:.2f}x causal's"))


def decode_speed(device, shape, rows, timer):
    """One decode step (s_q = 1 at q_offset = s − 1) over a KV cache of s keys stored as the model's
    cache is, a (b_max, kv_heads, S, d) buffer sliced to its first s positions, against SDPA on the same
    views (``enable_gqa``; no mask needed: the one query sees every cached key)."""
    import torch.nn.functional as F

    from tpfuse.kernels.flash_attention import flash_attention
    from tpfuse.kernels.flash_attention_fwd import attention_forward_triton
    from tpfuse.kernels.flash_attention_mask import build_mask
    b, h, h_kv, s, d, _, window = shape
    gen = torch.Generator(device=device).manual_seed(1)
    cache = torch.randn(2, b, h_kv, s + 64, d, device=device, generator=gen).bfloat16()
    k, v = cache[0, :, :, :s], cache[1, :, :, :s]                          # strided views of the cache
    q = torch.randn(b, h, 1, d, device=device, generator=gen).bfloat16()
    with torch.no_grad():
        ours = flash_attention(q, k, v, q_offset=s - 1, backend="triton")
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        error = rel_err(ours, ref)
        t_ours = timer(lambda: flash_attention(q, k, v, q_offset=s - 1, backend="triton"))
        t_sdpa = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        t_window = timer(lambda: flash_attention(q, k, v, q_offset=s - 1, window_size=window, backend="triton"))
        mask = build_mask(q, k, True, q_offset=s - 1)      # the tiled forward kernel on the same step
        t_tiled = timer(lambda: attention_forward_triton(q, k, v, mask, d ** -0.5))
    rows.append((f"decode step b{b} h{h}/{h_kv} cache {s}", f"ours (split keys) {t_ours:.4f} ms, tiled fwd "
                 f"kernel {t_tiled:.4f} ms, SDPA {t_sdpa:.4f} ms, window {window}: {t_window:.4f} ms",
                 f"SDPA / ours {t_sdpa / t_ours:.2f}x, tiled / ours {t_tiled / t_ours:.2f}x (rel err {error:.1e})",
                 "FAIL" if error > TOLERANCE or error != error else "PASS"))
    return error > TOLERANCE or error != error


def make_timer(device):
    if device.type == "cuda":
        import triton.testing
        return lambda fn, grad_to_none=None: triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                                                     return_mode="median")

    def cpu_time(fn, grad_to_none=None):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return cpu_time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no GPU: nothing to check (use --cpu-dry-run to exercise the script)")
        return 0
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    shapes = SHAPES["dry" if args.cpu_dry_run else "gpu"]
    rows = []
    failed = check(device, shapes["check"], rows, shapes["deterministic"])
    speed(device, shapes["speed"], rows, make_timer(device))
    failed |= decode_speed(device, shapes["speed"], rows, make_timer(device))
    print(f"flash_attention masks, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU interpreter'}, "
          f"check {shapes['check']}, speed {shapes['speed']} (b, h, h_kv, s, d, mean doc, window), bf16")
    for row in rows:
        print(" | ".join(row))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
