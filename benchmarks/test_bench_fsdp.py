"""FSDP (``--use-torch-fsdp2``) against plain data parallelism and the distributed optimizer on
CPU (gloo): per-rank memory and step time at dp 1, 2 and 4.

The model is the main job's (8 layers, hidden 128, 8 heads, seq 128, vocab 257 padded to 384,
micro-batch 4, global batch 32; ~1.6 M parameters), fp32, mock data, dropout off, trained by the
real ``pretrain`` loop for ``TPFUSE_BENCH_ITERS`` iterations (default 6) in a ``WorkerPool`` of dp
processes, 1 thread each:

- ``dp{n}-ddp``: plain data parallelism, ``--overlap-grad-reduce --ddp-bucket-size 400000``;
- ``dp{n}-distopt``: the same with ``--use-distributed-optimizer --overlap-param-gather`` (ZeRO-1);
- ``dp{n}-zero2`` / ``dp{n}-zero3``: ``--use-torch-fsdp2 --data-parallel-sharding-strategy
  optim_grads`` / ``optim_grads_params``.

Memory: the start-up ``memory_bytes`` record of the logging rank (dp rank 0, which holds the
largest shard); parameters + gradients + optimizer state per rank against (dp1-ddp's) / dp.
Step time: the mean ``ms_per_iter`` after ``TPFUSE_BENCH_SKIP`` (default 2) warm-up iterations,
median and range over ``TPFUSE_BENCH_ROUNDS`` (default 1) rounds (the machine is shared); the
ratios to the distributed optimizer are taken per round (a round runs the four kinds back to
back, under one load), median and range printed. Run (pytest.ini
disables benchmarks; ``-s`` prints the summary)::

    python3 -m pytest benchmarks/test_bench_fsdp.py --benchmark-enable -q -s \\
        --benchmark-columns=median,min,rounds

Targets: ZeRO-3 memory per rank ≤ 1.1 × (dp1 / dp); ZeRO-3 step time ≤ 1.15 × the distributed
optimizer's at dp 2.
"""
from __future__ import annotations

import os
import statistics

import pytest

from tpfuse.parallel.launch import WorkerPool

from pretrain_job import run_memory_and_step_time

ITERS = int(os.environ.get("TPFUSE_BENCH_ITERS", "6"))
SKIP = int(os.environ.get("TPFUSE_BENCH_SKIP", "2"))
ROUNDS = int(os.environ.get("TPFUSE_BENCH_ROUNDS", "1"))
MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "8",
         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "256",
         "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "4",
         "--global-batch-size", "32", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
         "--seed", "1234", "--mock-data", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--eval-interval", "100000", "--eval-iters", "1", "--log-interval", "100000",
         "--no-progress-bar", "--no-layout-table"]
BUCKETS = ["--overlap-grad-reduce", "--ddp-bucket-size", "400000"]
FLAGS = {
    "ddp": BUCKETS,
    "distopt": BUCKETS + ["--use-distributed-optimizer", "--overlap-param-gather"],
    "zero2": ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads"],
    "zero3": ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads_params"],
}
_RESULTS: dict = {}     # name -> {"memory": bytes dict, "ms": [per round], "losses": [...]}
HELD = ("parameters", "main_parameters", "gradients", "optimizer_state")


def _run_case(pool, kind) -> dict:
    return run_memory_and_step_time(pool, MODEL + ["--train-iters", str(ITERS)] + FLAGS[kind],
                                    SKIP)


def _held(name) -> int:
    return sum(_RESULTS[name]["memory"][k] for k in HELD)


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if not _RESULTS:
        return
    mib = 1024 * 1024
    print(f"\nper-rank parameters + gradients + optimizer state (MiB, logging rank) and step "
          f"time (median [min-max] of {ROUNDS} rounds, iterations {SKIP + 1}..{ITERS}), CPU "
          "gloo, 1 thread per rank:")
    single = _held("dp1-ddp") if "dp1-ddp" in _RESULTS else None
    for name, res in _RESULTS.items():
        dp = int(name[2])
        share = f" ({_held(name) / (single / dp):.3f} x dp1/dp)" if single else ""
        print(f"  {name:12s} {_held(name) / mib:7.2f} MiB{share} | {statistics.median(res['ms']):.0f} "
              f"[{min(res['ms']):.0f}-{max(res['ms']):.0f}] ms/iter")
    for dp in (1, 2, 4):
        if f"dp{dp}-distopt" not in _RESULTS:
            continue
        for kind in ("ddp", "zero2", "zero3"):
            if f"dp{dp}-{kind}" in _RESULTS:
                # per round: rounds run the kinds back to back, so a round's ratio shares its load
                ratios = [a / b for a, b in zip(_RESULTS[f"dp{dp}-{kind}"]["ms"],
                                                _RESULTS[f"dp{dp}-distopt"]["ms"])]
                print(f"  dp={dp}: {kind} / distopt step time = {statistics.median(ratios):.3f} "
                      f"[{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)} rounds")


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_fsdp_memory_and_step_time(benchmark, dp):
    names = {f"dp{dp}-{kind}": kind for kind in FLAGS}
    benchmark.group = f"dp={dp}, {ITERS} iterations x {ROUNDS} rounds"
    pool = WorkerPool(dp)
    try:
        def rounds():
            for _ in range(ROUNDS):
                for name, kind in names.items():
                    res = _run_case(pool, kind)
                    entry = _RESULTS.setdefault(name, {"memory": res["memory"], "ms": [],
                                                       "losses": res["losses"]})
                    entry["ms"].append(res["ms"])
        benchmark.pedantic(rounds, rounds=1, iterations=1)
    finally:
        pool.close()
    ddp = _RESULTS[f"dp{dp}-ddp"]
    for name in names:        # the same training every way (fp32 summation order only)
        assert _RESULTS[name]["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
