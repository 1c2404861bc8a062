"""One-command GPU check of tpfuse.kernels (target: one H200, < 5 minutes on a cold Triton cache):
every timed case is first validated at the very shape it is timed at, then timed against its torch
peer with the two interleaved (ours, torch, ours, torch, ...), all in bf16.

    python benchmarks/gpu_check.py                 # full shapes
    python benchmarks/gpu_check.py --quick         # smaller shapes (about a minute)
    python benchmarks/gpu_check.py --cpu-dry-run   # tiny shapes on CPU through Triton's interpreter:
                                                   # exercises this script without a GPU (one case
                                                   # per family, one timing sample, the default
                                                   # norm-backward depth: seconds, not minutes)
    python benchmarks/gpu_check.py --budget-s 85 --json rows.json   # stop starting cases after
                                                   # 85 s; every table row also as JSON

Cases are the layouts training runs: the linear layer's forward ``x @ wᵀ + bias`` with the gelu
epilogue, its dgrad ``g @ w`` and its wgrad ``gᵀ @ x`` (transposed operands), the pointer kernel's
ragged tiles on that wgrad layout (the fallback where TMA cannot run), a plain square GEMM;
flash attention causal and non-causal, MHA and GQA, forward and forward+backward, against SDPA's
flash backend and, where this torch and device have it, its cuDNN backend (the stronger one is
the bar the goals speak of); layer_norm /
rms_norm / cross_entropy / bias_dropout_add forward and forward+backward.
Correctness: ours (backend="triton") against torch in fp32 on the same bf16 inputs, forward and
every gradient; metric max|ours − torch| / max|torch| ≤ 2e-2 (bf16 keeps 8 bits: one rounding is
≤ 3.9e-3 relative; a few roundings of inputs, outputs and 16-bit intermediates fit well inside
2e-2, a wrong result does not). A case that fails its check is not timed.
Speed: median of interleaved samples (triton.testing.do_bench per sample, L2 flushed), ratio
ours / torch of TFLOP/s or GB/s; goals: matmul ≥ 0.90× cuBLAS, attention fwd+bwd ≥ 0.80× SDPA's
flash backend (fwd ≥ 1.0×), norms and cross-entropy ≥ 75 % of HBM bandwidth.
Variants: the norm backward at each row-loop pipelining depth (kernel only, interleaved, the fastest
marked) and the autotuner's choice for the cross-entropy kernels, for the launchers' defaults.
Registers / spills / shared memory of every compiled kernel variant used are printed at the end.
Exit status: 0 when every check passes (or there is no GPU), 1 otherwise.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback

import torch
import triton.runtime.errors

from gpu_check_cases import SHAPES, all_cases, autotuner_choices, norm_backward_variants

TOLERANCE = 2e-2
TIME_BUDGET_S = 270.0  # stop starting new cases past this, to stay inside 5 minutes
SAMPLES = 5            # interleaved timing rounds per case (the dry run: 1)


class Report:
    """Collects table rows: (section, what, ours, torch, ratio / error, status)."""

    def __init__(self, budget_s: float = TIME_BUDGET_S, samples: int = SAMPLES):
        self.rows, self.failed, self.start = [], False, time.perf_counter()
        self.budget_s, self.samples = budget_s, samples

    def add(self, section, what, ours="", ref="", value="", status="", bad=False):
        self.rows.append((section, what, ours, ref, value, status))
        self.failed |= bad

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

    def write_json(self, path, header):
        """The rows as ``{"header": ..., "failed": ..., "rows": [{section, what, ours, torch,
        value, status}, ...]}``."""
        import json

        keys = ("section", "what", "ours", "torch", "value", "status")
        with open(path, "w") as handle:
            json.dump({"header": header, "failed": self.failed,
                       "rows": [dict(zip(keys, map(str, row))) for row in self.rows]}, handle,
                      indent=1)


def rel_err(ours, ref):
    ours, ref = ours.detach().float(), ref.detach().float()
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def make_timer(device):
    """ms of one call: triton's do_bench (median, L2 flushed) on GPU, a perf_counter loop on CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn, grad_to_none=None: triton.testing.do_bench(
            fn, warmup=5, rep=20, grad_to_none=grad_to_none, return_mode="median")

    def cpu_time(fn, grad_to_none=None):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return cpu_time


def interleaved_ms(timer, ours, ref, grad_to_none, samples=SAMPLES):
    """Median ms of ours and of torch, sampled alternately so drift (clocks, heat) hits both."""
    ours_ms, ref_ms = [], []
    for _ in range(samples):
        ours_ms.append(timer(ours, grad_to_none))
        ref_ms.append(timer(ref, grad_to_none))
    return statistics.median(ours_ms), statistics.median(ref_ms)


def check_case(rep, case):
    """Validate ours against torch at the timed shape: outputs and every gradient. → ok?"""
    errs = case.check()
    worst = max(errs.values())
    ok = math.isfinite(worst) and worst <= TOLERANCE
    detail = ", ".join(f"{name} {err:.1e}" for name, err in errs.items())
    rep.add(case.section, f"{case.name} check", "", "", detail, "PASS" if ok else "FAIL", bad=not ok)
    return ok


def time_case(rep, case, timer):
    for timing in case.timings:
        ours_ms, ref_ms = interleaved_ms(timer, timing.ours, timing.ref, case.grad_to_none or None,
                                         rep.samples)
        scale, suffix = (1e12, "TFLOP/s") if timing.unit == "flop" else (1e9, "GB/s")
        ours_rate = timing.amount / (ours_ms * 1e-3) / scale
        ref_rate = timing.amount / (ref_ms * 1e-3) / scale
        ratio = ours_rate / ref_rate
        status = "" if timing.goal is None else (f"goal ≥ {timing.goal:.2f}: " +
                                                 ("met" if ratio >= timing.goal else "missed"))
        rep.add(case.section, timing.name, f"{ours_rate:.4g} {suffix}", f"{ref_rate:.4g} {suffix}",
                f"{ratio:.2f}x", status)


def run_cases(rep, dev, shapes, timer):
    for case in all_cases(dev, shapes):
        if rep.elapsed() > rep.budget_s:
            rep.add(case.section, f"{case.name}: skipped, time budget spent", status="SKIPPED", bad=True)
            continue
        started = time.perf_counter()
        try:
            if check_case(rep, case):
                time_case(rep, case, timer)
        except Exception as exc:  # one broken op must not hide the others' results
            traceback.print_exc()
            rep.add(case.section, f"{case.name}: {type(exc).__name__}: {exc}"[:140], status="ERROR", bad=True)
        finally:
            case.release()
        print(f"[gpu_check] {case.section} {case.name}: {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def run_variants(rep, dev, shapes, timer):
    """Time each group's variants interleaved (a, b, c, a, b, c, ...); the fastest is marked."""
    for group, variants in norm_backward_variants(dev, shapes).items():
        if rep.elapsed() > rep.budget_s:
            rep.add("variants", f"{group}: skipped, time budget spent", status="SKIPPED")
            continue
        samples = {label: [] for label, _, _ in variants}
        for _ in range(rep.samples):
            for label, fn, _ in variants:
                samples[label].append(timer(fn))
        rates = {label: amount / (statistics.median(samples[label]) * 1e-3) / 1e9 for label, _, amount in variants}
        best = max(rates.values())
        for label, rate in rates.items():
            rep.add("variants", f"{group} {label}", f"{rate:.4g} GB/s", "", f"{rate / best:.2f}x of best",
                    "fastest" if rate == best else "")
    for kernel, choice in autotuner_choices():
        rep.add("autotuner", kernel, choice, "", "", "chosen")


def compiled_kernels():
    """(kernel, num_warps, num_stages, registers, spill bytes, shared bytes) of every Triton
    kernel variant compiled in this process (the configs the launchers and autotuners chose)."""
    import tpfuse.kernels  # noqa: F401
    rows = []
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("tpfuse.kernels."):
            continue
        for attr in vars(module).values():
            fn = attr
            while hasattr(fn, "fn") and not hasattr(fn, "device_caches"):
                fn = fn.fn
            for cache in getattr(fn, "device_caches", {}).values():
                for compiled in cache[0].values():
                    rows.append(_variant_row(f"{name.rsplit('.', 1)[-1]}.{fn.__name__}", compiled))
    return sorted(set(rows))


def _variant_row(kernel, compiled):
    """One compiled variant's row; registers and spills are -1 for a variant the driver refuses to
    load (an autotuner config over the shared-memory limit: compiled, tried, discarded)."""
    meta = compiled.metadata
    try:
        compiled._init_handles()
        regs, spills = compiled.n_regs, compiled.n_spills
    except triton.runtime.errors.OutOfResources:
        regs, spills = -1, -1
    return kernel, meta.num_warps, meta.num_stages, regs, spills, meta.shared


def print_compiled():
    try:
        rows = compiled_kernels()
    except Exception as exc:  # a Triton version without these attributes: say so
        print(f"\n(compiled-kernel resources unavailable: {type(exc).__name__}: {exc})")
        return
    print("\nCompiled kernel variants (registers per thread, spilled bytes, shared memory):")
    for kernel, warps, stages, regs, spills, shared in rows:
        flag = "  <-- over the shared-memory limit" if regs < 0 else "  <-- spills" if spills else ""
        print(f"  {kernel:48s} warps={warps:2d} stages={stages} regs={regs:3d} spills={spills} "
              f"shared={shared}{flag}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    parser.add_argument("--budget-s", type=float, default=TIME_BUDGET_S,
                        help="start no case after this many seconds (the rest are SKIPPED)")
    parser.add_argument("--json", default=None, help="also write the table's rows to this file")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        dev, mode = torch.device("cpu"), "dry"
    elif not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to measure. Run it on a GPU "
              "(or pass --cpu-dry-run to exercise the script through Triton's interpreter).")
        return 0
    else:
        dev, mode = torch.device("cuda"), "quick" if args.quick else "full"
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references are true fp32
    torch.manual_seed(0)
    rep = Report(args.budget_s, samples=1 if mode == "dry" else SAMPLES)
    run_cases(rep, dev, SHAPES[mode], make_timer(dev))
    run_variants(rep, dev, SHAPES[mode], make_timer(dev))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (interpreter dry run)"
    header = (f"tpfuse gpu_check ({mode}) on {name}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {rep.elapsed():.0f} s; correctness metric "
              f"max|ours-torch|/max|torch| ≤ {TOLERANCE}; timings interleaved, {rep.samples} samples each")
    rep.print(header)
    if args.json:
        rep.write_json(args.json, header)
    if dev.type == "cuda":
        print_compiled()
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
