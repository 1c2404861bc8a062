"""CPU benchmark: fused (ring-overlapped) vs sequential comm+GEMM at tp=2 on gloo, 1 thread per rank.

A GPT MLP scaled to the machine: s·b = 2048 tokens, h = 1024, 4h = 4096, fp32, split over tp = 2.
- ``ag``: all_gather_matmul, the column-parallel fc1: x_shard (1024, 1, 1024) @ w (2048, 1024)ᵀ;
- ``rs``: matmul_reduce_scatter, the row-parallel fc2: x (2048, 1, 2048) @ w (1024, 2048)ᵀ.
Each is 8.6 GFLOP per rank forward (×3 with backward). ``sequential`` is the same op below its size
threshold (one collective, one GEMM); ``fused`` is the ring pipeline (threshold 0).

Run (pytest.ini disables benchmarks by default; ``-s`` shows the breakdown tables)::

    python3 -m pytest benchmarks/test_bench_fused_comm_cpu.py --benchmark-enable -q -s \\
        --benchmark-columns=median,min,rounds --benchmark-sort=name

- ``test_fused_vs_sequential``: pytest-benchmark groups ``ag fwd``, ``ag fwd+bwd``, ``rs fwd``,
  ``rs fwd+bwd``, fused and sequential side by side (one job on both ranks per round).
- ``test_overlap_breakdown``: inside the workers, interleaved rounds of comm alone, GEMM alone,
  sequential and fused, and the time the fused op spent blocked on ring transfers (the comm it
  left exposed); hidden = 1 − exposed / comm alone. (comm + GEMM − fused) / comm would say the
  same in a quiet machine, but comm is a few % of the step here, below the timing noise.
- ``test_threshold_sweep``: fused / sequential fwd+bwd time over GEMM sizes, to place
  ``comm_gemm_common.DEFAULT_MIN_FLOPS``.
Every table is also written to benchmarks/FUSED_COMM_RESULTS.md.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from tpfuse.kernels import comm_gemm_common as common
from tpfuse.kernels.ag_matmul import all_gather_matmul
from tpfuse.kernels.matmul import matmul
from tpfuse.kernels.matmul_rs import matmul_reduce_scatter
from tpfuse.parallel.comm_options import CommOptions
from tpfuse.parallel.launch import WorkerPool
from tpfuse.parallel.mappings import all_gather_first_dim, reduce_scatter_first_dim

TP, TOKENS, HIDDEN = 2, 2048, 1024
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "FUSED_COMM_RESULTS.md")


# ----------------------------------------------------------------------------- worker side

def _tensors(op, tokens, hidden, ffn):
    """The layer's tensors on this rank: (input, weight, output grad)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    tp = dist.get_world_size()
    if op == "ag":                           # fc1: x_shard (s/tp, 1, h), w (4h/tp, h)
        shapes = (tokens // tp, 1, hidden), (ffn // tp, hidden), (tokens, 1, ffn // tp)
    else:                                    # fc2: x (s, 1, 4h/tp), w (h, 4h/tp)
        shapes = (tokens, 1, ffn // tp), (hidden, ffn // tp), (tokens // tp, 1, hidden)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _step(op, mode, backward, x, w, dy):
    """One forward (+ backward) of ``op`` in ``mode``: fused | sequential | comm | gemm."""
    group = dist.group.WORLD
    if mode == "comm":                      # the collectives alone, no GEMM
        if op == "ag":
            gathered = all_gather_first_dim(x, group)                        # fwd
            if backward:
                reduce_scatter_first_dim(gathered, group)                    # dgrad's collective
        else:
            reduce_scatter_first_dim(torch.empty(x.shape[:-1] + w.shape[:1]), group)
            if backward:
                all_gather_first_dim(dy, group)
        return
    if mode == "gemm":                      # the same GEMMs alone, on the full rows, no comm
        tp = dist.get_world_size()
        x = torch.cat([x] * tp) if op == "ag" else x                        # (s, b, k)
        dy = torch.cat([dy] * tp) if op == "rs" else dy                     # (s, b, n)
        x, w = x.requires_grad_(backward), w.requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            y = matmul(x, w.t())
            if backward:
                y.backward(dy)                                              # dgrad + wgrad
        return
    x = x.requires_grad_(backward)
    w = w.requires_grad_(backward)
    options = CommOptions(fused_min_flops=0 if mode == "fused" else float("inf"))
    with torch.set_grad_enabled(backward):
        y = (all_gather_matmul(x, w, group, options=options) if op == "ag"
             else matmul_reduce_scatter(x, w, group, options=options))
        if backward:
            y.backward(dy)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_modes(op, backward, modes, rounds, tokens=TOKENS, hidden=HIDDEN, ffn=4 * HIDDEN):
    """Per mode, this rank's seconds for each round (modes interleaved within a round)."""
    x, w, dy = _tensors(op, tokens, hidden, ffn)
    for mode in modes:                                        # warm-up (allocator, groups)
        _step(op, mode, backward, x, w, dy)
    times = {key: [] for mode in modes for key in (mode, mode + ":exposed")}
    for _ in range(rounds):
        for mode in modes:
            common.take_exposed_comm_s()                          # reset
            times[mode].append(_timed(lambda: _step(op, mode, backward, x, w, dy)))
            times[mode + ":exposed"].append(common.take_exposed_comm_s())
    return times


# ----------------------------------------------------------------------------- main side

def _step_seconds(per_rank, mode):
    """A step lasts until the slowest rank is done: max over ranks per round; then the fastest
    round (on a shared machine other processes only ever add time)."""
    rounds = zip(*(rank_times[mode] for rank_times in per_rank))
    return min(max(r) for r in rounds)


def _median_of_slowest(per_rank, key):
    return statistics.median(max(r) for r in zip(*(rank_times[key] for rank_times in per_rank)))


def _write(section: str, lines: list[str]) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"\n## {section} ({stamp}, {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f})\n\n"
    text += "\n".join(lines) + "\n"
    print(text)
    with open(RESULTS, "a") as out:
        out.write(text)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(TP, threads_per_rank=1) as workers:
        yield workers


@pytest.mark.parametrize("mode", ["fused", "sequential"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fused_vs_sequential(benchmark, pool, op, backward, mode):
    benchmark.group = f"{op} {'fwd+bwd' if backward else 'fwd'}"
    benchmark.pedantic(pool.run, args=(time_modes, op, backward, [mode], 1), rounds=5,
                       warmup_rounds=1)


def test_overlap_breakdown(pool):
    lines = ["| op | pass | comm alone | GEMM alone | sequential | fused | sequential/fused | "
             "fused: comm left exposed | comm hidden |", "|---|---|---|---|---|---|---|---|---|"]
    modes = ["comm", "gemm", "sequential", "fused"]
    for op in ("ag", "rs"):
        for backward in (False, True):
            per_rank = pool.run(time_modes, op, backward, modes, 8)
            t = {mode: _step_seconds(per_rank, mode) for mode in modes}
            exposed = _median_of_slowest(per_rank, "fused:exposed")
            ms = lambda v: f"{1e3 * v:.1f} ms"                          # noqa: E731
            lines.append(
                f"| {op} | {'fwd+bwd' if backward else 'fwd'} | {ms(t['comm'])} | {ms(t['gemm'])} | "
                f"{ms(t['sequential'])} | {ms(t['fused'])} | {t['sequential'] / t['fused']:.3f} | "
                f"{ms(exposed)} | {100 * (1 - exposed / t['comm']):.0f}% |")
            assert all(v > 0 for v in t.values())
    lines.append(
        "\nTimes: fastest of 8 interleaved rounds, each the slower rank's. comm left exposed: "
        "median over rounds of the host time the fused op spent blocked waiting for ring "
        "transfers (the rest of its communication ran under the GEMMs); comm hidden = 1 − "
        "exposed / comm alone.")
    _write(f"Overlap breakdown, tp={TP}, s·b={TOKENS}, h={HIDDEN}, 4h={4 * HIDDEN}, fp32", lines)


SWEEP = [(64, 256, 1024), (256, 512, 2048), (256, 1024, 4096), (512, 1024, 4096),
         (1024, 1024, 4096), (2048, 1024, 4096)]          # (s·b, h, 4h)


def test_threshold_sweep(pool):
    lines = ["| s·b | h | 4h | GEMM FLOPs per rank (fwd) | ag seq/fused | rs seq/fused |",
             "|---|---|---|---|---|---|"]
    for tokens, hidden, ffn in SWEEP:
        flops = 2 * tokens * hidden * ffn / TP
        ratios = []
        for op in ("ag", "rs"):
            per_rank = pool.run(time_modes, op, True, ["sequential", "fused"], 5, tokens, hidden,
                                ffn)
            ratios.append(_step_seconds(per_rank, "sequential") / _step_seconds(per_rank, "fused"))
        lines.append(f"| {tokens} | {hidden} | {ffn} | {flops:.2e} | {ratios[0]:.3f} | "
                     f"{ratios[1]:.3f} |")
    lines.append("\nfwd+bwd, fastest of 5 interleaved rounds; > 1 means the fused pipeline is faster.")
    _write(f"Threshold sweep, tp={TP}, fp32", lines)
