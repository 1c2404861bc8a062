"""Helpers shared by the tp_layers tests (run inside the run_distributed workers).

Tolerance used throughout (``assert_close_fp32``): everything is fp32. A tensor-parallel layer
computes the same sums as the dense one in a different order (partial GEMMs over K/tp columns
summed by an all-reduce, reduce-scatter chunks, gradients accumulated per shard), so results
differ by rounding only: each reordered dot product of length K ≤ 128 carries a relative error of
order K·eps(fp32) ≈ 128 · 6e-8 ≈ 1e-5 in the worst case and ~√K·eps ≈ 1e-6 typically. Test
tensors are O(1) (unit-normal inputs, weights scaled 1/√fan_in), and some entries (gradients
summing terms of both signs, rotary angles pos·f computed in fp32 against a float64 reference)
cancel to ~0 while carrying the O(1) terms' absolute rounding, so we allow rtol = 1e-5 plus
atol = 1e-5. A wrong shard, a missing or double reduction or a misplaced bias shows up as errors
of order 1e-2 .. 1, far outside this band.
"""
import contextlib

import torch
import torch.distributed as dist

from tpfuse.parallel.state import ParallelState
from tpfuse.tp_layers.init import unshard

RTOL, ATOL = 1e-5, 1e-5
TP_SIZES = (1, 2, 4)


@contextlib.contextmanager
def tp_state(tp):
    """A ParallelState with this tp over the whole world (dp = world / tp), destroyed after."""
    state = ParallelState.initialize(tp=tp)
    try:
        yield state
    finally:
        state.destroy()


def tp_layouts(tps=TP_SIZES):
    """(tp, state) for every tp dividing the world size."""
    for tp in tps:
        if dist.get_world_size() % tp == 0:
            with tp_state(tp) as state:
                yield tp, state


def gather_tp(t, state):
    """Every TP rank's tensor ``t`` (same shape on each), in TP-rank order."""
    parts = [torch.empty_like(t) for _ in range(state.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=state.tp_group)
    return parts


def assembled(shard, state, dim, stride=1):
    """The full tensor reassembled from every TP rank's shard (partition ``dim``, ``stride``)."""
    return unshard(gather_tp(shard, state), dim, stride)


def chunk_of(t, state, dim):
    """This TP rank's contiguous chunk of ``t`` along ``dim`` (the sequence-parallel split)."""
    return torch.chunk(t, state.tp_size, dim=dim)[state.tp_rank]


def assert_close_fp32(actual, expected, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def seeded_randn(seed, *shape, scale=1.0):
    """The same random tensor on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def expect_value_error(fn, *fragments):
    """``fn()`` must raise ValueError whose message contains every fragment."""
    try:
        fn()
    except ValueError as err:
        for fragment in fragments:
            assert fragment in str(err), f"ValueError {err!r} does not mention {fragment!r}"
        return str(err)
    raise AssertionError(f"expected ValueError mentioning {fragments}")
