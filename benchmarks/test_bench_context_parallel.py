"""CPU benchmark: context-parallel attention per rank vs sequence length, cp = 1, 2, 4, each comm type.

The attention core a layer runs (what context parallelism changes): b = 1, 4 heads (MHA, so a2a
can split them over cp = 4), head dim 64, causal, fp32, forward + backward, on gloo with one
process per cp rank and one thread each. cp = 1 is the same building blocks on the whole sequence
in one process (``flash_attention``'s torch path). Cases per sequence length s (1k … 16k by
default):

- ``cp1``; ``cp2-p2p``, ``cp2-all_gather``, ``cp2-a2a``; ``cp4-p2p``, ``cp4-all_gather``,
  ``cp4-a2a`` — peer: ``cp1``;
- packed documents (random lengths 1..s/8, ``document_ids``): ``cp1-docs`` (peer ``cp1``) and
  ``cp2-p2p-docs`` (peer ``cp2-p2p``) — masked-out blocks are skipped, so they must be faster than
  their unmasked peers, not slower.

Per rank, measured inside the workers, every round:
- **saved**: the bytes autograd keeps for backward of one call (``SavedActivationBytes``: each
  storage once): the activation memory of the attention. It must fall as 1/cp
  (``test_summary`` asserts saved(cp) · cp / saved(cp1) within 2 %). Transient buffers (the
  gathered K/V of all_gather, a2a's full-sequence heads) are not in it.
- **step**: forward + backward wall time of the slowest rank; median over the rounds.
- **ring overlap** (p2p): *exposed* = time the rank spent blocked in the ring's waits
  (``_PendingExchange.wait``, timed by wrapping it in the worker); *comm alone* = the same
  exchanges (cp − 1 K/V steps forward, cp − 1 K/V + cp dK/dV steps backward) run back to back
  without any kernel; hidden = 1 − exposed / comm alone.

pytest-benchmark times one ``WorkerPool.run`` job (one forward + backward on every rank) per
round after one warm-up job, grouped by s so the cases sit side by side; ``test_summary`` prints
the table recorded in benchmarks/RESULTS.md (step ratios: peer step / case step, > 1 = faster).
Run (benchmarks are disabled by pytest.ini)::

    python3 -m pytest benchmarks/test_bench_context_parallel.py --benchmark-enable -q -s \\
        --benchmark-columns=median,min,rounds -p no:cacheprovider

``TPFUSE_BENCH_CP_SEQS=1024,4096`` / ``TPFUSE_BENCH_ROUNDS=3`` change the lengths / rounds.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from tpfuse.parallel.launch import WorkerPool

SEQS = [int(s) for s in os.environ.get("TPFUSE_BENCH_CP_SEQS",
                                       "1024,2048,4096,8192,16384").split(",")]
ROUNDS = int(os.environ.get("TPFUSE_BENCH_ROUNDS", 2))
HEADS, DIM = 4, 64
CASES = {  # name: (cp, comm type, packed documents, peer)
    "cp1": (1, "p2p", False, None), "cp1-docs": (1, "p2p", True, "cp1"),
    "cp2-p2p": (2, "p2p", False, "cp1"), "cp2-all_gather": (2, "all_gather", False, "cp1"),
    "cp2-a2a": (2, "a2a", False, "cp1"), "cp2-p2p-docs": (2, "p2p", True, "cp2-p2p"),
    "cp4-p2p": (4, "p2p", False, "cp1"), "cp4-all_gather": (4, "all_gather", False, "cp1"),
    "cp4-a2a": (4, "a2a", False, "cp1"),
}
MEASURED: dict = {}


# ----------------------------------------------------------------------------- worker side

def _inputs(seq, documents, cp, rank):
    """This rank's q, k, v, dout (b=1, HEADS, s/cp, DIM) and document ids (b, s/cp) or None."""
    from tpfuse.parallel.context_split import split_sequence

    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, HEADS, seq, DIM, generator=gen) for _ in range(4)]
    local = [split_sequence(t, cp, rank, dim=2).contiguous() for t in full]
    ids = None
    if documents:
        lengths = torch.randint(1, seq // 8 + 1, (seq,), generator=gen)
        ids = torch.repeat_interleave(torch.arange(seq), lengths)[:seq][None]
        ids = split_sequence(ids, cp, rank, dim=1).contiguous()
    return local, ids


class _WaitTimer:
    """Wraps the ring's pending-exchange ``wait`` to add up the time spent blocked in it."""

    def __init__(self):
        from tpfuse.tp_layers import ring_attention

        self.cls, self.original, self.seconds = ring_attention._PendingExchange, None, 0.0

    def __enter__(self):
        self.original = self.cls.wait
        timer = self

        def timed_wait(pending):
            start = time.perf_counter()
            try:
                return timer.original(pending)
            finally:
                timer.seconds += time.perf_counter() - start
        self.cls.wait = timed_wait
        return self

    def __exit__(self, *exc):
        self.cls.wait = self.original


def _cp_group():
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers._group import resolve_cp_group

    state = ParallelState.initialize(cp=dist.get_world_size())
    return state, resolve_cp_group(state=state)


def measure(seq, comm_type, documents):
    """One forward + backward on this rank: {"step": s, "saved": bytes, "exposed": s}."""
    from tpfuse.tp_layers.checkpointing import SavedActivationBytes
    from tpfuse.tp_layers.context_parallel import context_parallel_attention

    state, cp = _cp_group()
    try:
        (q, k, v, dout), ids = _inputs(seq, documents, cp.size, cp.rank)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        dist.barrier()
        with _WaitTimer() as waits:
            start = time.perf_counter()
            with SavedActivationBytes() as saved:
                out = context_parallel_attention(q, k, v, cp, comm_type, document_ids=ids)
            nbytes = saved.nbytes
            out.backward(dout)
            elapsed = time.perf_counter() - start
        return {"step": elapsed, "saved": nbytes, "exposed": waits.seconds}
    finally:
        state.destroy()


def comm_alone(seq):
    """The ring's exchanges of one forward + backward, back to back, without kernels (best of 2)."""
    from tpfuse.tp_layers.ring_attention import DKV_TAG, KV_TAG, RingExchange

    state, cp = _cp_group()
    try:
        kv = torch.zeros(2, 1, HEADS, seq // cp.size, DIM)
        best = float("inf")
        for _ in range(2):
            dist.barrier(group=cp.group)
            start = time.perf_counter()
            for _ in range(cp.size - 1):                       # forward
                RingExchange(cp, KV_TAG).start(kv).wait()
            for step in range(cp.size):                        # backward
                if step + 1 < cp.size:
                    RingExchange(cp, KV_TAG).start(kv).wait()
                RingExchange(cp, DKV_TAG).start(kv).wait()
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        state.destroy()


# ----------------------------------------------------------------------------- pytest side

@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(size):
        if size not in made:
            made[size] = WorkerPool(size)
        return made[size]
    yield get
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seq", SEQS)
def test_context_parallel_attention_step(benchmark, pools, seq, case):
    cp, comm_type, documents, _ = CASES[case]
    pool, rounds = pools(cp), []
    job = (measure, seq, comm_type, documents)
    pool.run(*job, timeout_s=3600)                                     # warm-up
    benchmark.group = f"context-parallel attention fwd+bwd, s={seq}"
    benchmark.pedantic(lambda: rounds.append(pool.run(*job, timeout_s=3600)),
                       rounds=ROUNDS, iterations=1)
    record = {"step": statistics.median(max(r["step"] for r in ranks) for ranks in rounds),
              "saved": max(r["saved"] for r in rounds[0])}
    if comm_type == "p2p" and cp > 1:
        record["exposed"] = statistics.median(max(r["exposed"] for r in ranks)
                                              for ranks in rounds)
        record["comm"] = max(pool.run(comm_alone, seq, timeout_s=3600))
    MEASURED[(seq, case)] = record
    benchmark.extra_info.update(record)


def _row(seq, case):
    r, peer_name = MEASURED[(seq, case)], CASES[case][3]
    peer = MEASURED.get((seq, peer_name)) if peer_name else None
    base = MEASURED.get((seq, "cp1-docs" if CASES[case][2] else "cp1"))
    speed = f"{peer['step'] / r['step']:.2f}× vs {peer_name}" if peer else "—"
    memory = f"×{r['saved'] / base['saved']:.3f}" if base else "—"
    ring = "—"
    if "comm" in r:
        hidden = max(0.0, 1.0 - r["exposed"] / r["comm"]) if r["comm"] else 0.0
        ring = (f"{1000 * r['comm']:.0f} / {1000 * r['exposed']:.0f} ms, "
                f"{100 * hidden:.0f} %")
    return (f"| {seq} | {case} | {1000 * r['step']:.0f} | {speed} | "
            f"{r['saved'] / 2**20:.2f} | {memory} | {ring} |")


def test_summary():
    if not MEASURED:
        pytest.skip("no case measured (run the whole file)")
    load = os.getloadavg()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    lines = [f"finished {now} UTC, 1-min load {load[0]:.1f}", "",
             "| s | case | step ms (median, slowest rank) | step ratio (peer / case) | "
             "saved MiB per rank | saved ÷ cp1 | ring: comm alone / exposed, hidden |",
             "|---|---|---|---|---|---|---|"]
    lines += [_row(seq, case) for seq in SEQS for case in CASES if (seq, case) in MEASURED]
    print("\n" + "\n".join(lines))
    for (seq, case), record in MEASURED.items():   # activation memory per rank falls as 1/cp
        base = MEASURED.get((seq, "cp1-docs" if CASES[case][2] else "cp1"))
        if base is not None:
            assert record["saved"] * CASES[case][0] == pytest.approx(base["saved"], rel=0.02), \
                (seq, case)
