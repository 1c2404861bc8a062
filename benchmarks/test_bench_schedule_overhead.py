"""Per-step pipeline schedule overhead at pp=8, vpp=4, m=64: cached plan vs rebuilding every step.

What one training (or evaluation) step costs a rank before any compute or communication: getting
its action list and p2p message order, building the step's ``PipelineP2P``, and issuing every
operation of the order. ``torch.distributed`` is replaced by a no-op recorder, so only Python
bookkeeping is timed.

- ``cached``: today's executor path: ``rank_plan`` (an LRU hit after the first step), then one
  ``recv_at`` / ``send_at`` per message the plan's steps name.
- ``rebuilt``: what every step did before plans were cached: build all ranks' schedule, simulate
  it with the reorder analysis, sort this rank's messages (``_order_as_before``), then the same
  issue loop addressing messages by ``Message``. (Its simulation is today's, whose reorder
  analysis is linear; before it was quadratic and a rebuilt step cost ~0.35-0.47 s at this size.)

Target: the cached overhead < 5 ms per rank per step (the slowest rank, rank 0 here). Besides
pytest-benchmark's wall-clock table, the summary prints the median thread CPU time of as many
extra steps (``time.thread_time``: the work itself, which a loaded shared machine stretches in
wall-clock time but not in CPU time).

    python3 -m pytest benchmarks/test_bench_schedule_overhead.py --benchmark-enable -q -s \
        --benchmark-columns=median,iqr,rounds -p no:cacheprovider
"""
import statistics
import time

import pytest
import torch

import tpfuse.pipeline.p2p as p2p_module
from tpfuse.pipeline.p2p import PipelineP2P
from tpfuse.pipeline.plan import rank_plan
from tpfuse.pipeline.schedules import build_schedule
from tpfuse.pipeline.simulate import Message, simulate

PP, VPP, M = 8, 4, 64
RANKS = (0, PP - 1)
SHAPE = (1,)
_MEDIANS: dict = {}


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


class _NoopDist:
    """Stands in for torch.distributed: every operation completes at once."""

    def isend(self, tensor, dst, group):
        return _Done()

    def irecv(self, tensor, src, group):
        return _Done()


def _order_as_before(schedule, rank):
    result = simulate(schedule, M, VPP)          # with the reorder analysis, as before
    keyed = [(result.message_times[msg], src, pos, msg)
             for (src, dst), sent in result.send_order.items() if rank in (src, dst)
             for pos, msg in enumerate(sent)]
    return [msg for *_, msg in sorted(keyed, key=lambda k: k[:3])]


def _cached_step(rank):
    plan = rank_plan("interleaved", PP, M, VPP, None, False, rank)
    comm = PipelineP2P(plan.messages, plan.position, rank, list(range(PP)), None, SHAPE)
    payload = torch.zeros(SHAPE)
    for _, recv_index, send_index in plan.steps:
        if recv_index is not None:
            comm.recv_at(recv_index)
        if send_index is not None:
            comm.send_at(send_index, payload)
    comm.finish()


def _rebuilt_step(rank):
    schedule = build_schedule(PP, M, VPP)
    order = _order_as_before(schedule, rank)
    comm = PipelineP2P(order, {m: i for i, m in enumerate(order)}, rank, list(range(PP)), None,
                       SHAPE)
    payload = torch.zeros(SHAPE)
    last = PP * VPP - 1
    for action in schedule[rank]:
        stage, mb = action.chunk * PP + rank, action.microbatch
        if action.kind == "F":
            if stage > 0:
                comm.recv(Message("act", mb, stage - 1, stage))
            if stage < last:
                comm.send(Message("act", mb, stage, stage + 1), payload)
        else:
            if stage < last:
                comm.recv(Message("grad", mb, stage + 1, stage))
            if stage > 0:
                comm.send(Message("grad", mb, stage, stage - 1), payload)
    comm.finish()


@pytest.fixture(autouse=True)
def noop_dist(monkeypatch):
    monkeypatch.setattr(p2p_module, "dist", _NoopDist())


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    for rank in RANKS:
        if {("cached", rank, "wall"), ("rebuilt", rank, "wall")} <= _MEDIANS.keys():
            for clock in ("wall", "thread CPU"):
                cached = _MEDIANS[("cached", rank, clock)]
                rebuilt = _MEDIANS[("rebuilt", rank, clock)]
                print(f"\npp={PP} vpp={VPP} m={M}, rank {rank}, {clock}: cached "
                      f"{cached * 1e3:.2f} ms/step, rebuilt {rebuilt * 1e3:.1f} ms/step, rebuilt / "
                      f"cached = {rebuilt / cached:.0f}x (target: cached < 5 ms)", end="")
    print()


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("path", ["cached", "rebuilt"])
def test_schedule_overhead_per_step(benchmark, path, rank):
    benchmark.group = f"schedule overhead per step, pp={PP} vpp={VPP} m={M}, rank {rank}"
    step = _cached_step if path == "cached" else _rebuilt_step
    step(rank)                                  # the first step fills the plan cache
    rounds = 50 if path == "cached" else 5
    benchmark.pedantic(step, args=(rank,), rounds=rounds, iterations=1)
    if benchmark.stats is not None:
        _MEDIANS[(path, rank, "wall")] = benchmark.stats.stats.median
        cpu_times = []
        for _ in range(rounds):
            start = time.thread_time()
            step(rank)
            cpu_times.append(time.thread_time() - start)
        _MEDIANS[(path, rank, "thread CPU")] = statistics.median(cpu_times)
