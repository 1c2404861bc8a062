"""A rank's pipeline plan: its actions and its p2p issue order, computed once and cached.

Building a schedule and simulating it for the p2p message order (:mod:`tpfuse.pipeline.p2p`) costs
O(actions) Python work — tens of milliseconds at pp 8, vpp 4, m 64 — and depends only on the
configuration, never on the data. :func:`rank_plan` therefore computes it once per
``(schedule kind, pp, m, vpp, group size, forward_only)`` (all ranks from one simulation, then
rank ``pp_rank``'s share) and every later training or evaluation step reuses the same immutable
:class:`RankPlan`; what is left per step is O(1) work per action.

A plan ``steps`` entry is ``(action, recv_index, send_index)``: the position, in this rank's
message order, of the message the action waits for and of the one it sends (None when there is
none), so the executor never builds or hashes a message on the hot path.

Schedule kinds (``SCHEDULE_KINDS``): ``"1f1b"`` (one chunk per rank), ``"interleaved"``
(Megatron's virtual pipeline order, any v ≥ 1), ``"zb-h1"`` (zero-bubble, one chunk per rank).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType

from .schedules import build_interleaved_schedule, build_schedule, forward_only as forwards_of
from .simulate import Message, _inputs_of, _outputs_of, simulate

SCHEDULE_KINDS = ("1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank's share of a schedule (immutable, shared between steps)."""

    actions: tuple        # (Action, ...) in execution order
    messages: tuple       # (Message, ...) every message sent or received, in issue order
    position: MappingProxyType   # Message -> index in ``messages``
    steps: tuple          # ((Action, recv_index | None, send_index | None), ...)


def _build(kind: str, pp_size: int, num_microbatches: int, vpp_size: int, group_size):
    if kind == "1f1b":
        return build_schedule(pp_size, num_microbatches)
    if kind == "interleaved":
        return build_interleaved_schedule(pp_size, num_microbatches, vpp_size, group_size)
    if kind == "zb-h1":
        from .zero_bubble import build_zb_h1_schedule

        return build_zb_h1_schedule(pp_size, num_microbatches)
    raise ValueError(f"pipeline schedule must be one of {SCHEDULE_KINDS}, got {kind!r}")


def message_orders(result, pp_size: int) -> list:
    """Per pp rank, every message it sends or receives in the order it issues them: by (time the
    message becomes available, sender's pp rank, sender's send position). Both ends of a message
    compute the same key, so both ranks of a link agree (see :mod:`tpfuse.pipeline.p2p`)."""
    if result.deadlocked:
        blocked = ", ".join(f"rank {r}: {a}" for r, a in sorted(result.blocked.items()))
        raise ValueError(f"the schedule deadlocks (blocked at {blocked})")
    keyed: list = [[] for _ in range(pp_size)]
    for (src, dst), sent in result.send_order.items():
        for position, message in enumerate(sent):
            key = (result.message_times[message], src, position, message)
            keyed[src].append(key)
            if dst != src:
                keyed[dst].append(key)
    return [[message for *_, message in sorted(keys, key=lambda k: k[:3])] for keys in keyed]


def _steps(actions, rank: int, pp_size: int, vpp_size: int, position) -> tuple:
    """(action, index of the message it receives, index of the message it sends) per action."""
    steps = []
    for action in actions:
        needs = [n for n in _inputs_of(action, rank, pp_size, vpp_size) if isinstance(n, Message)]
        sends = _outputs_of(action, rank, pp_size, vpp_size)
        steps.append((action, position[needs[0]] if needs else None,
                      position[sends[0]] if sends else None))
    return tuple(steps)


@functools.lru_cache(maxsize=32)
def _plans(kind, pp_size, num_microbatches, vpp_size, group_size, forward_only) -> tuple:
    schedule = _build(kind, pp_size, num_microbatches, vpp_size, group_size)
    if forward_only:
        schedule = [forwards_of(actions) for actions in schedule]
    result = simulate(schedule, num_microbatches, vpp_size, analyze_reorders=False)
    plans = []
    for rank, (actions, order) in enumerate(zip(schedule, message_orders(result, pp_size))):
        position = MappingProxyType({message: i for i, message in enumerate(order)})
        plans.append(RankPlan(tuple(actions), tuple(order), position,
                              _steps(actions, rank, pp_size, vpp_size, position)))
    return tuple(plans)


def rank_plan(kind: str, pp_size: int, num_microbatches: int, vpp_size: int = 1,
              group_size: int | None = None, forward_only: bool = False,
              pp_rank: int = 0) -> RankPlan:
    """This rank's cached plan; ValueError for invalid settings (before any communication)."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULE_KINDS}, got {kind!r}")
    if kind != "interleaved":
        if vpp_size != 1:
            raise ValueError(f"the {kind} schedule runs one model chunk per rank, got "
                             f"vpp_size={vpp_size}")
        group_size = None
    elif group_size is None:
        group_size = pp_size      # Megatron's default microbatch_group_size_per_vp_stage
    plans = _plans(kind, pp_size, num_microbatches, vpp_size, group_size, bool(forward_only))
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside the pipeline of size {pp_size}")
    return plans[pp_rank]


def clear_plan_cache() -> None:
    """Forget every cached plan (tests; a long job never needs it: the cache holds 32)."""
    _plans.cache_clear()
