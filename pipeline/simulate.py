"""Discrete-event simulation of all pipeline ranks executing their action lists together.

Model: rank r runs its actions strictly in list order, one at a time. An action costs
``forward_cost`` (F), ``backward_cost`` (B), or for the zero-bubble split ``input_grad_cost`` (I)
and ``weight_grad_cost`` (W). Chunk c of rank r is virtual stage ``s = c·p + r``; data
dependencies are the point-to-point messages of the pipeline:

- F(mb) at stage s > 0 needs the activation sent by F(mb) at stage s − 1;
- B(mb) (or I(mb)) at stage s < S − 1 needs the gradient sent by B/I(mb) at stage s + 1;
- on the same rank, B/I(mb, c) needs F(mb, c) earlier in the list, W needs I.

A message is available ``p2p_latency`` after its producer ends. An action starts at
max(rank free, inputs available). If no rank can start its next action while some still have
work, the schedule *deadlocks* (reported with every blocked rank's next action). The result also
lists the *reordered* directed links: those on which the receiver consumes messages in a
different order than the sender sends them (a FIFO-matched p2p without tags, such as NCCL's,
would hand it the wrong tensor there unless receives are posted in the sender's order — which is
what :mod:`tpfuse.pipeline.p2p` does), and the reordered *channels* (virtual stage s → s ± 1): a
valid schedule never reorders those. That analysis is for the simulator and the CLI: the p2p
plan (:mod:`tpfuse.pipeline.plan`) asks for ``analyze_reorders=False`` and reads only the send
order and message times.
Megatron's interleaved schedule with g > p does reorder physical links: e.g. p2 v2 m4 g4,
rank 1 sends activation 3 (stage 1→2) before gradient 0 (stage 3→2), rank 0 needs them the
other way round.

The bubble fraction is the idle share of ``p × makespan``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .schedules import Action


@dataclass(frozen=True)
class Message:
    """An activation (``"act"``, stage s → s + 1) or gradient (``"grad"``, s → s − 1)."""

    kind: str
    microbatch: int
    src_stage: int
    dst_stage: int


@dataclass
class SimulationResult:
    timelines: list          # per rank: [(Action, start, end), ...] of the actions that ran
    makespan: float
    bubble_fraction: float   # idle share of pp_size × makespan (nan when deadlocked)
    deadlocked: bool
    blocked: dict            # rank -> the Action it could not start (when deadlocked)
    reordered_links: list | None     # [(src_rank, dst_rank), ...] consumed in another order
    reordered_channels: list | None  # [(src_stage, dst_stage), ...] likewise, per channel
    #                                  (both None when simulated with analyze_reorders=False)
    send_order: dict = field(default_factory=dict)    # (src, dst) -> [Message] in send order
    message_times: dict = field(default_factory=dict)  # Message -> time it becomes available


class ScheduleError(ValueError):
    """An action list is not a valid execution (missing, duplicated or misordered actions)."""


def validate_actions(actions: list, num_microbatches: int, vpp_size: int, rank: int = 0) -> None:
    """Every (micro-batch, chunk) runs F once and its backward once (B, or I then W), F first."""
    position: dict = {}
    for index, action in enumerate(actions):
        key = (action.kind, action.microbatch, action.chunk)
        if not (0 <= action.microbatch < num_microbatches and 0 <= action.chunk < vpp_size):
            raise ScheduleError(f"rank {rank}: {action} is outside m={num_microbatches}, "
                                f"v={vpp_size}")
        if key in position:
            raise ScheduleError(f"rank {rank}: {action} appears twice")
        position[key] = index
    kinds = {a.kind for a in actions}
    split_backward = bool(kinds & {"I", "W"})
    needed = ("F", "I", "W") if split_backward else ("F", "B")
    for mb in range(num_microbatches):
        for chunk in range(vpp_size):
            order = []
            for kind in needed:
                if (kind, mb, chunk) not in position:
                    raise ScheduleError(f"rank {rank}: {kind}{mb}.{chunk} is missing")
                order.append(position[(kind, mb, chunk)])
            if order != sorted(order):
                raise ScheduleError(f"rank {rank}: {'/'.join(needed)} of micro-batch {mb} "
                                    f"chunk {chunk} run out of order")


def _inputs_of(action: Action, rank: int, pp_size: int, vpp_size: int) -> list:
    """(message or same-rank action key) that ``action`` waits for."""
    stage = action.chunk * pp_size + rank
    last_stage = pp_size * vpp_size - 1
    mb, chunk = action.microbatch, action.chunk
    if action.kind == "F":
        return [Message("act", mb, stage - 1, stage)] if stage > 0 else []
    if action.kind in ("B", "I"):
        needs = [("local", "F", mb, chunk)]
        if stage < last_stage:
            needs.append(Message("grad", mb, stage + 1, stage))
        return needs
    return [("local", "I", mb, chunk)]  # W


def _outputs_of(action: Action, rank: int, pp_size: int, vpp_size: int) -> list:
    stage = action.chunk * pp_size + rank
    last_stage = pp_size * vpp_size - 1
    if action.kind == "F" and stage < last_stage:
        return [Message("act", action.microbatch, stage, stage + 1)]
    if action.kind in ("B", "I") and stage > 0:
        return [Message("grad", action.microbatch, stage, stage - 1)]
    return []


def _rank_of(stage: int, pp_size: int) -> int:
    return stage % pp_size


def simulate(schedule: list, num_microbatches: int | None = None, vpp_size: int | None = None,
             forward_cost: float = 1.0, backward_cost: float = 2.0,
             input_grad_cost: float | None = None, weight_grad_cost: float | None = None,
             p2p_latency: float = 0.0, validate: bool = True,
             analyze_reorders: bool = True) -> SimulationResult:
    """Run every rank's action list against the others; see the module docstring.

    Cost: O(actions) for the timeline; ``analyze_reorders`` adds O(messages) for the reordered
    links / channels (left None when False)."""
    pp_size = len(schedule)
    if pp_size < 1:
        raise ValueError("schedule must hold at least one rank's action list")
    all_actions = [a for actions in schedule for a in actions]
    vpp_size = vpp_size or 1 + max((a.chunk for a in all_actions), default=0)
    num_microbatches = num_microbatches or 1 + max((a.microbatch for a in all_actions),
                                                   default=0)
    input_grad_cost = backward_cost / 2 if input_grad_cost is None else input_grad_cost
    weight_grad_cost = backward_cost / 2 if weight_grad_cost is None else weight_grad_cost
    cost = {"F": forward_cost, "B": backward_cost, "I": input_grad_cost, "W": weight_grad_cost}
    for name, value in (("forward_cost", forward_cost), ("backward_cost", backward_cost),
                        ("input_grad_cost", input_grad_cost),
                        ("weight_grad_cost", weight_grad_cost), ):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if p2p_latency < 0:
        raise ValueError(f"p2p_latency must be >= 0, got {p2p_latency}")
    if validate:
        for rank, actions in enumerate(schedule):
            if any(a.kind != "F" for a in actions):  # forward-only lists skip the pairing check
                validate_actions(actions, num_microbatches, vpp_size, rank)

    ready: dict = {}                        # Message or local key -> time available
    next_index = [0] * pp_size
    clock = [0.0] * pp_size
    timelines: list = [[] for _ in range(pp_size)]
    send_order: dict = defaultdict(list)
    progressed = True
    while progressed:
        progressed = False
        for rank in range(pp_size):
            while next_index[rank] < len(schedule[rank]):
                action = schedule[rank][next_index[rank]]
                needs = _inputs_of(action, rank, pp_size, vpp_size)
                if any(n not in ready for n in needs):
                    break
                start = max([clock[rank]] + [ready[n] for n in needs])
                end = start + cost[action.kind]
                timelines[rank].append((action, start, end))
                clock[rank] = end
                ready[("local", action.kind, action.microbatch, action.chunk)] = end
                for message in _outputs_of(action, rank, pp_size, vpp_size):
                    ready[message] = end + p2p_latency
                    send_order[(rank, _rank_of(message.dst_stage, pp_size))].append(message)
                next_index[rank] += 1
                progressed = True
    blocked = {r: schedule[r][i] for r, i in enumerate(next_index) if i < len(schedule[r])}
    makespan = max(clock)
    busy = sum(end - start for line in timelines for _, start, end in line)
    deadlocked = bool(blocked)
    bubble = float("nan") if deadlocked or makespan == 0 else 1.0 - busy / (pp_size * makespan)
    messages = {m: t for m, t in ready.items() if isinstance(m, Message)}
    links = channels = None
    if analyze_reorders:
        consumed = _consume_order(schedule, pp_size, vpp_size)
        links = _reordered(send_order, consumed, lambda m: (_rank_of(m.src_stage, pp_size),
                                                             _rank_of(m.dst_stage, pp_size)))
        channels = _reordered(send_order, consumed, lambda m: (m.src_stage, m.dst_stage))
    return SimulationResult(timelines, makespan, bubble, deadlocked, blocked, links, channels,
                            dict(send_order), messages)


def _consume_order(schedule, pp_size, vpp_size) -> list:
    """Every message in the order its receiver's action list needs it (rank by rank)."""
    return [need for rank, actions in enumerate(schedule) for action in actions
            for need in _inputs_of(action, rank, pp_size, vpp_size) if isinstance(need, Message)]


def _reordered(send_order, consumed, key) -> list:
    """Keys (links or channels) whose messages are consumed in another order than sent."""
    sent_by_key: dict = defaultdict(list)
    for messages in send_order.values():
        for message in messages:
            sent_by_key[key(message)].append(message)
    got_by_key: dict = defaultdict(list)
    for message in consumed:
        got_by_key[key(message)].append(message)
    reordered = []
    for k, sent in sent_by_key.items():
        sent_set = set(sent)
        if [m for m in got_by_key[k] if m in sent_set] != sent:
            reordered.append(k)
    return sorted(reordered)


def link_message_order(result: SimulationResult, rank_a: int, rank_b: int) -> list:
    """All messages between two ranks (both directions) in one total order both can follow.

    Ordered by the time each message becomes available, ties broken by the sender's rank and
    then its send position. Because every action has a positive cost, this order agrees with
    both ranks' program orders: if rank a consumes Y before producing X, then Y was available
    before that consuming action started, which is strictly before X is produced.
    """
    if result.deadlocked:
        raise ValueError("a deadlocked schedule has no message order")
    keyed = []
    for src, dst in ((rank_a, rank_b), (rank_b, rank_a)):
        for position, message in enumerate(result.send_order.get((src, dst), [])):
            keyed.append((result.message_times[message], src, position, message))
        if rank_a == rank_b:
            break
    return [message for *_, message in sorted(keyed, key=lambda k: k[:3])]
