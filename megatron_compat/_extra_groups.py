"""The parts of Megatron-core's ``parallel_state`` beyond the layout's group kinds (what
``megatron_compat.parallel_state`` adds to tpfuse's facade).

Rank arithmetic (pure):

- ``generate_masked_orthogonal_rank_groups(world_size, parallel_size, mask)``: the groups that
  span the masked dimensions of the mixed radix ``parallel_size`` (first dimension fastest),
  one per combination of the other coordinates — ``RankLayout``'s ``orthogonal_groups``.
- ``RankGenerator(tp, ep, dp, pp, cp, order, rank_offset=0).get_ranks("tp-dp")``.
- ``hierarchical_rank_groups(ranks, sizes)``: level k cuts a group of Π sizes ranks into groups
  of ``sizes[k]`` ranks whose positions differ by the stride Π sizes[:k]: with sizes [2, 2, 4]
  over 16 ranks, level 0 is [0,1] [2,3] …, level 1 [0,2] [1,3] [4,6] …, level 2 [0,4,8,12] ….
- ``hybrid_rank_groups(ranks)``: consecutive blocks of 2, 4, … len/2 ranks (hybrid DP×CP).
- ``distributed_optimizer_instance_ranks(layout, instances)``: every ``edp / instances``
  consecutive expert tensor-model-pipeline groups form one optimizer instance.

Process groups: ``ExtraGroups`` builds, on every rank in the same order, the groups Megatron
creates next to the layout's (gloo copies of the data-parallel groups, hierarchical context
parallel, hybrid DP×CP, partial data parallel for distributed-optimizer instances) and destroys
them again. ``create_group`` / ``update_pg_timeout`` are Megatron's helpers; ``GlobalMemoryBuffer``
is its reusable scratch-tensor pool.
"""
from __future__ import annotations

import contextlib
import datetime
import math

import torch
import torch.distributed as dist

from tpfuse.parallel.checks import check_int_at_least
from tpfuse.parallel.layout import ORDER_TOKENS, orthogonal_groups, parse_order


# ----------------------------------------------------------------------------- rank arithmetic
def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size, mask) -> list:
    """Groups spanning the dimensions with ``mask[i]`` True of the radix ``parallel_size``."""
    parallel_size, mask = list(parallel_size), list(mask)
    if len(parallel_size) != len(mask):
        raise ValueError(f"parallel_size {parallel_size} and mask {mask} differ in length")
    if math.prod(parallel_size) != world_size:
        raise ValueError(f"world_size={world_size} != product of parallel_size {parallel_size}")
    tokens = tuple(f"d{i}" for i in range(len(parallel_size)))
    sizes = dict(zip(tokens, parallel_size))
    members = tuple(t for t, m in zip(tokens, mask) if m)
    return orthogonal_groups(tokens, sizes, members)


class RankGenerator:
    """Megatron's rank generator: groups of one decomposition (``ep`` or ``cp`` must be 1)."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str,
                 rank_offset: int = 0):
        if ep != 1 and cp != 1:
            raise ValueError(f"RankGenerator needs ep == 1 or cp == 1, got ep={ep}, cp={cp}")
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self.order = "-".join(parse_order(order, self.name_to_size, "decoder"))
        self.ordered_size = [self.name_to_size[t] for t in self.order.split("-")]

    def get_mask(self, order: str, token: str) -> list[bool]:
        ordered = order.split("-")
        wanted = token.split("-")
        for name in wanted:
            if name not in ORDER_TOKENS:
                raise ValueError(f"unknown parallel dimension {name!r} in {token!r}")
        return [name in wanted for name in ordered]

    def get_ranks(self, token: str) -> list[list[int]]:
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[rank + self.rank_offset for rank in group] for group in groups]


def default_embedding_ranks(pp_ranks):
    """The first and last stage of a pipeline (the first alone when pp = 1)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks):
    """The first stage of a pipeline."""
    return [pp_ranks[0]]


def hierarchical_rank_groups(ranks, sizes) -> list[list[list[int]]]:
    """Per level k, the groups of ``sizes[k]`` ranks at stride Π sizes[:k] (see module doc)."""
    sizes = list(sizes)
    if math.prod(sizes) != len(ranks):
        raise ValueError(f"hierarchical sizes {sizes} multiply to {math.prod(sizes)}, not to "
                         f"the group size {len(ranks)}")
    levels = []
    for level, size in enumerate(sizes):
        inner, outer = math.prod(sizes[:level]), math.prod(sizes[level + 1:])
        levels.append([[ranks[(o * size + s) * inner + i] for s in range(size)]
                       for o in range(outer) for i in range(inner)])
    return levels


def hybrid_rank_groups(ranks) -> dict[int, list[list[int]]]:
    """Group size → consecutive blocks of that size, for sizes 2, 4, … < len(ranks)."""
    if len(ranks) % 2:
        raise ValueError(f"hybrid context parallel needs an even DP×CP size, got {len(ranks)}")
    sizes = [2 ** i for i in range(1, int(math.log2(len(ranks))))]
    return {size: [list(ranks[i:i + size]) for i in range(0, len(ranks), size)]
            for size in sizes}


def distributed_optimizer_instance_ranks(layout, instances: int) -> list[list[int]]:
    """One rank list per distributed-optimizer instance (Megatron's intra-instance groups)."""
    per_instance = layout.edp // instances
    model_groups = layout.groups("etp-ep-pp")
    return [sum(model_groups[i:i + per_instance], [])
            for i in range(0, len(model_groups), per_instance)]


# ----------------------------------------------------------------------------- process groups
_PROCESS_GROUPS: list = [None]   # every group create_group made (None: the world group)


def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                 use_local_synchronization=False, group_desc=None):
    """``torch.distributed.new_group`` with Megatron's keywords; remembers the group for
    ``update_pg_timeout``."""
    kwargs = dict(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                  use_local_synchronization=use_local_synchronization)
    if group_desc is not None:
        kwargs["group_desc"] = group_desc
    group = dist.new_group(**kwargs)
    if ranks is None or dist.get_rank() in ranks:
        _PROCESS_GROUPS.append(group)
    return group


def forget_created_groups() -> None:
    del _PROCESS_GROUPS[1:]


def update_pg_timeout(timeout: datetime.timedelta, pg=None) -> None:
    """Set the timeout of ``pg`` (default: the world group and every group created here) after
    a barrier on it."""
    if not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"timeout must be a datetime.timedelta, got {timeout!r}")
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        raise RuntimeError("this torch build cannot change a process group's timeout "
                           "(torch.distributed.distributed_c10d._set_pg_timeout is missing)")
    dist.barrier(pg)
    member = dist.GroupMember.NON_GROUP_MEMBER
    groups = list(_PROCESS_GROUPS) if pg is None else [pg]
    for group in groups:
        if group is not member:
            setter(timeout, group)


class GlobalMemoryBuffer:
    """Named scratch tensors reused across calls: ``get_tensor(shape, dtype, name)`` returns a
    view of a buffer that grows when a larger request comes (contents are undefined)."""

    def __init__(self, device=None):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
        self.device = torch.device(device)
        self.buffer: dict = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = math.prod(tensor_shape)
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < numel:
            with (mem_alloc_context or contextlib.nullcontext)():
                self.buffer[key] = torch.empty(numel, dtype=dtype, device=self.device,
                                               requires_grad=False)
        return self.buffer[key][:numel].view(*tensor_shape)


class ExtraGroups:
    """The groups Megatron builds next to the layout's, for one ParallelState.

    ``gloo``: group kind ("dp", "dp-cp", "edp") → this rank's gloo group (the layout's own group
    when the world backend already is gloo); ``hierarchical_cp``: this rank's groups per level;
    ``hybrid_dp_cp``: size → group; ``dp_cp_all_gather``: a separate communicator over this rank's
dp × cp ranks (``create_all_gather_group=True``); ``partial_dp_cp`` / ``partial_edp`` / ``inter_partial_edp`` /
    ``intra_dist_opt``: the distributed-optimizer-instance groups.
    """

    def __init__(self, state, *, gloo: bool, hierarchical_cp_sizes=None, hybrid_cp=False,
                 instances: int = 1, timeout=None, all_gather: bool = False):
        self.state, self.timeout, self._created = state, timeout, []
        layout, rank = state.layout, state.rank
        # a second communicator over each dp × cp group, for all-gathers (None unless asked)
        self.dp_cp_all_gather = self._mine(layout.groups("dp-cp")) if all_gather else None
        self.gloo, self.hierarchical_cp, self.hybrid_dp_cp = {}, None, {}
        if gloo:
            for kind in ("dp", "dp-cp", "edp"):
                self.gloo[kind] = self._gloo_copy(kind)
        if hierarchical_cp_sizes:
            per_group = [hierarchical_rank_groups(r, hierarchical_cp_sizes)
                         for r in layout.groups("cp")]
            self.hierarchical_cp = [self._mine(sum((levels[k] for levels in per_group), []))
                                    for k in range(len(hierarchical_cp_sizes))]
        if hybrid_cp:
            per_group = [hybrid_rank_groups(r) for r in layout.groups("dp-cp")]
            for size in per_group[0]:
                self.hybrid_dp_cp[size] = self._mine(sum((g[size] for g in per_group), []))
        self.instances = instances
        self._build_instance_groups(layout, rank, instances, gloo)

    def _new(self, ranks, backend=None):
        group = create_group(list(ranks), timeout=self.timeout, backend=backend)
        self._created.append(group)
        return group

    def _mine(self, rank_lists):
        """Create every group of ``rank_lists`` (same order on every rank); return ours."""
        mine = None
        for ranks in rank_lists:
            group = self._new(ranks)
            if self.state.rank in ranks:
                mine = group
        return mine

    def _gloo_copy(self, kind):
        if "gloo" in str(dist.get_backend()).lower():
            return self.state.group(kind)
        mine = None
        for ranks in self.state.layout.groups(kind):
            group = self._new(ranks, backend="gloo")
            if self.state.rank in ranks:
                mine = group
        return mine

    def _build_instance_groups(self, layout, rank, instances, gloo):
        state = self.state
        if instances == 1:
            self.partial_dp_cp, self.partial_edp = state.group("dp-cp"), state.group("edp")
            self.partial_dp_cp_gloo = self.gloo.get("dp-cp")
            self.partial_edp_gloo = self.gloo.get("edp")
            self.inter_partial_edp = None
        else:
            per_dp_cp = (layout.dp * layout.cp) // instances
            self.partial_dp_cp = self._mine([r[i:i + per_dp_cp] for r in layout.groups("dp-cp")
                                             for i in range(0, len(r), per_dp_cp)])
            levels = [hierarchical_rank_groups(r, [layout.edp // instances, instances])
                      for r in layout.groups("edp")]
            self.partial_edp = self._mine(sum((lv[0] for lv in levels), []))
            self.inter_partial_edp = self._mine(sum((lv[1] for lv in levels), []))
            self.partial_dp_cp_gloo = self.partial_edp_gloo = None
            if gloo:
                self.partial_dp_cp_gloo = self._gloo_mine(
                    [r[i:i + per_dp_cp] for r in layout.groups("dp-cp")
                     for i in range(0, len(r), per_dp_cp)])
                self.partial_edp_gloo = self._gloo_mine(sum((lv[0] for lv in levels), []))
        self.intra_dist_opt = self._mine(distributed_optimizer_instance_ranks(layout, instances))

    def _gloo_mine(self, rank_lists):
        mine = None
        for ranks in rank_lists:
            group = self._new(ranks, backend="gloo")
            if self.state.rank in ranks:
                mine = group
        return mine

    def destroy(self) -> None:
        member = dist.GroupMember.NON_GROUP_MEMBER
        if dist.is_initialized():
            for group in reversed(self._created):
                if group is not None and group is not member:
                    dist.destroy_process_group(group)
        self._created = []


# ----------------------------------------------------------------------------- option checks
# initialize_model_parallel options tpfuse accepts only at their defaults (first value listed)
DEFAULT_ONLY = {
    "pipeline_model_parallel_comm_backend": (None, "nccl"),
    "use_sharp": (False,),
    "nccl_communicator_config_path": (None,),
    "get_embedding_ranks": (None, default_embedding_ranks),
    "get_position_embedding_ranks": (None, default_position_embedding_ranks),
    "high_priority_stream_groups": (None, []),
    "sharp_enabled_group": (None,),
}


def check_default_only(options: dict) -> None:
    for key, value in options.items():
        allowed = DEFAULT_ONLY[key]
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise ValueError(f"tpfuse does not support {key}={value!r} (only the default "
                             f"{allowed[0]!r})")


def check_extra_options(cp, hierarchical_cp_sizes, instances, world, tp, pp):
    if hierarchical_cp_sizes is not None and math.prod(hierarchical_cp_sizes) != cp:
        raise ValueError(f"hierarchical_context_parallel_sizes={hierarchical_cp_sizes} must "
                         f"multiply to context_parallel_size={cp}")
    check_int_at_least("num_distributed_optimizer_instances", instances, 1)
    dp_cp = world // (tp * pp * cp) * cp if world % (tp * pp * cp) == 0 else None
    if dp_cp is not None and dp_cp % instances:
        raise ValueError(f"num_distributed_optimizer_instances={instances} must divide the "
                         f"data-parallel × context-parallel size {dp_cp}")


def get_nccl_options(pg_name, nccl_comm_cfgs):
    """NCCL options of the group ``pg_name`` from a communicator-config dict (None if absent)."""
    if pg_name not in nccl_comm_cfgs:
        return None
    options_cls = getattr(dist, "ProcessGroupNCCL", None)
    if options_cls is None:
        raise RuntimeError(f"NCCL options for {pg_name!r} need a torch build with NCCL")
    config = nccl_comm_cfgs[pg_name]
    options = options_cls.Options(is_high_priority_stream=config.get("is_high_priority_stream",
                                                                     False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in config:
            setattr(options.config, key, config[key])
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set one option of group ``pg_name`` in a communicator-config dict."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def create_hierarchical_groups(rank, ranks, hierarchical_group_sizes,
                               create_gloo_process_groups=False, pg_options=None, timeout=None,
                               group_desc=None):
    """Create the groups of every level of ``hierarchical_rank_groups(ranks, sizes)``; returns
    (this rank's group per level, its gloo twin per level or None)."""
    mine, mine_gloo = [], []
    for level, groups in enumerate(hierarchical_rank_groups(ranks, hierarchical_group_sizes)):
        options = pg_options[level] if isinstance(pg_options, list) else pg_options
        for sub_ranks in groups:
            group = create_group(sub_ranks, timeout=timeout, pg_options=options)
            gloo = create_group(sub_ranks, timeout=timeout, backend="gloo") \
                if create_gloo_process_groups else None
            if rank in sub_ranks:
                mine.append(group)
                mine_gloo.append(gloo)
    return mine, mine_gloo


def create_hybrid_dp_cp_groups(rank, ranks, pg_options):
    """Create the hybrid DP×CP groups over ``ranks``; returns size → this rank's group."""
    mine = {}
    for size, groups in hybrid_rank_groups(ranks).items():
        for sub_ranks in groups:
            group = create_group(sub_ranks, pg_options=pg_options)
            if rank in sub_ranks:
                mine[size] = group
    return mine
