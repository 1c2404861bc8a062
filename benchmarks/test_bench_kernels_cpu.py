"""CPU benchmarks: the torch path of matmul / layer_norm / rms_norm / bias_dropout_add (what layers
run on CPU) against the plain composition of torch ops, forward + backward, side by side.

    python3 -m pytest benchmarks/test_bench_kernels_cpu.py --benchmark-enable -q \
        --benchmark-columns=median,iqr,rounds --benchmark-sort=name

Each group's table shows the ratio to the fastest entry in parentheses; the summary printed at the
end gives composition / fused median ratios measured in the same run (> 1: the fused path is faster).
On a shared, loaded machine the two sides of a group can see different load, so
``test_interleaved_ratio`` also times fused and composition alternately and reports the median of
the paired ratios, which drifting load affects far less.
Without --benchmark-enable (pytest.ini disables benchmarks) every case runs once as a smoke test.
"""
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from tpfuse.kernels import bias_dropout_add, layer_norm, matmul, rms_norm

TOKENS, HIDDEN, FFN = 1024, 1024, 4096  # (s·b, h, 4h): a small GPT MLP on one CPU rank
EPS = 1e-5
_MEDIANS: dict = {}


def _matmul_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, requires_grad=True)
    w = (torch.randn(FFN, HIDDEN, generator=gen) * HIDDEN**-0.5).requires_grad_()  # (out, in), as nn.Linear
    b = torch.zeros(FFN, requires_grad=True)
    return x, w, b, torch.randn(TOKENS, FFN, generator=gen)


def _norm_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4 * TOKENS, HIDDEN, generator=gen, requires_grad=True)
    w = torch.ones(HIDDEN, requires_grad=True)
    b = torch.zeros(HIDDEN, requires_grad=True)
    return x, w, b, torch.randn(4 * TOKENS, HIDDEN, generator=gen)


def _fwd_bwd(fn, leaves, dy):
    def step():
        for t in leaves:
            t.grad = None
        fn().backward(dy)
    return step


def _composition_rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _composition_ln(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + EPS) * w + b


CASES = {
    # group: {impl: (inputs factory, fn(inputs) -> output)}
    "matmul+bias+gelu": {
        "fused": (_matmul_inputs, lambda x, w, b: matmul(x, w.t(), b, "gelu", backend="torch")),
        "composition": (_matmul_inputs, lambda x, w, b: F.gelu(x @ w.t() + b)),
    },
    "matmul+bias": {
        "fused": (_matmul_inputs, lambda x, w, b: matmul(x, w.t(), b, backend="torch")),
        "composition": (_matmul_inputs, lambda x, w, b: x @ w.t() + b),
    },
    "layer_norm": {
        "fused": (_norm_inputs, lambda x, w, b: layer_norm(x, w, b, EPS, backend="torch")),
        "composition": (_norm_inputs, _composition_ln),
    },
    "rms_norm": {
        "fused": (_norm_inputs, lambda x, w, b: rms_norm(x, w, EPS, backend="torch")),
        "composition": (_norm_inputs, lambda x, w, b: _composition_rms(x, w)),
    },
    "bias_dropout_add": {
        "fused": (_norm_inputs, lambda x, w, b: bias_dropout_add(x, b, x.detach(), 0.1, True, seed=3, backend="torch")),
        "composition": (_norm_inputs, lambda x, w, b: x.detach() + F.dropout(x + b, 0.1, training=True)),
    },
}


@pytest.fixture(scope="module", autouse=True)
def ratio_summary():
    yield
    lines = []
    for group, impls in _MEDIANS.items():
        if {"fused", "composition"} <= impls.keys():
            lines.append(f"  {group:<18} composition / fused = {impls['composition'] / impls['fused']:.2f}×"
                         f"   (fused {impls['fused'] * 1e3:.2f} ms, composition {impls['composition'] * 1e3:.2f} ms)")
    if lines:
        print("\nCPU fwd+bwd medians, one run, torch threads =", torch.get_num_threads())
        print("\n".join(lines))


@pytest.mark.parametrize("impl", ["fused", "composition"])
@pytest.mark.parametrize("group", list(CASES))
def test_fwd_bwd(benchmark, group, impl):
    make_inputs, fn = CASES[group][impl]
    x, w, b, dy = make_inputs()
    leaves = [x, w, b]
    benchmark.group = group
    benchmark.pedantic(_fwd_bwd(lambda: fn(x, w, b), leaves, dy), rounds=8, warmup_rounds=1)
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if benchmark.stats is not None:
        _MEDIANS.setdefault(group, {})[impl] = benchmark.stats.stats.median


@pytest.mark.parametrize("group", list(CASES))
def test_interleaved_ratio(benchmark, group):
    """composition / fused from alternating runs: median of 7 paired ratios (1 when disabled)."""
    steps = {}
    for impl in ("fused", "composition"):
        make_inputs, fn = CASES[group][impl]
        x, w, b, dy = make_inputs()
        steps[impl] = _fwd_bwd(lambda fn=fn, x=x, w=w, b=b: fn(x, w, b), [x, w, b], dy)
    pairs = 1 if benchmark.disabled else 7
    ratios = []

    def alternate():
        for i in range(pairs + (0 if benchmark.disabled else 1)):  # first pair warms up when enabled
            times = {}
            for impl in (("fused", "composition") if i % 2 else ("composition", "fused")):  # no order bias
                start = time.perf_counter()
                steps[impl]()
                times[impl] = time.perf_counter() - start
            ratios.append(times["composition"] / times["fused"])

    benchmark.group = "interleaved (whole paired run)"
    benchmark.pedantic(alternate, rounds=1, iterations=1)
    paired = ratios[-pairs:]
    assert all(r > 0 for r in paired)
    if not benchmark.disabled:
        print(f"\n  interleaved {group:<18} composition / fused = {statistics.median(paired):.2f}× "
              f"(paired ratios {min(paired):.2f}–{max(paired):.2f})")
