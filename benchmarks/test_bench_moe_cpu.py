"""Mixture of experts on CPU: grouped experts vs a per-expert loop, and the MoE layer at ep = 1, 2, 4
with its step time split into router, token dispatch (all-to-all), experts and combine.

1. ``test_experts_fwd_bwd[grouped|loop|sequential]`` (pytest-benchmark, side by side): the local
   experts' MLP (fc1 → gelu → fc2) forward + backward over the same rows and weights, fp32,
   2 threads:

   - ``grouped``: ``GroupedExperts(grouped=True)``: two ``grouped_gemm`` calls over all experts
     (the torch path on CPU: one ``mm`` per expert written into its slice of one output);
   - ``loop``: ``GroupedExperts(grouped=False)``: Megatron's SequentialMLP, one fused matmul per
     expert and layer, outputs concatenated;
   - ``sequential``: the textbook loop: ``nn.Linear`` modules per expert, ``index_select`` of each
     expert's rows and ``index_add_`` of the outputs (what a plain PyTorch MoE does).

   ``test_experts_ratios`` times the three interleaved round by round and prints median ratios
   (appended to benchmarks/MOE_RESULTS.md).

2. ``test_moe_layer_step_time_by_ep``: 4 gloo processes (1 thread each), the MoE layer forward +
   backward at ep = 1, 2, 4 with the all-to-all dispatcher (and ep = 4 with the all-gather one); the
   pieces are run separately, each between two barriers (router, dispatch, experts, combine
   forward; then their backwards in reverse, the router's last), so the wall time of each is
   attributed (the barriers add a little to every piece). Printed and appended to
   benchmarks/MOE_RESULTS.md.

Sizes (environment, for a loaded machine): ``TPFUSE_BENCH_MOE_TOKENS`` (tokens per rank, default
2048), ``..._HIDDEN`` (256), ``..._FFN`` (512), ``..._EXPERTS`` (8), ``..._ROUNDS`` (5). Run::

    python3 -m pytest benchmarks/test_bench_moe_cpu.py --benchmark-enable -q -s \\
        --benchmark-columns=median,min,rounds -p no:cacheprovider
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpfuse.parallel.launch import WorkerPool

TOKENS = int(os.environ.get("TPFUSE_BENCH_MOE_TOKENS", 2048))
HIDDEN = int(os.environ.get("TPFUSE_BENCH_MOE_HIDDEN", 256))
FFN = int(os.environ.get("TPFUSE_BENCH_MOE_FFN", 512))
EXPERTS = int(os.environ.get("TPFUSE_BENCH_MOE_EXPERTS", 8))
ROUNDS = int(os.environ.get("TPFUSE_BENCH_MOE_ROUNDS", 5))
TOPK = 2
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "MOE_RESULTS.md")


def _config(**overrides):
    from tpfuse.models.config import TransformerConfig

    values = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=TOKENS,
                  vocab_size=64, num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN,
                  moe_router_topk=TOPK, add_bias_linear=False, moe_aux_loss_coeff=1e-2)
    values.update(overrides)
    return TransformerConfig(**values)


def _routed_rows(gen):
    """TOKENS·k rows grouped by expert with a skewed (realistic) split, and their sizes."""
    weights = torch.linspace(1.0, 3.0, EXPERTS)
    sizes = torch.distributions.Multinomial(TOKENS * TOPK, weights / weights.sum()).sample()
    sizes = [int(n) for n in sizes]
    return torch.randn(sum(sizes), HIDDEN, generator=gen), sizes


# ----------------------------------------------------------------------------- experts: grouped vs loop

class _SequentialExperts(nn.Module):
    """The plain PyTorch loop: index each expert's rows, two nn.Linear, index_add_ back."""

    def __init__(self, experts):
        super().__init__()
        self.fc1 = nn.ModuleList(nn.Linear(HIDDEN, FFN, bias=False) for _ in range(EXPERTS))
        self.fc2 = nn.ModuleList(nn.Linear(FFN, HIDDEN, bias=False) for _ in range(EXPERTS))
        with torch.no_grad():                       # the same weights as the grouped experts
            for e in range(EXPERTS):
                self.fc1[e].weight.copy_(experts.weight1[e].t())
                self.fc2[e].weight.copy_(experts.weight2[e].t())

    def forward(self, rows, sizes):
        out = torch.zeros_like(rows)
        start = 0
        for e, n in enumerate(sizes):
            index = torch.arange(start, start + n)
            h = self.fc2[e](F.gelu(self.fc1[e](rows.index_select(0, index))))
            out = out.index_add(0, index, h)
            start += n
        return out


def _experts_setup():
    from tpfuse.moe.experts import GroupedExperts
    from tpfuse.moe.groups import MoEGroups

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    config = _config()
    grouped = GroupedExperts(config, MoEGroups(), output_layer_init_std=0.02, grouped=True)
    loop = GroupedExperts(config, MoEGroups(), output_layer_init_std=0.02, grouped=False)
    loop.load_state_dict(grouped.state_dict())
    rows, sizes = _routed_rows(gen)
    rows.requires_grad_()
    dy = torch.randn_like(rows)
    return {"grouped": grouped, "loop": loop, "sequential": _SequentialExperts(grouped)}, \
        rows, sizes, dy


def _fwd_bwd(module, rows, sizes, dy):
    module.zero_grad(set_to_none=True)
    rows.grad = None
    module(rows, sizes).backward(dy)


@pytest.fixture(scope="module")
def experts_setup():
    return _experts_setup()


@pytest.mark.parametrize("kind", ["grouped", "loop", "sequential"])
def test_experts_fwd_bwd(benchmark, experts_setup, kind):
    modules, rows, sizes, dy = experts_setup
    benchmark.group = f"experts fwd+bwd: {EXPERTS} experts, {sum(sizes)} rows, h {HIDDEN}, F {FFN}"
    benchmark.pedantic(_fwd_bwd, args=(modules[kind], rows, sizes, dy), rounds=ROUNDS,
                       warmup_rounds=1)


def test_experts_ratios(experts_setup):
    """Interleaved rounds, median of the per-round ratios (robust to load drifting)."""
    modules, rows, sizes, dy = experts_setup
    times = {kind: [] for kind in modules}
    outputs = {kind: modules[kind](rows, sizes).detach() for kind in modules}
    for kind in modules:
        torch.testing.assert_close(outputs[kind], outputs["grouped"], rtol=1e-4, atol=1e-5)
    for _ in range(ROUNDS + 1):
        for kind, module in modules.items():
            start = time.perf_counter()
            _fwd_bwd(module, rows, sizes, dy)
            times[kind].append(time.perf_counter() - start)
    medians = {kind: statistics.median(t[1:]) for kind, t in times.items()}
    ratios = {kind: statistics.median(a / b for a, b in zip(times[kind][1:], times["grouped"][1:]))
              for kind in modules}
    line = (f"experts fwd+bwd, {EXPERTS} experts, {sum(sizes)} rows, h {HIDDEN}, F {FFN}, "
            f"2 threads, {ROUNDS} interleaved rounds — medians (ms): " + ", ".join(
                f"{k} {1e3 * v:.1f}" for k, v in medians.items()) + " | time / grouped: " +
            ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print("\n" + line)
    with open(RESULTS, "a") as handle:
        handle.write(f"\n### {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC — {line}\n")


# ----------------------------------------------------------------------------- the layer at ep = 1, 2, 4

def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    value = fn()
    dist.barrier()
    return value, time.perf_counter() - start


def _layer_phases(ep, dispatcher, rounds):
    """Median seconds per phase on this rank, over ``rounds`` forward+backward passes."""
    from tpfuse.moe import MoELayer, RouterLossTracker
    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(ep=ep)
    try:
        torch.manual_seed(0)
        layer = MoELayer(_config(expert_model_parallel_size=ep,
                                 moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=True),
                         0, RouterLossTracker(), state)
        gen = torch.Generator().manual_seed(dist.get_rank())
        hidden = torch.randn(TOKENS, 1, HIDDEN, generator=gen)
        phases = {k: [] for k in ("router", "dispatch", "experts", "combine", "total")}
        for _ in range(rounds + 1):
            x = hidden.clone().requires_grad_()
            (probs, rmap), t_router = _timed(lambda: layer.router(x))
            probs_in = probs.detach().requires_grad_()
            tokens = x.reshape(-1, HIDDEN)
            (rows, sizes, plan), t_disp = _timed(
                lambda: layer.dispatcher.dispatch(tokens, probs_in, rmap))
            rows_in = rows.detach().requires_grad_()
            out, t_exp = _timed(lambda: layer.experts(rows_in, sizes))
            out_in = out.detach().requires_grad_()
            y, t_comb = _timed(lambda: layer.dispatcher.combine(out_in, plan))
            _, b_comb = _timed(lambda: y.backward(torch.ones_like(y)))
            _, b_exp = _timed(lambda: out.backward(out_in.grad))
            _, b_disp = _timed(lambda: rows.backward(rows_in.grad))
            _, b_router = _timed(lambda: probs.backward(probs_in.grad))
            values = {"router": t_router + b_router, "dispatch": t_disp + b_disp,
                      "experts": t_exp + b_exp, "combine": t_comb + b_comb}
            values["total"] = sum(values.values())
            for k, v in values.items():
                phases[k].append(v)
        return {k: statistics.median(v[1:]) for k, v in phases.items()}
    finally:
        state.destroy()


def _all_layouts(rounds):
    torch.set_num_threads(1)
    return {f"ep{ep} {kind}": _layer_phases(ep, kind, rounds)
            for ep, kind in ((1, "alltoall"), (2, "alltoall"), (4, "alltoall"), (4, "allgather"))}


def test_moe_layer_step_time_by_ep():
    pool = WorkerPool(4)
    try:
        per_rank = pool.run(_all_layouts, ROUNDS, timeout_s=3600)
    finally:
        pool.close()
    lines = [f"\n### {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC — MoE layer fwd+bwd, 4 gloo "
             f"ranks × 1 thread, {TOKENS} tokens/rank, h {HIDDEN}, F {FFN}, {EXPERTS} experts "
             f"top-{TOPK}, grouped GEMM, fp32; median of {ROUNDS} rounds, max over ranks (ms)",
             "", "| layout | total | router | dispatch (a2a) | experts | combine (a2a) | "
             "comm share |", "|---|---|---|---|---|---|---|"]
    for name in per_rank[0]:
        worst = {k: max(rank[name][k] for rank in per_rank) * 1e3 for k in per_rank[0][name]}
        comm = (worst["dispatch"] + worst["combine"]) / worst["total"]
        lines.append(f"| {name} | {worst['total']:.1f} | {worst['router']:.1f} | "
                     f"{worst['dispatch']:.1f} | {worst['experts']:.1f} | {worst['combine']:.1f} "
                     f"| {comm:.0%} |")
    print("\n".join(lines))
    with open(RESULTS, "a") as handle:
        handle.write("\n".join(lines) + "\n")
