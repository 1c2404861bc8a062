"""Which tensor-parallel group a layer works in: an explicit group, a ParallelState, or the default.

Layers take ``group=`` (a ``torch.distributed`` ProcessGroup, the TP group) or ``state=`` (a
``ParallelState``); with neither they use the default state
(``tpfuse.parallel.state.resolve_state_or_none``, set up by
``parallel_state.initialize_model_parallel``). A plain single process (``torch.distributed`` not
initialised, no default state) is tensor-parallel size 1, so the layers also work as ordinary
modules in a notebook.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from tpfuse.parallel.comm_options import DEFAULT_COMM_OPTIONS, CommOptions
from tpfuse.parallel.state import resolve_state_or_none


def _options_of(state) -> CommOptions:
    return DEFAULT_COMM_OPTIONS if state is None else state.comm_options


@dataclass(frozen=True)
class TPGroup:
    """The TP ProcessGroup (None for a non-distributed single process), its size and our rank;
    ``options``: the communication options of the ParallelState it came from, read at each call
    (the defaults for a bare group)."""
    group: object
    size: int
    rank: int
    state: object = field(default=None, compare=False, repr=False)

    @property
    def options(self) -> CommOptions:
        return _options_of(self.state)


def resolve_tp_group(group=None, state=None, expert: bool = False) -> TPGroup:
    """``expert=True`` takes the state's expert tensor-parallel group (Megatron's ``is_expert``)."""
    if group is not None and state is not None:
        raise ValueError("pass either group= or state=, not both")
    if group is not None:
        return TPGroup(group, dist.get_world_size(group), dist.get_rank(group))
    state = resolve_state_or_none(state)
    if state is None:
        return TPGroup(None, 1, 0)
    if expert:
        return TPGroup(state.etp_group, state.etp_size, state.etp_rank, state)
    return TPGroup(state.tp_group, state.tp_size, state.tp_rank, state)


@dataclass(frozen=True)
class CPGroup:
    """The context-parallel ProcessGroup (None at size 1), its global ranks in cp order, our rank.

    The ring of ring attention runs in cp order: rank i sends to ``next_rank`` = ranks[i + 1]."""
    group: object
    ranks: tuple
    rank: int
    state: object = field(default=None, compare=False, repr=False)

    @property
    def options(self) -> CommOptions:
        """The communication options of the ParallelState it came from (defaults otherwise)."""
        return _options_of(self.state)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


def resolve_cp_group(cp_group=None, state=None, tp_group=None) -> CPGroup:
    """An explicit ``cp_group``; else ``state``'s cp group (the default state when no explicit
    TP ``tp_group`` was given either); else context-parallel size 1."""
    if cp_group is not None:
        ranks = tuple(dist.get_process_group_ranks(cp_group))
        return CPGroup(cp_group if len(ranks) > 1 else None, ranks, dist.get_rank(cp_group))
    if state is None and tp_group is None:
        state = resolve_state_or_none()
    if state is None or state.cp_size == 1:
        return CPGroup(None, (dist.get_rank() if dist.is_initialized() else 0,), 0)
    return CPGroup(state.cp_group, tuple(state.ranks("cp")), state.cp_rank, state)
