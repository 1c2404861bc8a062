"""The process groups an MoE layer talks over, read once from a ParallelState.

    tp             the dense tensor-parallel group (router weight and shared expert under SP)
    seq_partition  the ranks sharing one micro-batch's tokens: tp × cp ("tp-cp")
    ep             expert parallel: each rank holds num_experts / ep experts, rank r the
                   consecutive block r·L .. r·L + L − 1 (L = local experts)
    etp            expert tensor parallel: each expert's fc1 / fc2 sharded over it
    etp_ep         the all-gather dispatcher's group; its members' (etp, ep) coordinates give
                   the order of the alltoall dispatcher's token-count table

``state=None`` means the default ParallelState; only a plain single process (none set,
torch.distributed not running) has every size 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tpfuse.parallel.comm_options import DEFAULT_COMM_OPTIONS, CommOptions
from tpfuse.parallel.state import resolve_state_or_none


@dataclass(frozen=True)
class MoEGroups:
    tp: object = None
    tp_size: int = 1
    seq_partition: object = None
    seq_partition_size: int = 1
    ep: object = None
    ep_size: int = 1
    ep_rank: int = 0
    etp: object = None
    etp_size: int = 1
    etp_rank: int = 0
    etp_ep: object = None
    etp_ep_size: int = 1
    etp_ep_coords: tuple = field(default=((0, 0),))   # (etp rank, ep rank) per etp_ep position
    options: CommOptions = DEFAULT_COMM_OPTIONS        # how the groups' reduce-scatters run

    @classmethod
    def from_state(cls, state=None) -> "MoEGroups":
        state = resolve_state_or_none(state)
        if state is None:
            return cls()
        layout = state.layout
        members = state.ranks("etp-ep")
        coords = tuple((layout.coords(r)["etp"], layout.coords(r)["ep"]) for r in members)
        return cls(tp=state.tp_group, tp_size=state.tp_size,
                   seq_partition=state.group("tp-cp"), seq_partition_size=state.size("tp-cp"),
                   ep=state.ep_group, ep_size=state.ep_size, ep_rank=state.ep_rank,
                   etp=state.etp_group, etp_size=state.etp_size, etp_rank=state.etp_rank,
                   etp_ep=state.group("etp-ep"), etp_ep_size=len(members),
                   etp_ep_coords=coords, options=state.comm_options)
