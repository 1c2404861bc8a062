"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) as data.

The backward of a stage is split into ``I`` (gradient w.r.t. its input: on the critical path,
the previous stage waits for it) and ``W`` (gradient w.r.t. its weights: nobody waits for it).
ZB-H1 keeps 1F1B's order of forwards and input-gradients (``I`` in ``B``'s place, warm-up
min(p − r − 1, m)) and therefore 1F1B's peak memory, and moves the ``W`` passes into the time a
rank would otherwise sit idle.

Construction (deterministic, from the costs): an event-driven pass over all ranks. Rank r may
keep up to r weight-gradient passes pending (the last rank, whose input-gradients everyone
upstream waits for, defers most; the first none); beyond that it runs its oldest pending W
first. Otherwise it runs its next F/I when the input has arrived, else a pending W, else waits;
leftover W's run after its last I. Every rank then holds at most p live micro-batches (F done,
W not yet): (p − r) from 1F1B's order plus r deferred — 1F1B's peak, reached on rank 0.

For m ≥ p and T_W ≤ min(T_F, T_I) (a W fits every wait) the makespan is
``m(T_F + T_I + T_W) + (p − 1)(T_F + T_I − T_W)``: the paper's ZB-H1 bubble, a third of 1F1B's
(p − 1)(T_F + T_I + T_W) when the three costs are equal. See :func:`zb_h1_bubble_formula`.

``tpfuse.pipeline.executor.forward_backward_pipelining_zb_h1`` runs it: I is the autograd backward
with the weight-gradient GEMMs of deferring layers queued, W runs that queue
(:mod:`tpfuse.kernels.wgrad_deferral`).
"""
from __future__ import annotations

from collections import deque

from .schedules import Action, _validate, build_schedule
from .simulate import Message, _inputs_of, _outputs_of


def zb_h1_bubble_formula(pp_size: int, num_microbatches: int, forward_cost: float = 1.0,
                         input_grad_cost: float = 1.0, weight_grad_cost: float = 1.0) -> float:
    """Idle share of ZB-H1's step: (p − 1)(F + I − W) / (m(F + I + W) + (p − 1)(F + I − W))."""
    _validate(pp_size, num_microbatches, 1)
    bubble = (pp_size - 1) * (forward_cost + input_grad_cost - weight_grad_cost)
    busy = num_microbatches * (forward_cost + input_grad_cost + weight_grad_cost)
    return bubble / (busy + bubble)


def _next_step(rank, pp_size, base, index, pending, alive, cap, free, ready):
    """(start time, Action) this rank would run next, or None while it must wait."""
    if index == len(base):
        return (free, pending[0]) if pending else None
    action = base[index]
    if len(pending) > cap:
        return free, pending[0]   # at most r weight gradients wait on rank r
    needs = [n for n in _inputs_of(action, rank, pp_size, 1) if isinstance(n, Message)]
    if all(n in ready for n in needs):
        arrival = max((ready[n] for n in needs), default=free)
        if arrival <= free or not pending:
            return max(free, arrival), action
    return (free, pending[0]) if pending else None


def build_zb_h1_schedule(pp_size: int, num_microbatches: int, forward_cost: float = 1.0,
                         input_grad_cost: float = 1.0, weight_grad_cost: float = 1.0) -> list:
    """Per rank the ordered F / I / W actions of ZB-H1 (one chunk per rank)."""
    _validate(pp_size, num_microbatches, 1)
    cost = {"F": forward_cost, "I": input_grad_cost, "W": weight_grad_cost}
    for name, value in zip(("forward_cost", "input_grad_cost", "weight_grad_cost"),
                           cost.values()):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    base = [[Action("I" if a.kind == "B" else "F", a.microbatch) for a in actions]
            for actions in build_schedule(pp_size, num_microbatches)]
    cap = list(range(pp_size))   # rank r may defer up to r weight-gradient passes
    index, free, alive = [0] * pp_size, [0.0] * pp_size, [0] * pp_size
    pending = [deque() for _ in range(pp_size)]
    ready: dict = {}
    schedule: list = [[] for _ in range(pp_size)]
    while True:
        steps = [(step, rank) for rank in range(pp_size)
                 if (step := _next_step(rank, pp_size, base[rank], index[rank], pending[rank],
                                        alive[rank], cap[rank], free[rank], ready))]
        if not steps:
            break
        (start, action), rank = min(steps, key=lambda s: (s[0][0], s[1]))
        free[rank] = start + cost[action.kind]
        schedule[rank].append(action)
        if action.kind == "W":
            pending[rank].popleft()
            alive[rank] -= 1
            continue
        index[rank] += 1
        if action.kind == "F":
            alive[rank] += 1
        else:
            pending[rank].append(Action("W", action.microbatch))
        for message in _outputs_of(action, rank, pp_size, 1):
            ready[message] = free[rank]
    if any(i < len(b) for i, b in zip(index, base)):   # pragma: no cover - 1F1B never deadlocks
        raise RuntimeError("ZB-H1 construction got stuck")
    return schedule
