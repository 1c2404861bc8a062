"""ParallelState: the process groups of one RankLayout, passed explicitly to layers.

    state = ParallelState.initialize(tp=2, pp=2)          # over an initialised torch.distributed
    y = reduce_from_region(x, state.tp_group)
    state.destroy()                                        # leaves nothing behind

Group creation: every rank walks the same, deterministic list of distinct rank sets (all group
kinds of the layout, duplicates such as ep == tp groups created once) and calls
``torch.distributed.new_group`` for each, in the same order. ``new_group`` only does work on the
members of a group (gloo/nccl connect among them); non-members get ``NON_GROUP_MEMBER`` at once,
and no barrier is entered (``TORCH_DIST_INIT_BARRIER`` unset). Walking the full list on every rank
keeps torch's group counter — the group names — in agreement across ranks, which the hashed names
of ``use_local_synchronization=True`` do not guarantee when ranks belong to different numbers of
groups (embedding groups). Groups inherit the default group's timeout, so a stuck collective fails
as fast as one on the world group. Size-1 groups are real groups whose collectives are no-ops.

Before any group is created, the ranks all-gather a fingerprint of their layout (sizes, vpp,
order) over the world and raise a ValueError on every rank when they differ: mismatched
``new_group`` sequences would otherwise only fail at the collective timeout.

Distributed-optimizer instances (``num_distributed_optimizer_instances`` N, Megatron's
``--num-distributed-optimizer-instances``): the state also names ``intra-dp-cp`` / ``inter-dp-cp``
and ``intra-edp`` / ``inter-edp`` (``layout.split_into_instances``: each dp-cp / edp group cut
into N consecutive blocks, the shards' groups, and the groups across the blocks, the replicas').
With N = 1 the intra groups are the dp-cp / edp groups themselves and the inter groups hold only
the rank (no process group: ``group()`` is None, size 1); with N > 1 they are created after the
layout's groups, on every rank in the same order. N joins the fingerprint.

``destroy()`` destroys the groups it created, in reverse order, identically on every rank, so a
new ParallelState with other sizes can be built in the same processes.
"""
from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist

from .comm_options import CommOptions, options_or_default
from .devices import collective_device
from .layout import (DEFAULT_ORDER, GROUP_NAMES, INSTANCE_GROUP_NAMES, RankLayout,
                     check_distributed_optimizer_instances, check_vpp, instance_group_of,
                     instance_groups)

def _default_group_timeout() -> datetime.timedelta | None:
    """The timeout the default (world) group was initialised with, when torch exposes it
    (None: let ``new_group`` use torch's default)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        timeout = group._get_backend(collective_device()).options._timeout
    except Exception:  # pragma: no cover - private API; depends on the torch build
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def layout_fingerprint(layout: RankLayout, vpp_size: int | None,
                       instances: int = 1) -> list[int]:
    """The numbers every rank must agree on before any group is created."""
    return [layout.world_size, layout.tp, layout.pp, layout.cp, layout.ep, layout.etp,
            vpp_size or 0, instances, zlib.crc32(layout.order.encode())]


def check_same_layout_on_every_rank(layout: RankLayout, vpp_size: int | None,
                                    instances: int = 1) -> None:
    """Collective over the world (one small all-gather): ValueError on every rank when ranks
    were given different sizes, instead of mismatched ``new_group`` calls that would only fail at
    the collective timeout."""
    mine = torch.tensor(layout_fingerprint(layout, vpp_size, instances), dtype=torch.int64,
                        device=collective_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    fields = ("world_size", "tp", "pp", "cp", "ep", "etp", "vpp",
              "num_distributed_optimizer_instances", "order")
    first = everyone[0].tolist()
    for rank, theirs in enumerate(everyone):
        theirs = theirs.tolist()
        if theirs != first:
            differ = [f"{name}: rank 0 has {a}, rank {rank} has {b}" for name, a, b in
                      zip(fields, first, theirs) if a != b and name != "order"]
            if first[-1] != theirs[-1]:
                differ.append(f"order differs between rank 0 and rank {rank}")
            raise ValueError("ranks initialise model parallelism with different layouts ("
                             + "; ".join(differ) + "); every rank must pass the same sizes")


class ParallelState:
    """The process groups of ``layout`` on this rank, plus pipeline-stage helpers.

    ``.group(name)`` / ``.ranks(name)`` / ``.size(name)`` / ``.rank_in(name)`` for every name in
    ``layout.GROUP_NAMES``; properties ``tp_* pp_* dp_* cp_* dp_cp_* ep_* etp_* edp_* embedding_*
    position_embedding_*`` (``_group``, ``_rank``, ``_size``) for the common ones; ``dp`` excludes
    context parallelism, ``dp_cp`` includes it. Code that may run without an explicit state takes
    it through ``resolve_state`` / ``resolve_state_or_none`` (the one reader of the default).
    """

    def __init__(self, layout: RankLayout, vpp_size: int | None = None,
                 timeout: datetime.timedelta | None = None,
                 comm_options: CommOptions | None = None,
                 num_distributed_optimizer_instances: int = 1):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelState needs an initialised torch.distributed "
                               "(call torch.distributed.init_process_group first)")
        if not isinstance(layout, RankLayout):
            raise ValueError(f"layout must be a RankLayout, got {type(layout).__name__}")
        world_size = dist.get_world_size()
        if layout.world_size != world_size:
            raise ValueError(f"layout.world_size={layout.world_size} does not match the "
                             f"torch.distributed world size {world_size}")
        self.layout = layout
        self.comm_options = comm_options
        self.vpp_size = check_vpp(vpp_size, layout.pp)
        self.num_distributed_optimizer_instances = check_distributed_optimizer_instances(
            num_distributed_optimizer_instances, layout.dp * layout.cp, layout.edp)
        check_same_layout_on_every_rank(layout, self.vpp_size,
                                        self.num_distributed_optimizer_instances)
        self.vpp_rank = 0 if self.vpp_size is not None else None
        self.rank = dist.get_rank()
        self._ranks = {name: layout.group_of(name, self.rank) or [] for name in GROUP_NAMES}
        self._ranks.update(self._instance_ranks())
        self._created: list = []        # every handle new_group returned, in creation order
        self._groups: dict = {}         # name -> this rank's ProcessGroup (or None)
        self._build_groups(_default_group_timeout() if timeout is None else timeout)
        _LIVE_STATES.append(self)

    @classmethod
    def initialize(cls, tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1,
                   ep: int = 1, etp: int | None = None, order: str = DEFAULT_ORDER,
                   set_default: bool = False,
                   comm_options: CommOptions | None = None,
                   num_distributed_optimizer_instances: int = 1) -> "ParallelState":
        """Build the layout from the current world size and create its groups.

        All settings are validated (ValueError) before any group is created. With
        ``set_default=True`` the state also becomes the default (``get_default_state()``).
        ``comm_options``: how the layers' communication runs (``state.comm_options``).
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelState.initialize needs an initialised torch.distributed "
                               "(call torch.distributed.init_process_group first)")
        layout = RankLayout(dist.get_world_size(), tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                            order=order)
        check_vpp(vpp, pp)
        options_or_default(comm_options)
        state = cls(layout, vpp_size=vpp, comm_options=comm_options,
                    num_distributed_optimizer_instances=num_distributed_optimizer_instances)
        if set_default:
            set_default_state(state)
        return state

    @property
    def comm_options(self) -> CommOptions:
        """How the layers built on this state communicate (``parallel.comm_options``); layers
        read it at every call, so a new value takes effect at the next forward."""
        return self._comm_options

    @comm_options.setter
    def comm_options(self, options: CommOptions | None) -> None:
        self._comm_options = options_or_default(options)

    # ---------------------------------------------------------------- group creation / teardown
    def _build_groups(self, timeout) -> None:
        by_ranks: dict[tuple[int, ...], object] = {}
        for name in GROUP_NAMES:
            for ranks in self.layout.groups(name):
                key = tuple(ranks)
                if key not in by_ranks:
                    by_ranks[key] = dist.new_group(list(ranks), timeout=timeout)
                    self._created.append(by_ranks[key])
            mine = tuple(self._ranks[name])
            self._groups[name] = by_ranks[mine] if mine else None
        self._build_instance_groups(by_ranks, timeout)

    def _instance_ranks(self) -> dict:
        """name → this rank's ranks of each instance group kind (module docstring)."""
        instances = self.num_distributed_optimizer_instances
        ranks = {}
        for name in INSTANCE_GROUP_NAMES:
            base = "dp-cp" if name.endswith("dp-cp") else "edp"
            if instances == 1:
                ranks[name] = list(self._ranks[base]) if name.startswith("intra") else [self.rank]
            else:
                ranks[name] = instance_group_of(self.layout, name, instances, self.rank)
        return ranks

    def _build_instance_groups(self, by_ranks: dict, timeout) -> None:
        instances = self.num_distributed_optimizer_instances
        for name in INSTANCE_GROUP_NAMES:
            base = "dp-cp" if name.endswith("dp-cp") else "edp"
            if instances == 1:
                self._groups[name] = self._groups[base] if name.startswith("intra") else None
                continue
            for ranks in instance_groups(self.layout, name, instances):
                key = tuple(ranks)
                if key not in by_ranks:
                    by_ranks[key] = dist.new_group(list(ranks), timeout=timeout)
                    self._created.append(by_ranks[key])
            self._groups[name] = by_ranks[tuple(self._ranks[name])]

    @property
    def destroyed(self) -> bool:
        return self._groups is None

    def destroy(self) -> None:
        """Destroy every group this state created (idempotent); clears the default if it is us."""
        if self._groups is None:
            return
        member = dist.GroupMember.NON_GROUP_MEMBER
        if dist.is_initialized():
            for group in reversed(self._created):
                if group is not None and group is not member:
                    dist.destroy_process_group(group)
        self._created, self._groups = [], None
        if self in _LIVE_STATES:
            _LIVE_STATES.remove(self)
        if _DEFAULT_STATE is self:
            set_default_state(None)

    def _live(self) -> dict:
        if self._groups is None:
            raise RuntimeError("this ParallelState was destroyed; create a new one "
                               "(ParallelState.initialize or initialize_model_parallel)")
        return self._groups

    # ---------------------------------------------------------------- generic accessors
    def _check_name(self, name: str) -> None:
        if name not in self._ranks:
            raise ValueError(f"unknown group name {name!r}; known: {', '.join(GROUP_NAMES)}")

    def group(self, name: str):
        """This rank's ProcessGroup of kind ``name`` (None for an embedding group it is not in)."""
        self._check_name(name)
        return self._live()[name]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group of kind ``name`` ([] when it is in none)."""
        self._check_name(name)
        self._live()
        return list(self._ranks[name])

    def size(self, name: str) -> int:
        """Number of ranks in this rank's group of kind ``name`` (0 when it is in none)."""
        return len(self.ranks(name))

    def rank_in(self, name: str) -> int | None:
        """This rank's position in its group of kind ``name`` (None when it is in none)."""
        ranks = self.ranks(name)
        return ranks.index(self.rank) if ranks else None

    # ---------------------------------------------------------------- pipeline helpers
    def is_pipeline_first_stage(self, ignore_virtual: bool = True, vp_stage: int | None = None):
        """First pipeline stage; unless ``ignore_virtual``, also model chunk 0 (``vp_stage``,
        defaulting to ``vpp_rank``) when a virtual pipeline is configured."""
        if not ignore_virtual and self.vpp_size is not None:
            if self._vp_stage(vp_stage) != 0:
                return False
        return self.pp_rank == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = True, vp_stage: int | None = None):
        """Last pipeline stage; unless ``ignore_virtual``, also the last model chunk."""
        if not ignore_virtual and self.vpp_size is not None:
            if self._vp_stage(vp_stage) != self.vpp_size - 1:
                return False
        return self.pp_rank == self.pp_size - 1

    def _vp_stage(self, vp_stage):
        stage = self.vpp_rank if vp_stage is None else vp_stage
        if stage is None or not 0 <= stage < self.vpp_size:
            raise ValueError(f"vp_stage must be in [0, {self.vpp_size}) with vpp_size="
                             f"{self.vpp_size}, got {stage!r}")
        return stage

    def is_rank_in_embedding_group(self, ignore_virtual: bool = True,
                                   vp_stage: int | None = None) -> bool:
        """In the embedding group; unless ``ignore_virtual``, only with the chunk that holds the
        embedding (chunk 0 on the first stage, the last chunk on the last stage)."""
        ranks = self.ranks("embedding")
        if self.rank not in ranks:
            return False
        if ignore_virtual:
            return True
        if self.rank == ranks[0]:
            return self.is_pipeline_first_stage(False, vp_stage)
        if self.rank == ranks[-1]:
            return self.is_pipeline_last_stage(False, vp_stage)
        return True  # pragma: no cover - default embedding groups hold only first and last

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (the last stage's next is the first)."""
        ranks = self.ranks("pp")
        return ranks[(ranks.index(self.rank) + 1) % len(ranks)]

    @property
    def prev_pp_rank(self) -> int:
        """Global rank of the previous pipeline stage (the first stage's previous is the last)."""
        ranks = self.ranks("pp")
        return ranks[(ranks.index(self.rank) - 1) % len(ranks)]

    # ---------------------------------------------------------------- named shortcuts
    # ``<kind>_group`` / ``<kind>_rank`` / ``<kind>_size`` = group(name) / rank_in(name) / size(name)

    @property
    def tp_group(self):
        """This rank's tensor-parallel ProcessGroup (tp)."""
        return self.group("tp")

    @property
    def tp_rank(self) -> int | None:
        """This rank's position in its tensor-parallel group (tp)."""
        return self.rank_in("tp")

    @property
    def tp_size(self) -> int:
        """Ranks in this rank's tensor-parallel group (tp)."""
        return self.size("tp")

    @property
    def pp_group(self):
        """This rank's pipeline-parallel ProcessGroup (pp)."""
        return self.group("pp")

    @property
    def pp_rank(self) -> int | None:
        """This rank's position in its pipeline-parallel group (pp)."""
        return self.rank_in("pp")

    @property
    def pp_size(self) -> int:
        """Ranks in this rank's pipeline-parallel group (pp)."""
        return self.size("pp")

    @property
    def dp_group(self):
        """This rank's data-parallel (without cp) ProcessGroup (dp)."""
        return self.group("dp")

    @property
    def dp_rank(self) -> int | None:
        """This rank's position in its data-parallel (without cp) group (dp)."""
        return self.rank_in("dp")

    @property
    def dp_size(self) -> int:
        """Ranks in this rank's data-parallel (without cp) group (dp)."""
        return self.size("dp")

    @property
    def cp_group(self):
        """This rank's context-parallel ProcessGroup (cp)."""
        return self.group("cp")

    @property
    def cp_rank(self) -> int | None:
        """This rank's position in its context-parallel group (cp)."""
        return self.rank_in("cp")

    @property
    def cp_size(self) -> int:
        """Ranks in this rank's context-parallel group (cp)."""
        return self.size("cp")

    @property
    def dp_cp_group(self):
        """This rank's data-parallel × context-parallel ProcessGroup (dp-cp)."""
        return self.group("dp-cp")

    @property
    def dp_cp_rank(self) -> int | None:
        """This rank's position in its data-parallel × context-parallel group (dp-cp)."""
        return self.rank_in("dp-cp")

    @property
    def dp_cp_size(self) -> int:
        """Ranks in this rank's data-parallel × context-parallel group (dp-cp)."""
        return self.size("dp-cp")

    @property
    def ep_group(self):
        """This rank's expert-parallel ProcessGroup (ep)."""
        return self.group("ep")

    @property
    def ep_rank(self) -> int | None:
        """This rank's position in its expert-parallel group (ep)."""
        return self.rank_in("ep")

    @property
    def ep_size(self) -> int:
        """Ranks in this rank's expert-parallel group (ep)."""
        return self.size("ep")

    @property
    def etp_group(self):
        """This rank's expert tensor-parallel ProcessGroup (etp)."""
        return self.group("etp")

    @property
    def etp_rank(self) -> int | None:
        """This rank's position in its expert tensor-parallel group (etp)."""
        return self.rank_in("etp")

    @property
    def etp_size(self) -> int:
        """Ranks in this rank's expert tensor-parallel group (etp)."""
        return self.size("etp")

    @property
    def edp_group(self):
        """This rank's expert data-parallel ProcessGroup (edp)."""
        return self.group("edp")

    @property
    def edp_rank(self) -> int | None:
        """This rank's position in its expert data-parallel group (edp)."""
        return self.rank_in("edp")

    @property
    def edp_size(self) -> int:
        """Ranks in this rank's expert data-parallel group (edp)."""
        return self.size("edp")

    @property
    def embedding_group(self):
        """This rank's embedding (first and last stage) ProcessGroup (embedding)."""
        return self.group("embedding")

    @property
    def embedding_rank(self) -> int | None:
        """This rank's position in its embedding (first and last stage) group (embedding)."""
        return self.rank_in("embedding")

    @property
    def embedding_size(self) -> int:
        """Ranks in this rank's embedding (first and last stage) group (embedding)."""
        return self.size("embedding")

    @property
    def position_embedding_group(self):
        """This rank's position-embedding (first stage) ProcessGroup (position-embedding)."""
        return self.group("position-embedding")

    @property
    def position_embedding_rank(self) -> int | None:
        """This rank's position in its position-embedding (first stage) group (position-embedding)."""
        return self.rank_in("position-embedding")

    @property
    def position_embedding_size(self) -> int:
        """Ranks in this rank's position-embedding (first stage) group (position-embedding)."""
        return self.size("position-embedding")

    def __repr__(self) -> str:
        status = "destroyed" if self.destroyed else f"rank {self.rank}"
        return f"ParallelState({self.layout!r}, vpp_size={self.vpp_size}; {status})"


# -------------------------------------------------------------------- the default instance
_DEFAULT_STATE: ParallelState | None = None
_LIVE_STATES: list[ParallelState] = []   # created and not yet destroyed, oldest first


def destroy_all_states() -> None:
    """Destroy every live ParallelState of this process, newest first, and clear the default.

    ``destroy_model_parallel`` calls this, so a state a job forgot to destroy does not outlive
    the job in a reused worker process.
    """
    for state in reversed(list(_LIVE_STATES)):
        state.destroy()
    set_default_state(None)


def _distributed_running() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_state(state: ParallelState | None = None) -> ParallelState:
    """The one place the default ParallelState is read: ``state`` when given, else the default
    (set by ``initialize_model_parallel`` / ``set_default_state``); RuntimeError naming the fix
    when neither exists."""
    if state is not None:
        return state
    if _DEFAULT_STATE is None:
        raise RuntimeError(
            "model parallel state is not initialized: call "
            "tpfuse.parallel.parallel_state.initialize_model_parallel(...) (or "
            "set_default_state(ParallelState.initialize(...))) first, or pass state= explicitly")
    return _DEFAULT_STATE


def resolve_state_or_none(state: ParallelState | None = None) -> ParallelState | None:
    """``resolve_state(state)``, except that a plain single process (no default state and
    torch.distributed not initialised) gets None: every parallel size is 1 there, so layers work
    as ordinary modules. A distributed run without a state still raises: it must say which
    groups it means."""
    if state is None and _DEFAULT_STATE is None and not _distributed_running():
        return None
    return resolve_state(state)


def get_default_state() -> ParallelState:
    """The default ParallelState (``resolve_state()``: RuntimeError before one is set)."""
    return resolve_state(None)


def set_default_state(state: ParallelState | None) -> None:
    """Make ``state`` the default (None clears it; the old one is not destroyed)."""
    global _DEFAULT_STATE
    if state is not None and not isinstance(state, ParallelState):
        raise ValueError(f"set_default_state expects a ParallelState or None, "
                         f"got {type(state).__name__}")
    _DEFAULT_STATE = state


def has_default_state() -> bool:
    """Whether a default ParallelState is set (Megatron's ``model_parallel_is_initialized``)."""
    return _DEFAULT_STATE is not None
