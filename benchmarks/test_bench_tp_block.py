"""GPT block forward+backward at tp=2 on CPU gloo: tpfuse vs PyTorch DTensor TP vs dense.

The block: pre-norm LayerNorm, causal multi-head self-attention (16 heads), gelu MLP (4h), biases,
fp32. Three implementations, same sizes and FLOPs:

- ``tpfuse``: ``tpfuse.tp_layers.TransformerLayer`` with ``sequence_parallel=True`` on a
  ParallelState(tp=2): fused all-gather+GEMM into QKV / fc1, GEMM+reduce-scatter out of proj / fc2;
  input and output ``(s/2, b, h)``.
- ``dtensor``: a plain torch block (separate q/k/v linears, ``F.scaled_dot_product_attention``)
  parallelised with ``torch.distributed.tensor.parallel``: ColwiseParallel q/k/v/fc1,
  RowwiseParallel(output_layouts=Shard(1)) proj/fc2, SequenceParallel norms, PrepareModuleInput
  all-gathering into attention and MLP (the layout of PyTorch's TP tutorial); input/output
  ``(b, s/2, h)``.
- ``tpfuse_unfused``: the same tpfuse layer with the comm+GEMM fusion switched off (one collective
  then one GEMM: ``state.comm_options = CommOptions(fused_min_flops=inf)``), to show what the ring
  overlap buys.
- ``dense``: the same plain block in one process (one thread), full sequence.

Each rank is a process with one thread (2 cores for tp=2, 1 for dense). Timing is of one
``WorkerPool.run`` job per round (forward + backward on every rank, grads reset).

Size: the issue's block is hidden 1024, 16 heads, s=512, b=4; environment variables
``TPFUSE_BENCH_SEQ`` / ``TPFUSE_BENCH_BATCH`` / ``TPFUSE_BENCH_HIDDEN`` / ``TPFUSE_BENCH_ROUNDS``
shrink it for a loaded machine. Run (benchmarks are disabled by pytest.ini; ``-s`` shows ratios)::

    python3 -m pytest benchmarks/test_bench_tp_block.py --benchmark-enable -q -s \\
        --benchmark-columns=median,min,rounds

``test_block_fwd_bwd[...]`` gives pytest-benchmark's side-by-side table; ``test_ratios`` times
the three interleaved round by round (robust to load drifting during the run) and prints / writes
tpfuse/DTensor and tpfuse/dense median ratios to benchmarks/TP_BLOCK_RESULTS.md.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.parallel.launch import WorkerPool

TP, HEADS = 2, 16
HIDDEN = int(os.environ.get("TPFUSE_BENCH_HIDDEN", 1024))
SEQ = int(os.environ.get("TPFUSE_BENCH_SEQ", 512))
BATCH = int(os.environ.get("TPFUSE_BENCH_BATCH", 4))
ROUNDS = int(os.environ.get("TPFUSE_BENCH_ROUNDS", 5))
KINDS = ("tpfuse", "tpfuse_unfused", "dtensor", "dense")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "TP_BLOCK_RESULTS.md")


# ----------------------------------------------------------------------------- the plain block

class PlainAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv = (nn.Linear(hidden, hidden) for _ in range(3))
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x):                                     # (b, s, h) [h/tp inside under TP]
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))      # [b, heads(/tp), s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class PlainMLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class PlainBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.mlp = PlainAttention(hidden, heads), PlainMLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# ----------------------------------------------------------------------------- worker side

_CACHE: dict = {}


def _dtensor_block():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (TP,))
    gather_in = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "ln1": SequenceParallel(), "ln2": SequenceParallel(),
        "attn": gather_in, "mlp": gather_in,
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    torch.manual_seed(0)
    return parallelize_module(PlainBlock(HIDDEN, HEADS), mesh, plan)


def _setup(kind):
    """Build ``kind``'s block and inputs once per worker process."""
    import torch.distributed as dist
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)       # (s, b, h), same on every rank
    if kind == "tpfuse":
        from tpfuse.parallel.state import ParallelState
        from tpfuse.tp_layers import TransformerLayer
        state = ParallelState.initialize(tp=TP)
        torch.manual_seed(0)
        block = TransformerLayer(HIDDEN, HEADS, 4 * HIDDEN, sequence_parallel=True, state=state)
        x = torch.chunk(x, TP, dim=0)[rank]                 # (s/tp, b, h)
        _CACHE["state"] = state
    elif kind == "dtensor":
        block = _dtensor_block()
        x = torch.chunk(x.transpose(0, 1), TP, dim=1)[rank]  # (b, s/tp, h)
    else:
        torch.manual_seed(0)
        block = PlainBlock(HIDDEN, HEADS)
        x = x.transpose(0, 1).contiguous()                   # (b, s, h)
    _CACHE[kind] = (block, x.contiguous().requires_grad_())
    return sum(p.numel() for p in block.parameters())


def _step(kind):
    """One forward + backward; returns this rank's seconds."""
    from tpfuse.parallel.comm_options import CommOptions
    built = "tpfuse" if kind == "tpfuse_unfused" else kind
    if built not in _CACHE:
        _setup(built)
    block, x = _CACHE[built]
    if built == "tpfuse":                       # the layers read the state's options per call
        unfused = CommOptions(fused_min_flops=float("inf"))
        _CACHE["state"].comm_options = unfused if kind == "tpfuse_unfused" else None
    start = time.perf_counter()
    out = block(x)
    out.backward(torch.ones_like(out))
    elapsed = time.perf_counter() - start
    block.zero_grad(set_to_none=True)
    x.grad = None
    return elapsed


# ----------------------------------------------------------------------------- driver side

@pytest.fixture(scope="module")
def pools():
    timeout = datetime.timedelta(seconds=600).total_seconds()
    with WorkerPool(TP, collective_timeout_s=timeout) as tp_pool, WorkerPool(1) as dense_pool:
        yield {"tpfuse": tp_pool, "tpfuse_unfused": tp_pool, "dtensor": tp_pool,
               "dense": dense_pool}


def _run(pools, kind):
    return max(pools[kind].run(_step, kind, timeout_s=900))


@pytest.mark.parametrize("kind", KINDS)
def test_block_fwd_bwd(benchmark, pools, kind):
    benchmark.group = f"GPT block fwd+bwd h={HIDDEN} heads={HEADS} s={SEQ} b={BATCH} tp={TP}"
    _run(pools, kind)  # build + warm up outside the measurement
    benchmark.pedantic(_run, args=(pools, kind), rounds=ROUNDS, iterations=1)


def test_ratios(pools):
    """Interleaved rounds (tpfuse, dtensor, dense), medians of in-worker times, ratios."""
    for kind in KINDS:
        _run(pools, kind)
    times = {kind: [] for kind in KINDS}
    for _ in range(ROUNDS):
        for kind in KINDS:
            times[kind].append(_run(pools, kind))
    median = {kind: statistics.median(t) for kind, t in times.items()}
    assert all(m > 0 for m in median.values())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"GPT block fwd+bwd, hidden {HIDDEN}, {HEADS} heads, s={SEQ}, b={BATCH}, fp32, CPU gloo, "
        f"1 thread per rank, {ROUNDS} interleaved rounds ({when})",
        "",
        "| impl | median s | min s |", "|---|---|---|",
        *(f"| {k} | {median[k]:.3f} | {min(times[k]):.3f} |" for k in KINDS),
        "",
        f"tpfuse/DTensor = {median['tpfuse'] / median['dtensor']:.3f}   "
        f"tpfuse/dense = {median['tpfuse'] / median['dense']:.3f}   "
        f"tpfuse/tpfuse_unfused = {median['tpfuse'] / median['tpfuse_unfused']:.3f}   "
        f"(tp=2 on 2 processes vs dense on 1; < 1 is faster)",
    ]
    print("\n" + "\n".join(lines))
    with open(RESULTS, "a") as f:
        f.write("\n".join(lines) + "\n\n")
