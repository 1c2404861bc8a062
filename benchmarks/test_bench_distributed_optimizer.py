"""Distributed optimizer and mixed precision on CPU: per-rank memory and step time.

The model is the main job's (8 layers, hidden 128, 8 heads, seq 128, vocab 257 padded to 384,
micro-batch 4, global batch 32; ~1.6 M parameters), mock data, dropout off, trained by the real
``pretrain`` loop for ``TPFUSE_BENCH_ITERS`` iterations (default 6) in a ``WorkerPool`` of dp
processes, 1 thread each, with ``--overlap-grad-reduce --ddp-bucket-size 400000`` (4 buckets):

- ``dp{1,2,4}-{plain,distopt}``: fp32, data parallelism only, without / with
  ``--use-distributed-optimizer --overlap-param-gather`` — memory (the start-up ``memory_bytes`` record of the logging
  rank, dp rank 0; every rank holds a shard of the same padded size) and step time;
- ``dp1-{fp32,bf16}``: one process, fp32 vs ``--bf16`` step time (CPU only: CPUs have no bf16
  matrix units here, so bf16 only adds casts; on GPUs bf16 GEMMs are the point).

Step time: the mean ``ms_per_iter`` of the logging rank's iterations after the first
``TPFUSE_BENCH_SKIP`` (default 2) warm-up ones (its step ends with collectives over every rank, so
it is the whole job's step). Cases of one dp run back to back; ``TPFUSE_BENCH_ROUNDS`` (default 2)
alternating rounds; ratios are given for the best round of each case and as the median of the
per-round ratios of back-to-back pairs (the machine is shared). Run (pytest.ini
disables benchmarks; ``-s`` prints the summary)::

    python3 -m pytest benchmarks/test_bench_distributed_optimizer.py --benchmark-enable -q -s \\
        --benchmark-columns=median,min,rounds

Targets: optimizer state per rank ≤ 1.1 × (plain / dp); step time with the distributed optimizer
≤ 1.05 × without at dp = 2.
"""
from __future__ import annotations

import os

import pytest

from tpfuse.parallel.launch import WorkerPool

from pretrain_job import run_memory_and_step_time

ITERS = int(os.environ.get("TPFUSE_BENCH_ITERS", "6"))
SKIP = int(os.environ.get("TPFUSE_BENCH_SKIP", "2"))
ROUNDS = int(os.environ.get("TPFUSE_BENCH_ROUNDS", "2"))
MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "8",
         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "256",
         "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "4",
         "--global-batch-size", "32", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
         "--seed", "1234", "--mock-data", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--eval-interval", "100000", "--eval-iters", "1", "--log-interval", "100000",
         "--no-progress-bar", "--no-layout-table", "--overlap-grad-reduce",
         "--ddp-bucket-size", "400000"]
DISTOPT = ["--use-distributed-optimizer", "--overlap-param-gather"]
CASES = {
    # name: (data-parallel processes, extra flags)
    "dp1-plain": (1, []), "dp1-distopt": (1, DISTOPT),
    "dp2-plain": (2, []), "dp2-distopt": (2, DISTOPT),
    "dp4-plain": (4, []), "dp4-distopt": (4, DISTOPT),
    "dp1-fp32": (1, []), "dp1-bf16": (1, ["--bf16"]),
}
_RESULTS: dict = {}     # name -> {"memory": bytes dict, "ms": [per round], "losses": [...]}


def _run_case(pool, name) -> dict:
    _, flags = CASES[name]
    return run_memory_and_step_time(pool, MODEL + ["--train-iters", str(ITERS)] + flags, SKIP)


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if not _RESULTS:
        return
    mib = 1024 * 1024
    print(f"\nper-rank memory (MiB, logging rank) and step time (best of {ROUNDS} rounds, "
          f"iterations {SKIP + 1}..{ITERS}), CPU, 1 thread per rank:")
    for name, res in _RESULTS.items():
        held = ", ".join(f"{k} {v / mib:.2f}" for k, v in res["memory"].items())
        print(f"  {name:12s} {held} | {min(res['ms']):.0f} ms/iter")
    for dp in (1, 2, 4):
        plain, dist = _RESULTS.get(f"dp{dp}-plain"), _RESULTS.get(f"dp{dp}-distopt")
        if plain and dist:
            state = dist["memory"]["optimizer_state"] / (plain["memory"]["optimizer_state"] / dp)
            print(f"  dp={dp}: optimizer state per rank / (plain/dp) = {state:.3f}; step time "
                  f"distopt / plain = {_ratios(dist, plain)}")
    if "dp1-fp32" in _RESULTS and "dp1-bf16" in _RESULTS:
        print(f"  bf16 / fp32 step time (CPU only) = "
              f"{_ratios(_RESULTS['dp1-bf16'], _RESULTS['dp1-fp32'])}")


def _ratios(a: dict, b: dict) -> str:
    """best-round ratio, and the median of the per-round (paired, back-to-back) ratios."""
    paired = sorted(x / y for x, y in zip(a["ms"], b["ms"]))
    return (f"{min(a['ms']) / min(b['ms']):.3f} (best rounds), "
            f"{paired[len(paired) // 2]:.3f} (median of {len(paired)} paired rounds)")


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_distributed_optimizer_memory_and_step_time(benchmark, dp):
    names = [f"dp{dp}-plain", f"dp{dp}-distopt"] + (["dp1-fp32", "dp1-bf16"] if dp == 1 else [])
    benchmark.group = f"dp={dp}, {ITERS} iterations x {ROUNDS} rounds"
    pool = WorkerPool(dp)
    try:
        def rounds():
            for _ in range(ROUNDS):
                for name in names:
                    res = _run_case(pool, name)
                    entry = _RESULTS.setdefault(name, {"memory": res["memory"], "ms": [],
                                                       "losses": res["losses"]})
                    entry["ms"].append(res["ms"])
        benchmark.pedantic(rounds, rounds=1, iterations=1)
    finally:
        pool.close()
    plain, dist = _RESULTS[f"dp{dp}-plain"], _RESULTS[f"dp{dp}-distopt"]
    # the same training either way (fp32 summation order only, as tests/test_invariance.py)
    assert dist["losses"] == pytest.approx(plain["losses"], rel=1e-5)
