"""Megatron-core-compatible ``parallel_state`` functions over the default ParallelState.

    from tpfuse.parallel import parallel_state as mpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_group(), ...
    mpu.destroy_model_parallel()

Every public function of megatron-core 0.16's ``parallel_state`` is here, with its keywords and
semantics: the setters override what the getters return (``parallel_state_ranks``), the gloo
data-parallel groups, the hierarchical context-parallel, hybrid DP×CP and
distributed-optimizer-instance groups (``megatron_groups``), the FP8 amax-reduction group,
``get_global_memory_buffer``, ``generate_masked_orthogonal_rank_groups``, ``RankGenerator``,
``create_group``, ``update_pg_timeout``. Differences, all deliberate:

* a getter called before ``initialize_model_parallel`` raises ``ModelParallelNotInitializedError``
  (a RuntimeError and an AssertionError) saying so, not an AttributeError on None or a silent
  0; ``check_initialized=False`` returns None, as in Megatron;
* invalid sizes raise ``ValueError`` naming the setting, before any group is created;
* ``initialize_model_parallel`` returns the new default ParallelState (Megatron returns None;
  ``tpfuse.megatron_compat.parallel_state`` keeps Megatron's None); arguments after the first
  three are keyword-only (Megatron's 4th positional is the PP comm backend; the compat module
  keeps Megatron's positional order);
* ``destroy_model_parallel`` destroys every group of every live ParallelState and every override,
  so re-initialising with other sizes in the same processes starts clean;
* options that change communication libraries (SHARP, UCC, NCCL configs, high-priority streams,
  a separate all-gather group) and custom embedding ranks are accepted only at their defaults;
* the embedding-group getters on a middle pipeline stage raise unless ``check_initialized=False``;
* ``is_pipeline_first/last_stage(ignore_virtual=False)`` without ``vp_stage`` uses the virtual
  rank set by ``set_virtual_pipeline_model_parallel_rank`` (Megatron asserts instead).

The object behind these functions is ``tpfuse.parallel.state.get_default_state()``; new code can
pass a ``ParallelState`` explicitly instead.
"""
from __future__ import annotations

import datetime
import warnings

import torch.distributed as dist

from .layout import DEFAULT_ORDER, RankLayout
from .megatron_groups import (  # noqa: F401  (Megatron's names, re-exported)
    ExtraGroups, GlobalMemoryBuffer, RankGenerator, check_default_only, check_extra_options,
    create_group, create_hierarchical_groups, create_hybrid_dp_cp_groups,
    default_embedding_ranks, default_position_embedding_ranks, forget_created_groups,
    generate_masked_orthogonal_rank_groups, get_nccl_options, overwrite_nccl_comm_cfgs,
    update_pg_timeout)
from .parallel_state_ranks import (  # noqa: F401  (Megatron's names, re-exported)
    OVERRIDES, ModelParallelNotInitializedError, get_all_ranks,
    get_context_parallel_rank, get_context_parallel_world_size, get_data_parallel_rank,
    get_data_parallel_world_size, get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size, get_expert_model_parallel_rank,
    get_expert_model_parallel_world_size, get_expert_tensor_and_model_parallel_rank,
    get_expert_tensor_and_model_parallel_world_size, get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size, get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_last_rank, get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank, get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size, get_tensor_and_context_parallel_rank,
    get_tensor_and_context_parallel_world_size, get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank, get_model_parallel_src_rank, get_data_parallel_src_rank,
    get_expert_model_parallel_src_rank, get_pipeline_model_parallel_global_ranks,
    get_tensor_model_parallel_global_ranks, get_data_parallel_global_ranks,
    get_embedding_global_ranks, is_rank_in_embedding_group, is_rank_in_position_embedding_group,
    get_tensor_model_parallel_world_size, get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size, is_pipeline_first_stage,
    is_pipeline_last_stage, set_data_parallel_rank, set_expert_model_parallel_rank,
    set_expert_model_parallel_world_size, set_expert_tensor_parallel_rank,
    set_expert_tensor_parallel_world_size, set_pipeline_model_parallel_rank,
    set_pipeline_model_parallel_world_size, set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size, set_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size)
from .parallel_state_ranks import state as _state
from .state import (ParallelState, destroy_all_states, get_default_state,  # noqa: F401
                    has_default_state, set_default_state)

class _Facade:
    """What initialize_model_parallel built beyond the ParallelState (destroyed with it)."""
    extra: ExtraGroups | None = None
    memory_buffer: GlobalMemoryBuffer | None = None


_FACADE = _Facade()


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    pipeline_model_parallel_comm_backend=None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes=None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path=None,
    distributed_timeout_minutes: float | None = None,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups=None,
    sharp_enabled_group=None,
    create_all_gather_group=False,
) -> ParallelState:
    """Build every group of the layout and make it the default state (returned as well).

    dp = world / (tp·pp·cp); the expert side uses etp (default tp), ep and
    edp = world / (etp·ep·pp) over the same ranks. ``distributed_timeout_minutes`` defaults to
    the world group's timeout (Megatron: 30 minutes).
    """
    if has_default_state():
        raise RuntimeError("model parallel is already initialized; call "
                           "destroy_model_parallel() first")
    check_default_only(dict(
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        use_sharp=use_sharp, nccl_communicator_config_path=nccl_communicator_config_path,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        high_priority_stream_groups=high_priority_stream_groups,
        sharp_enabled_group=sharp_enabled_group, create_all_gather_group=create_all_gather_group))
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "first (torch.distributed.init_process_group)")
    layout = RankLayout(dist.get_world_size(), tp=tensor_model_parallel_size,
                        pp=pipeline_model_parallel_size, cp=context_parallel_size,
                        ep=expert_model_parallel_size, etp=expert_tensor_parallel_size,
                        order=order)
    check_extra_options(context_parallel_size, hierarchical_context_parallel_sizes,
                         num_distributed_optimizer_instances, layout.world_size,
                         layout.tp, layout.pp)
    if layout.edp % num_distributed_optimizer_instances:
        raise ValueError(f"num_distributed_optimizer_instances={num_distributed_optimizer_instances}"
                         f" must divide the expert data-parallel size edp={layout.edp}")
    timeout = None
    if distributed_timeout_minutes is not None:
        timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
    state = ParallelState(layout, vpp_size=virtual_pipeline_model_parallel_size, timeout=timeout)
    try:
        _FACADE.extra = ExtraGroups(
            state, gloo=create_gloo_process_groups,
            hierarchical_cp_sizes=hierarchical_context_parallel_sizes,
            hybrid_cp=hybrid_context_parallel, instances=num_distributed_optimizer_instances,
            timeout=timeout)
    except BaseException:
        state.destroy()
        raise
    _FACADE.memory_buffer = GlobalMemoryBuffer()
    set_default_state(state)
    return state


def destroy_model_parallel() -> None:
    """Destroy the groups of every live ParallelState (the default one included), the extra
    groups and every setter's override; safe when nothing is initialised."""
    if _FACADE.extra is not None:
        _FACADE.extra.destroy()
    _FACADE.extra = _FACADE.memory_buffer = None
    forget_created_groups()
    OVERRIDES.clear()
    destroy_all_states()


def model_parallel_is_initialized() -> bool:
    return has_default_state()


def is_initialized() -> bool:
    return has_default_state()


def is_unitialized() -> bool:
    """Deprecated in Megatron (sic): ``not is_initialized()``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning,
                  stacklevel=2)
    return not has_default_state()


def _group(name: str, check_initialized: bool = True):
    """This rank's group of kind ``name``; None before initialisation if not checking."""
    if not check_initialized and not has_default_state():
        return None
    return _state().group(name)


def _extra(check_initialized: bool = True) -> ExtraGroups | None:
    if not check_initialized and _FACADE.extra is None:
        return None
    _state()
    return _FACADE.extra


def _require(group, what: str, how: str):
    if group is None:
        raise ModelParallelNotInitializedError(f"{what} was not created: {how}")
    return group


# ----------------------------------------------------------------------------- groups
def get_model_parallel_group(check_initialized=True):
    """tp × pp: the ranks that together hold one model replica."""
    return _group("tp-pp", check_initialized)


def get_tensor_model_parallel_group(check_initialized=True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized=True):
    return _group("pp", check_initialized)


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
    if independent_all_gather:
        raise ModelParallelNotInitializedError(
            "independent_all_gather=True: no separate all-gather group exists (tpfuse does not "
            "create one; create_all_gather_group=True is not supported)")
    return _state().group("dp-cp" if with_context_parallel else "dp")


def has_separate_all_gather_group() -> bool:
    """False: tpfuse never creates a separate all-gather data-parallel group."""
    return False


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """The gloo twin of ``get_data_parallel_group`` (the same group on a gloo world)."""
    extra = _extra()
    how = "initialize_model_parallel(create_gloo_process_groups=False)"
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("partial_data_parallel=True needs with_context_parallel=True")
        return _require(extra.partial_dp_cp_gloo, "the partial data-parallel gloo group", how)
    kind = "dp-cp" if with_context_parallel else "dp"
    return _require(extra.gloo.get(kind), f"the {kind} gloo group", how)


def get_context_parallel_group(check_initialized=True):
    return _group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized=True):
    if not check_initialized and not has_default_state():
        return None
    return _state().ranks("cp")


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


def _embedding_kind_group(name: str, check_initialized: bool):
    if not check_initialized and not has_default_state():
        return None
    state = _state()
    group = state.group(name)
    if group is None and check_initialized:
        raise RuntimeError(f"global rank {state.rank} is not in a {name} group (only the first"
                           f"{'' if name == 'position-embedding' else ' and last'} pipeline "
                           f"stages are); check is_rank_in_{name.replace('-', '_')}_group() first")
    return group


def get_embedding_group(check_initialized=True):
    """Group of the first and last pipeline stage (tied word embeddings)."""
    return _embedding_kind_group("embedding", check_initialized)


def get_position_embedding_group(check_initialized=True):
    """Group of the first pipeline stage (position embeddings)."""
    return _embedding_kind_group("position-embedding", check_initialized)


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The FP8 amax-reduction group: tp×dp[×cp], or tp[×cp] with ``tp_only_amax_red``."""
    if tp_only_amax_red:
        return _state().group("tp-cp" if with_context_parallel else "tp")
    return _state().group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    return _group("tp-dp-cp" if with_context_parallel else "tp-dp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized=True):
    return _group("tp-cp", check_initialized)


def get_expert_model_parallel_group(check_initialized=True):
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized=True):
    return _group("etp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    return _group("etp-ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True):
    return _group("etp-ep-pp", check_initialized)


def get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False):
    if partial_expert_data_parallel:
        extra = _extra(check_initialized)
        return None if extra is None else extra.partial_edp
    return _group("edp", check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    """Deprecated in Megatron: ``get_expert_data_parallel_group``."""
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, use "
                  "get_expert_data_parallel_group instead", DeprecationWarning, stacklevel=2)
    return get_expert_data_parallel_group(
        partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    extra = _extra()
    how = "initialize_model_parallel(create_gloo_process_groups=False)"
    if partial_expert_data_parallel:
        return _require(extra.partial_edp_gloo, "the partial expert data-parallel gloo group",
                        how)
    return _require(extra.gloo.get("edp"), "the expert data-parallel gloo group", how)


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
    if _FACADE.memory_buffer is None:
        raise ModelParallelNotInitializedError("global memory buffer is not initialized (call "
                                               "initialize_model_parallel first)")
    return _FACADE.memory_buffer


def destroy_global_memory_buffer() -> None:
    _FACADE.memory_buffer = None


def get_global_symmetric_memory_buffer():
    raise ModelParallelNotInitializedError(
        "global symmetric memory buffer is not initialized: tpfuse's inference does not use "
        "Megatron's NVLS symmetric-memory buffer")


def destroy_global_symmetric_memory_buffer() -> None:
    """Nothing to destroy (no symmetric memory buffer is ever created)."""
