"""Pipeline schedules as data: each pipeline rank's ordered list of actions.

An :class:`Action` is one unit of work on one rank: a forward (``"F"``) or backward (``"B"``) of
one micro-batch through one model chunk (virtual stage). The zero-bubble ZB-H1 schedule splits
the backward into an input-gradient ``"I"`` and a weight-gradient ``"W"`` action.

Vocabulary: p pipeline ranks, v model chunks per rank (virtual pipeline size), m micro-batches,
g micro-batch group size. Chunk c of rank r is *virtual stage* ``c·p + r`` of a pipeline of
``p·v`` stages, so activations flow 0 → 1 → … → p−1 → (chunk+1 on rank 0) → … .

- ``vpp_size == 1``: plain 1F1B (PipeDream-flush). Rank r runs ``min(p − r − 1, m)`` warm-up
  forwards, then alternates one forward / one backward, then drains the remaining backwards.
- ``vpp_size > 1``: Megatron-core's interleaved schedule. Forward order follows a table built
  from micro-batches in blocks of g; inside a block every chunk in ascending order over the
  block's micro-batches (the last block takes the remainder). The k-th backward is the k-th entry
  of the same table with the chunk reversed (v − 1 − c). Warm-up is ``2·(p − r − 1) + (v − 1)·g``
  forwards, capped at m·v; the steady phase is forward-then-backward.

All functions here are pure (no torch, no processes).
"""
from __future__ import annotations

from dataclasses import dataclass

from tpfuse.parallel.checks import is_int

ACTION_KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` in F/B/I/W, micro-batch index, model chunk index."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"Action kind must be one of {ACTION_KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


def _check_positive_int(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_microbatch_group_size(pp_size: int, num_microbatches: int, group_size: int) -> None:
    """Megatron-core's constraints on the interleaved group size g: p ≤ g ≤ m and
    (m mod g == 0 or m mod g ≥ p); the last block must still fill the pipeline."""
    _check_positive_int("microbatch_group_size", group_size)
    if group_size < pp_size:
        raise ValueError(
            f"microbatch_group_size={group_size} must be >= pipeline size pp_size={pp_size}")
    if group_size > num_microbatches:
        raise ValueError(
            f"microbatch_group_size={group_size} must be <= num_microbatches={num_microbatches}"
            f" (interleaving with vpp > 1 needs num_microbatches >= pp_size={pp_size})")
    remainder = num_microbatches % group_size
    if remainder != 0 and remainder < pp_size:
        raise ValueError(
            f"num_microbatches={num_microbatches} mod microbatch_group_size={group_size} = "
            f"{remainder}: must be 0 or >= pp_size={pp_size}")


def interleaved_table(num_microbatches: int, vpp_size: int, group_size: int) -> list[tuple]:
    """Megatron-core's forward table: ``[(microbatch, chunk), ...]`` of length m·v."""
    table = []  # blocks of g micro-batches; only the last may be shorter (the remainder)
    for block_start in range(0, num_microbatches, group_size):
        block_end = min(block_start + group_size, num_microbatches)
        for chunk in range(vpp_size):
            table.extend((mb, chunk) for mb in range(block_start, block_end))
    return table


def warmup_forwards(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int = 1,
                    group_size: int | None = None) -> int:
    """Forwards a rank runs before its first backward is interleaved (what build_schedule uses:
    1F1B's for vpp 1, the interleaved one otherwise)."""
    if vpp_size == 1:
        return min(pp_size - pp_rank - 1, num_microbatches)
    return interleaved_warmup(pp_size, pp_rank, num_microbatches, vpp_size, group_size)


def interleaved_warmup(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int,
                       group_size: int | None = None) -> int:
    """Megatron's interleaved warm-up 2·(p − r − 1) + (v − 1)·g, capped at m·v."""
    group_size = pp_size if group_size is None else group_size
    warmup = 2 * (pp_size - pp_rank - 1) + (vpp_size - 1) * group_size
    return min(warmup, num_microbatches * vpp_size)


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """Warm-up forwards, then (forward, backward) pairs, then the remaining backwards."""
    steady = len(forwards) - warmup
    actions = list(forwards[:warmup])
    for k in range(steady):
        actions.append(forwards[warmup + k])
        actions.append(backwards[k])
    actions.extend(backwards[steady:])
    return actions


def _validate(pp_size, num_microbatches, vpp_size) -> None:
    _check_positive_int("pp_size", pp_size)
    _check_positive_int("num_microbatches", num_microbatches)
    _check_positive_int("vpp_size", vpp_size)


def build_schedule(pp_size: int, num_microbatches: int, vpp_size: int = 1,
                   microbatch_group_size: int | None = None) -> list[list[Action]]:
    """Per pipeline rank, the ordered list of actions (1F1B for vpp 1, interleaved otherwise).

    ``microbatch_group_size`` (Megatron's ``microbatch_group_size_per_vp_stage``) only matters
    for vpp > 1; it defaults to pp_size.
    """
    _validate(pp_size, num_microbatches, vpp_size)
    if vpp_size == 1:
        schedule = []
        for rank in range(pp_size):
            forwards = [Action("F", mb, 0) for mb in range(num_microbatches)]
            backwards = [Action("B", mb, 0) for mb in range(num_microbatches)]
            warmup = warmup_forwards(pp_size, rank, num_microbatches)
            schedule.append(_one_f_one_b(forwards, backwards, warmup))
        return schedule
    return build_interleaved_schedule(pp_size, num_microbatches, vpp_size, microbatch_group_size)


def build_interleaved_schedule(pp_size: int, num_microbatches: int, vpp_size: int,
                               microbatch_group_size: int | None = None) -> list[list[Action]]:
    """Megatron-core's interleaved order for any vpp_size, including 1 (where it is *not* plain
    1F1B: its warm-up is 2·(p − r − 1), capped at m)."""
    _validate(pp_size, num_microbatches, vpp_size)
    group_size = pp_size if microbatch_group_size is None else microbatch_group_size
    check_microbatch_group_size(pp_size, num_microbatches, group_size)
    table = interleaved_table(num_microbatches, vpp_size, group_size)
    forwards = [Action("F", mb, chunk) for mb, chunk in table]
    backwards = [Action("B", mb, vpp_size - 1 - chunk) for mb, chunk in table]
    return [
        _one_f_one_b(forwards, backwards,
                     interleaved_warmup(pp_size, rank, num_microbatches, vpp_size, group_size))
        for rank in range(pp_size)
    ]


def build_no_pipelining_schedule(num_microbatches: int) -> list[Action]:
    """Gradient accumulation on one stage: F0 B0 F1 B1 …"""
    _check_positive_int("num_microbatches", num_microbatches)
    return [Action(kind, mb, 0) for mb in range(num_microbatches) for kind in ("F", "B")]


def forward_only(actions: list[Action]) -> list[Action]:
    """The forwards of an action list, in order (what ``forward_only=True`` executes)."""
    return [a for a in actions if a.kind == "F"]


def bubble_fraction_formula(pp_size: int, num_microbatches: int, vpp_size: int = 1) -> float:
    """Idle share of the step time, (p − 1)/(v·m + p − 1) (1F1B: v = 1): the pipeline fill and
    drain add (p − 1) chunk-sized steps to each rank's m·v busy ones. Delegates to
    ``tpfuse.parallel.microbatches.bubble_fraction`` (pure, one definition in the project)."""
    _validate(pp_size, num_microbatches, vpp_size)
    from tpfuse.parallel.microbatches import bubble_fraction

    return bubble_fraction(pp_size, num_microbatches, vpp_size)


def format_actions(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)
