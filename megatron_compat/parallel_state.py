"""megatron-core 0.16's ``parallel_state`` module over tpfuse's default ParallelState.

    from tpfuse.megatron_compat import parallel_state as mpu
    mpu.initialize_model_parallel(2, 2)             # Megatron's positional order; returns None
    mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_group_gloo(), ...
    mpu.destroy_model_parallel()

Every public function of Megatron's module is here, with its parameters and semantics. The group,
rank and size getters of the layout's group kinds are tpfuse's thin facade
(``tpfuse.parallel.parallel_state``, re-exported); this module adds what is Megatron's alone:

* ``initialize_model_parallel`` with every Megatron argument (positional, in Megatron's order;
  ``distributed_timeout_minutes=30``), returning None;
* the setters (``set_tensor_model_parallel_world_size(2)`` ...): the matching getter returns
  that value from then on, initialised or not — Megatron code and tests use this to mock a layout
  without processes. An override applies to that getter of this module only (the groups, the
  native facade and ``ParallelState`` objects passed to layers are unchanged); before
  initialisation the expert-tensor getters fall back to the tensor-parallel overrides, and the
  virtual-pipeline setters store their value until a state exists (then they set the state's);
* the groups Megatron creates next to the layout's (``_extra_groups.ExtraGroups``: gloo twins of
  the data-parallel groups, hierarchical context parallel, hybrid DP×CP, the
  distributed-optimizer-instance groups, with ``create_all_gather_group=True`` a second dp × cp
  communicator for all-gathers), the FP8 amax-reduction group and ``get_global_memory_buffer``;
* Megatron's group globals (``_MODEL_PARALLEL_GROUP``, ``_DATA_PARALLEL_GROUP_WITH_CP_AG``, ...):
  read, they give the default state's group (None before initialisation); set (Megatron's tests
  set them to None), the matching getter returns the value or raises as Megatron's does;
* ``RankGenerator``, ``generate_masked_orthogonal_rank_groups``, ``create_group``,
  ``update_pg_timeout`` and the NCCL-option helpers.

``destroy_model_parallel`` (this module's or the facade's) destroys the extra groups, forgets
every override and destroys every live ParallelState. Differences from Megatron, all deliberate:
a getter before initialisation raises ``ModelParallelNotInitializedError`` (a RuntimeError and an
AssertionError) saying so, as does ``initialize_model_parallel`` before torch.distributed is
initialised; invalid sizes raise ``ParallelSizeError`` (a ValueError naming the setting, and the
RuntimeError Megatron raises) before any group is created; options that change communication libraries (SHARP, UCC, NCCL configs,
high-priority streams) and custom embedding ranks are accepted only
at their defaults; the embedding-group getters on a middle stage raise unless
``check_initialized=False``; ``is_pipeline_first/last_stage(ignore_virtual=False)`` without
``vp_stage`` uses the running virtual rank (Megatron asserts instead).
"""
from __future__ import annotations

import datetime
import sys
import types
import warnings

import torch.distributed as dist

from tpfuse.parallel import parallel_state as _native
from tpfuse.parallel.checks import check_int_at_least_or_none, is_int
from tpfuse.parallel.layout import DEFAULT_ORDER
from tpfuse.parallel.parallel_state import (  # noqa: F401  (the same in Megatron and tpfuse)
    ModelParallelNotInitializedError, destroy_model_parallel, get_context_parallel_global_ranks,
    get_context_parallel_rank, get_context_parallel_world_size,
    get_data_parallel_global_ranks, get_data_parallel_src_rank, get_embedding_global_ranks,
    get_embedding_group, get_expert_model_parallel_group, get_expert_model_parallel_src_rank,
    get_expert_tensor_and_model_parallel_group, get_expert_tensor_and_model_parallel_rank,
    get_expert_tensor_and_model_parallel_world_size,
    get_expert_tensor_model_pipeline_parallel_group, get_expert_tensor_parallel_group,
    get_model_parallel_src_rank, get_pipeline_model_parallel_global_ranks,
    get_position_embedding_group,
    get_tensor_and_context_parallel_group, get_tensor_and_context_parallel_rank,
    get_tensor_and_context_parallel_world_size, get_tensor_and_data_parallel_group,
    get_tensor_model_parallel_global_ranks, get_tensor_model_parallel_src_rank, is_initialized, is_rank_in_position_embedding_group,
    model_parallel_is_initialized)
from tpfuse.parallel.parallel_state import _state  # the default state, or Megatron's error
from tpfuse.parallel.state import (ParallelState, destroy_all_states,  # noqa: F401  (as before)
                                   get_default_state, has_default_state, resolve_state,
                                   set_default_state)

from ._extra_groups import (  # noqa: F401  (Megatron's names)
    ExtraGroups, GlobalMemoryBuffer, RankGenerator, check_default_only, check_extra_options,
    create_group, create_hierarchical_groups, create_hybrid_dp_cp_groups,
    default_embedding_ranks, default_position_embedding_ranks, forget_created_groups,
    generate_masked_orthogonal_rank_groups, get_nccl_options, overwrite_nccl_comm_cfgs,
    update_pg_timeout)

class ParallelSizeError(ValueError, RuntimeError):
    """Sizes that do not fit the world: a ValueError naming the setting (tpfuse's), and the
    RuntimeError Megatron's ``initialize_model_parallel`` raises for them."""


class AlreadyInitializedError(AssertionError, RuntimeError):
    """``initialize_model_parallel`` twice: Megatron's assert (and a RuntimeError)."""


class _Overrides:
    """What the setters stored: getter name → value (None = not set)."""

    def __init__(self):
        self.values: dict[str, int | None] = {}

    def get(self, name: str):
        return self.values.get(name)

    def set(self, name: str, value) -> None:
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        self.values[name] = value

    def clear(self) -> None:
        self.values.clear()


class _MegatronGroups:
    """What initialize_model_parallel built beyond the ParallelState (destroyed with it)."""
    extra: ExtraGroups | None = None
    memory_buffer: GlobalMemoryBuffer | None = None


OVERRIDES = _Overrides()
_GROUPS = _MegatronGroups()


def _destroy_megatron_state() -> None:
    """The extra groups, the memory buffer and every override (a destroy hook of the facade)."""
    if _GROUPS.extra is not None:
        _GROUPS.extra.destroy()
    _GROUPS.extra = _GROUPS.memory_buffer = None
    forget_created_groups()
    OVERRIDES.clear()
    _ASSIGNED.clear()


_native.register_destroy_hook(_destroy_megatron_state)


# ----------------------------------------------------------------------------- initialisation
def initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_comm_backend=None,
        use_sharp=False, context_parallel_size=1, hierarchical_context_parallel_sizes=None,
        hybrid_context_parallel=False, expert_model_parallel_size=1,
        num_distributed_optimizer_instances=1, expert_tensor_parallel_size=None,
        nccl_communicator_config_path=None, distributed_timeout_minutes=30,
        order=DEFAULT_ORDER, get_embedding_ranks=None, get_position_embedding_ranks=None,
        create_gloo_process_groups=True, high_priority_stream_groups=None,
        sharp_enabled_group=None, create_all_gather_group=False) -> None:
    """Build every group (the layout's, then Megatron's extra ones) and make the new
    ParallelState the default. Every option is checked before any group is created."""
    check_default_only(dict(
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        use_sharp=use_sharp, nccl_communicator_config_path=nccl_communicator_config_path,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        high_priority_stream_groups=high_priority_stream_groups,
        sharp_enabled_group=sharp_enabled_group))
    if not dist.is_initialized():
        raise ModelParallelNotInitializedError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group "
            "before initialize_model_parallel")
    sizes = dict(context_parallel_size=context_parallel_size,
                 expert_model_parallel_size=expert_model_parallel_size,
                 expert_tensor_parallel_size=expert_tensor_parallel_size, order=order)
    try:
        if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size < 2:
            raise ValueError("pipeline_model_parallel_size should be greater than 1 with the "
                             f"interleaved schedule (virtual_pipeline_model_parallel_size="
                             f"{virtual_pipeline_model_parallel_size})")
        layout = _native.model_parallel_layout(tensor_model_parallel_size,
                                               pipeline_model_parallel_size, **sizes)
        check_extra_options(context_parallel_size, hierarchical_context_parallel_sizes,
                            num_distributed_optimizer_instances, layout.world_size, layout.tp,
                            layout.pp)
        if layout.edp % num_distributed_optimizer_instances:
            raise ValueError(f"num_distributed_optimizer_instances="
                             f"{num_distributed_optimizer_instances} must divide the expert "
                             f"data-parallel size edp={layout.edp}")
    except ValueError as error:
        raise ParallelSizeError(str(error)) from None
    if has_default_state():   # after the size checks, as Megatron's group asserts
        raise AlreadyInitializedError("model parallel is already initialized; call "
                                      "destroy_model_parallel() first")
    _ASSIGNED.clear()
    state = _native.initialize_model_parallel(
        tensor_model_parallel_size, pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=distributed_timeout_minutes, **sizes)
    try:
        _GROUPS.extra = ExtraGroups(
            state, gloo=create_gloo_process_groups,
            hierarchical_cp_sizes=hierarchical_context_parallel_sizes,
            hybrid_cp=hybrid_context_parallel, instances=num_distributed_optimizer_instances,
            timeout=_timeout(distributed_timeout_minutes),
            all_gather=bool(create_all_gather_group))
    except BaseException:
        state.destroy()
        raise
    _GROUPS.memory_buffer = GlobalMemoryBuffer()


def _timeout(minutes):
    """``datetime.timedelta(minutes=...)``; None for None (the world group's timeout)."""
    return None if minutes is None else datetime.timedelta(minutes=minutes)


def is_unitialized() -> bool:
    """Deprecated in Megatron (sic): ``not is_initialized()``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning,
                  stacklevel=2)
    return not has_default_state()


# ----------------------------------------------------------------------------- setters
def set_tensor_model_parallel_world_size(world_size):
    OVERRIDES.set("tp_size", world_size)


def set_tensor_model_parallel_rank(rank):
    OVERRIDES.set("tp_rank", rank)


def set_pipeline_model_parallel_world_size(world_size):
    OVERRIDES.set("pp_size", world_size)


def set_pipeline_model_parallel_rank(rank):
    OVERRIDES.set("pp_rank", rank)


def set_data_parallel_rank(rank):
    OVERRIDES.set("dp_rank", rank)


def set_expert_model_parallel_world_size(world_size):
    OVERRIDES.set("ep_size", world_size)


def set_expert_model_parallel_rank(rank):
    OVERRIDES.set("ep_rank", rank)


def set_expert_tensor_parallel_world_size(world_size):
    OVERRIDES.set("etp_size", world_size)


def set_expert_tensor_parallel_rank(rank):
    OVERRIDES.set("etp_rank", rank)


def set_virtual_pipeline_model_parallel_rank(rank):
    """Set the running model chunk (deprecated in Megatron in favour of passing vp_stage)."""
    warnings.warn("set_virtual_pipeline_model_parallel_rank in global scope is deprecated; pass "
                  "vp_stage to is_pipeline_first_stage / is_pipeline_last_stage instead",
                  DeprecationWarning, stacklevel=2)
    size = get_virtual_pipeline_model_parallel_world_size()
    if rank is not None and size is not None and (not is_int(rank) or
                                                  not 0 <= rank < size):
        raise ValueError(f"virtual pipeline rank must be in [0, {size}) (vpp_size={size}), "
                         f"got {rank!r}")
    if has_default_state():
        resolve_state().vpp_rank = rank
    else:
        OVERRIDES.set("vpp_rank", rank)


def set_virtual_pipeline_model_parallel_world_size(world_size):
    check_int_at_least_or_none("virtual pipeline world size", world_size, 1)
    if has_default_state():
        resolve_state().vpp_size = world_size
    else:
        OVERRIDES.set("vpp_size", world_size)


# ----------------------------------------------------------------------------- overridable getters
def _overridden(name: str, native_getter):
    value = OVERRIDES.get(name)
    return native_getter() if value is None else value


def get_tensor_model_parallel_rank():
    return _overridden("tp_rank", _native.get_tensor_model_parallel_rank)


def get_tensor_model_parallel_world_size():
    return _overridden("tp_size", _native.get_tensor_model_parallel_world_size)


def get_pipeline_model_parallel_rank():
    return _overridden("pp_rank", _native.get_pipeline_model_parallel_rank)


def get_pipeline_model_parallel_world_size():
    return _overridden("pp_size", _native.get_pipeline_model_parallel_world_size)


def get_expert_model_parallel_rank():
    return _overridden("ep_rank", _native.get_expert_model_parallel_rank)


def get_expert_model_parallel_world_size():
    return _overridden("ep_size", _native.get_expert_model_parallel_world_size)


def get_expert_tensor_parallel_rank():
    """Override, else the etp group's rank; before initialisation Megatron falls back to the
    tensor-parallel override."""
    if OVERRIDES.get("etp_rank") is None and not has_default_state() \
            and OVERRIDES.get("tp_rank") is not None:
        return OVERRIDES.get("tp_rank")
    return _overridden("etp_rank", _native.get_expert_tensor_parallel_rank)


def get_expert_tensor_parallel_world_size():
    if OVERRIDES.get("etp_size") is None and not has_default_state() \
            and OVERRIDES.get("tp_size") is not None:
        return OVERRIDES.get("tp_size")
    return _overridden("etp_size", _native.get_expert_tensor_parallel_world_size)


def _no_partial_rank(partial_data_parallel: bool) -> None:
    if partial_data_parallel:
        raise ValueError("partial_data_parallel=True: the partial data-parallel rank and size "
                         "are those of get_data_parallel_group(with_context_parallel=True, "
                         "partial_data_parallel=True)")


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    if OVERRIDES.get("dp_rank") is not None:
        return OVERRIDES.get("dp_rank")
    if partial_data_parallel:
        return get_data_parallel_group(with_context_parallel, partial_data_parallel=True).rank()
    return _native.get_data_parallel_rank(with_context_parallel)


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    if partial_data_parallel:
        return get_data_parallel_group(with_context_parallel, partial_data_parallel=True).size()
    return _native.get_data_parallel_world_size(with_context_parallel)


def get_expert_data_parallel_rank(partial_expert_data_parallel=False):
    if partial_expert_data_parallel:
        return get_expert_data_parallel_group(partial_expert_data_parallel=True).rank()
    return _native.get_expert_data_parallel_rank()


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False):
    if partial_expert_data_parallel:
        return get_expert_data_parallel_group(partial_expert_data_parallel=True).size()
    return _native.get_expert_data_parallel_world_size()


def get_all_ranks():
    """``"tp_dp_cp_pp_ep"`` ranks of this process joined by underscores (Megatron's format)."""
    ranks = [get_tensor_model_parallel_rank(), get_data_parallel_rank(),
             get_context_parallel_rank(), get_pipeline_model_parallel_rank(),
             get_expert_model_parallel_rank()]
    return "_".join(str(r or 0) for r in ranks)


# ----------------------------------------------------------------------------- virtual pipeline
def get_virtual_pipeline_model_parallel_rank():
    """The running model chunk; None when no virtual pipeline is set (Megatron's default)."""
    if has_default_state():
        return _native.get_virtual_pipeline_model_parallel_rank()
    return OVERRIDES.get("vpp_rank")


def get_virtual_pipeline_model_parallel_world_size():
    """Model chunks per pipeline rank; None without a virtual pipeline (Megatron's default)."""
    if has_default_state():
        return _native.get_virtual_pipeline_model_parallel_world_size()
    return OVERRIDES.get("vpp_size")


def _vp_stage_matches(ignore_virtual, vp_stage, wanted_last: bool) -> bool:
    size = get_virtual_pipeline_model_parallel_world_size()
    if ignore_virtual or size is None:
        return True
    stage = get_virtual_pipeline_model_parallel_rank() if vp_stage is None else vp_stage
    if stage is None or not 0 <= stage < size:
        raise ValueError(f"vp_stage must be in [0, {size}) with a virtual pipeline of size "
                         f"{size}, got {stage!r}")
    return stage == (size - 1 if wanted_last else 0)


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """First pipeline stage; unless ``ignore_virtual``, also model chunk 0 (``vp_stage``,
    defaulting to the virtual rank set by ``set_virtual_pipeline_model_parallel_rank``); reads
    the setters' overrides."""
    return _vp_stage_matches(ignore_virtual, vp_stage, False) and \
        get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """Last pipeline stage; unless ``ignore_virtual``, also the last model chunk."""
    return _vp_stage_matches(ignore_virtual, vp_stage, True) and \
        get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_first_rank():
    return get_pipeline_model_parallel_global_ranks()[0]


def get_pipeline_model_parallel_last_rank():
    return get_pipeline_model_parallel_global_ranks()[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage; the last stage's next is the first (a ring)."""
    ranks = get_pipeline_model_parallel_global_ranks()
    size = get_pipeline_model_parallel_world_size()
    return ranks[(get_pipeline_model_parallel_rank() + 1) % size]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage; the first stage's previous is the last (a ring)."""
    ranks = get_pipeline_model_parallel_global_ranks()
    size = get_pipeline_model_parallel_world_size()
    return ranks[(get_pipeline_model_parallel_rank() - 1) % size]


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """In the embedding group; unless ``ignore_virtual``, only with the chunk holding the
    embedding (chunk 0 on the first stage, the last chunk on the last stage)."""
    state = _state()
    ranks = state.ranks("embedding")
    if state.rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if state.rank == ranks[0]:
        return is_pipeline_first_stage(False, vp_stage)
    if state.rank == ranks[-1]:
        return is_pipeline_last_stage(False, vp_stage)
    return True  # pragma: no cover - default embedding groups hold only first and last


# ----------------------------------------------------------------------------- Megatron's groups
def _extra(check_initialized: bool = True) -> ExtraGroups | None:
    if not check_initialized and _GROUPS.extra is None:
        return None
    _state()
    return _GROUPS.extra


def _require(group, what: str, how: str):
    if group is None:
        raise ModelParallelNotInitializedError(f"{what} was not created: {how}")
    return group


_NO_GLOO = "initialize_model_parallel(create_gloo_process_groups=False)"


def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False,
                            independent_all_gather=False):
    """Data-parallel group without context parallelism, or dp × cp with it; with
    ``partial_data_parallel`` (needs ``with_context_parallel``) this distributed-optimizer
    instance's share of it."""
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("partial_data_parallel=True needs with_context_parallel=True "
                             "(partial data parallelism for the optimizer includes CP)")
        return _extra().partial_dp_cp
    name = "_DATA_PARALLEL_GROUP_WITH_CP" if with_context_parallel else "_DATA_PARALLEL_GROUP"
    if name in _ASSIGNED:
        return _assigned_group(name, "data parallel", True, None)
    if independent_all_gather and with_context_parallel:
        return _require(_module_global("_DATA_PARALLEL_GROUP_WITH_CP_AG"),
                        "data parallel group with context parallel AG",
                        "initialize_model_parallel(create_all_gather_group=True)")
    return _native.get_data_parallel_group(with_context_parallel)


def has_separate_all_gather_group() -> bool:
    """Whether ``create_all_gather_group=True`` made a separate dp × cp all-gather group."""
    return _module_global("_DATA_PARALLEL_GROUP_WITH_CP_AG") is not None


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """The gloo twin of ``get_data_parallel_group`` (the same group on a gloo world)."""
    extra = _extra()
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("partial_data_parallel=True needs with_context_parallel=True")
        return _require(extra.partial_dp_cp_gloo, "the partial data-parallel gloo group",
                        _NO_GLOO)
    kind = "dp-cp" if with_context_parallel else "dp"
    return _require(extra.gloo.get(kind), f"the {kind} gloo group", _NO_GLOO)


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's context-parallel sub-groups, one per level of
    ``hierarchical_context_parallel_sizes``."""
    extra = _extra(check_initialized)
    groups = None if extra is None else extra.hierarchical_cp
    if check_initialized:
        _require(groups, "hierarchical context-parallel groups",
                 "pass hierarchical_context_parallel_sizes to initialize_model_parallel")
    return groups


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """The DP×CP sub-group of ``group_size`` ranks holding this rank (the whole DP×CP group
    when ``group_size`` equals its size)."""
    if group_size == get_data_parallel_world_size(with_context_parallel=True):
        return get_data_parallel_group(with_context_parallel=True)
    extra = _extra(check_initialized)
    groups = {} if extra is None else extra.hybrid_dp_cp
    if group_size not in groups:
        if not check_initialized and extra is None:
            return None
        raise ValueError(f"no hybrid DP×CP group of size {group_size!r} (sizes: "
                         f"{sorted(groups)}; needs initialize_model_parallel("
                         f"hybrid_context_parallel=True))")
    return groups[group_size]


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The FP8 amax-reduction group: tp×dp[×cp], or tp[×cp] with ``tp_only_amax_red``."""
    if tp_only_amax_red:
        return _state().group("tp-cp" if with_context_parallel else "tp")
    return _state().group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False):
    if partial_expert_data_parallel:
        extra = _extra(check_initialized)
        return None if extra is None else extra.partial_edp
    return _native.get_expert_data_parallel_group(check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    """Deprecated in Megatron: ``get_expert_data_parallel_group``."""
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, use "
                  "get_expert_data_parallel_group instead", DeprecationWarning, stacklevel=2)
    return get_expert_data_parallel_group(
        partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    extra = _extra()
    if partial_expert_data_parallel:
        return _require(extra.partial_edp_gloo, "the partial expert data-parallel gloo group",
                        _NO_GLOO)
    return _require(extra.gloo.get("edp"), "the expert data-parallel gloo group", _NO_GLOO)


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """Every rank of this rank's distributed-optimizer instance (the world with one)."""
    extra = _extra(check_initialized)
    return None if extra is None else extra.intra_dist_opt


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """The ranks holding the same optimizer shard in the other instances."""
    extra = _extra(check_initialized)
    group = None if extra is None else extra.inter_partial_edp
    if check_initialized:
        _require(group, "the inter distributed-optimizer-instance group",
                 "it exists only with num_distributed_optimizer_instances > 1")
    return group


# ----------------------------------------------------------------------------- memory buffer
def get_global_memory_buffer() -> GlobalMemoryBuffer:
    if _GROUPS.memory_buffer is None:
        raise ModelParallelNotInitializedError("global memory buffer is not initialized (call "
                                               "initialize_model_parallel first)")
    return _GROUPS.memory_buffer


def destroy_global_memory_buffer() -> None:
    _GROUPS.memory_buffer = None


def get_global_symmetric_memory_buffer():
    raise ModelParallelNotInitializedError(
        "global symmetric memory buffer is not initialized: tpfuse's inference does not use "
        "Megatron's NVLS symmetric-memory buffer")


def destroy_global_symmetric_memory_buffer() -> None:
    """Nothing to destroy (no symmetric memory buffer is ever created)."""


# ----------------------------------------------------------------------------- Megatron's globals
# Megatron keeps its groups in module globals that code and tests read and reset
# (``parallel_state._MODEL_PARALLEL_GROUP = None``). Here each such name reads this rank's group of
# the default ParallelState (None before initialisation); assigning one stores the value until the
# next initialize / destroy, and the matching getter then returns it — or, for None, raises as
# Megatron's assert does (ModelParallelNotInitializedError, an AssertionError).
_GLOBAL_KINDS = {
    "_MODEL_PARALLEL_GROUP": "tp-pp", "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp", "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp-cp", "_CONTEXT_PARALLEL_GROUP": "cp",
}
_ASSIGNED: dict = {}   # Megatron global name -> the value user code assigned


def _live_global(name: str):
    if name == "_DATA_PARALLEL_GROUP_WITH_CP_AG":
        return None if _GROUPS.extra is None else _GROUPS.extra.dp_cp_all_gather
    if not has_default_state():
        return None
    return get_default_state().group(_GLOBAL_KINDS[name])


def _module_global(name: str):
    """What Megatron's global ``name`` holds now: an assigned value, else the live group."""
    return _ASSIGNED[name] if name in _ASSIGNED else _live_global(name)


def _assigned_group(name: str, what: str, check_initialized: bool, native_getter):
    if name in _ASSIGNED:
        group = _ASSIGNED[name]
        if group is None and check_initialized:
            raise ModelParallelNotInitializedError(f"{what} group is not initialized")
        return group
    return native_getter(check_initialized)


def get_model_parallel_group(check_initialized=True):
    """tp × pp: the ranks that together hold one model replica."""
    return _assigned_group("_MODEL_PARALLEL_GROUP", "model parallel", check_initialized,
                           _native.get_model_parallel_group)


def get_tensor_model_parallel_group(check_initialized=True):
    return _assigned_group("_TENSOR_MODEL_PARALLEL_GROUP", "tensor model parallel",
                           check_initialized, _native.get_tensor_model_parallel_group)


def get_pipeline_model_parallel_group(check_initialized=True):
    return _assigned_group("_PIPELINE_MODEL_PARALLEL_GROUP", "pipeline model parallel",
                           check_initialized, _native.get_pipeline_model_parallel_group)


def get_context_parallel_group(check_initialized=True):
    return _assigned_group("_CONTEXT_PARALLEL_GROUP", "context parallel", check_initialized,
                           _native.get_context_parallel_group)


class _MegatronGlobalsModule(types.ModuleType):
    """This module, with Megatron's group globals readable and assignable (see above)."""

    def __getattr__(self, name):
        if name in _GLOBAL_KINDS or name == "_DATA_PARALLEL_GROUP_WITH_CP_AG":
            return _module_global(name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in _GLOBAL_KINDS or name == "_DATA_PARALLEL_GROUP_WITH_CP_AG":
            _ASSIGNED[name] = value
        else:
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _MegatronGlobalsModule
