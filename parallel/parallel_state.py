"""Megatron-core-compatible ``parallel_state`` functions over the default ParallelState.

    from tpfuse.parallel import parallel_state as mpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_group(), ...
    mpu.destroy_model_parallel()

Names and keyword arguments follow megatron-core 0.16. Differences, all deliberate:

* a getter called before ``initialize_model_parallel`` raises ``RuntimeError`` saying so (not an
  AssertionError, an AttributeError on None, or a silent 0/None);
* invalid sizes raise ``ValueError`` naming the setting, before any group is created;
* ``destroy_model_parallel`` destroys every group of every live ParallelState, so re-initialising
  with other sizes in the same processes starts clean (a no-op when nothing is initialised);
* ``check_initialized=False`` returns None before initialisation, as in Megatron; embedding
  group getters on a middle pipeline stage raise unless ``check_initialized=False`` (then None).
* Megatron-only options (SHARP, hierarchical CP, distributed-optimizer instances, NCCL configs,
  custom embedding ranks, ...) are accepted only at their default values; arguments after the
  first three are keyword-only (Megatron's 4th positional is the PP comm backend, so positional
  use would bind silently wrong);
* ``is_pipeline_first/last_stage(ignore_virtual=False)`` without ``vp_stage`` uses the virtual
  rank set by ``set_virtual_pipeline_model_parallel_rank`` (Megatron asserts instead).

The object behind these functions is ``tpfuse.parallel.state.get_default_state()``; new code can
pass a ``ParallelState`` explicitly instead.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from .layout import DEFAULT_ORDER, RankLayout
from .state import (ParallelState, destroy_all_states, get_default_state, has_default_state,
                    set_default_state)

# Megatron-core options tpfuse does not implement, with the default value each must keep.
_MEGATRON_ONLY_DEFAULTS = {
    "pipeline_model_parallel_comm_backend": None,
    "use_sharp": False,
    "hierarchical_context_parallel_sizes": None,
    "hybrid_context_parallel": False,
    "num_distributed_optimizer_instances": 1,
    "nccl_communicator_config_path": None,
    "get_embedding_ranks": None,
    "get_position_embedding_ranks": None,
    "create_gloo_process_groups": True,   # accepted either way: no separate gloo groups are built
    "high_priority_stream_groups": None,
    "sharp_enabled_group": None,
    "create_all_gather_group": False,
}


def _check_megatron_only(options: dict) -> None:
    for key, value in options.items():
        if key not in _MEGATRON_ONLY_DEFAULTS:
            raise TypeError(f"initialize_model_parallel() got an unexpected keyword argument "
                            f"{key!r}")
        if key != "create_gloo_process_groups" and value != _MEGATRON_ONLY_DEFAULTS[key]:
            raise ValueError(f"tpfuse does not support {key}={value!r} (only the default "
                             f"{_MEGATRON_ONLY_DEFAULTS[key]!r})")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    distributed_timeout_minutes: float | None = None,
    order: str = DEFAULT_ORDER,
    **megatron_only_options,
) -> ParallelState:
    """Build every group of the layout and make it the default state (returned as well).

    dp = world / (tp·pp·cp); the expert side uses etp (default tp), ep and
    edp = world / (etp·ep·pp) over the same ranks. ``distributed_timeout_minutes`` defaults to
    the world group's timeout.
    """
    if has_default_state():
        raise RuntimeError("model parallel is already initialized; call "
                           "destroy_model_parallel() first")
    _check_megatron_only(megatron_only_options)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "first (torch.distributed.init_process_group)")
    layout = RankLayout(dist.get_world_size(), tp=tensor_model_parallel_size,
                        pp=pipeline_model_parallel_size, cp=context_parallel_size,
                        ep=expert_model_parallel_size, etp=expert_tensor_parallel_size,
                        order=order)
    timeout = None
    if distributed_timeout_minutes is not None:
        timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
    state = ParallelState(layout, vpp_size=virtual_pipeline_model_parallel_size, timeout=timeout)
    set_default_state(state)
    return state


def destroy_model_parallel() -> None:
    """Destroy the groups of every live ParallelState (the default one included) and clear the
    default; safe when nothing is initialised."""
    destroy_all_states()


def model_parallel_is_initialized() -> bool:
    return has_default_state()


def is_initialized() -> bool:
    return has_default_state()


def _state() -> ParallelState:
    return get_default_state()


def _group(name: str, check_initialized: bool = True):
    """This rank's group of kind ``name``; None before initialisation if not checking."""
    if not check_initialized and not has_default_state():
        return None
    return _state().group(name)


def _no_partial(partial: bool, what: str) -> None:
    if partial:
        raise ValueError(f"tpfuse has no partial {what} groups (distributed-optimizer "
                         f"instances); got partial_{what.replace(' ', '_')}=True")


# ----------------------------------------------------------------------------- groups
def get_model_parallel_group(check_initialized=True):
    """tp × pp: the ranks that together hold one model replica."""
    return _group("tp-pp", check_initialized)


def get_tensor_model_parallel_group(check_initialized=True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized=True):
    return _group("pp", check_initialized)


def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False):
    """Data-parallel group without context parallelism, or dp × cp with it."""
    _no_partial(partial_data_parallel, "data parallel")
    return _state().group("dp-cp" if with_context_parallel else "dp")


def get_context_parallel_group(check_initialized=True):
    return _group("cp", check_initialized)


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
    _no_partial(partial_expert_data_parallel, "expert data parallel")
    return _group("edp", check_initialized)


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


# ----------------------------------------------------------------------------- ranks and sizes
def get_tensor_model_parallel_rank():
    return _state().rank_in("tp")


def get_tensor_model_parallel_world_size():
    return _state().size("tp")


def get_pipeline_model_parallel_rank():
    return _state().rank_in("pp")


def get_pipeline_model_parallel_world_size():
    return _state().size("pp")


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    _no_partial(partial_data_parallel, "data parallel")
    return _state().rank_in("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    _no_partial(partial_data_parallel, "data parallel")
    return _state().size("dp-cp" if with_context_parallel else "dp")


def get_context_parallel_rank():
    return _state().rank_in("cp")


def get_context_parallel_world_size():
    return _state().size("cp")


def get_tensor_and_context_parallel_rank():
    return _state().rank_in("tp-cp")


def get_tensor_and_context_parallel_world_size():
    return _state().size("tp-cp")


def get_expert_model_parallel_rank():
    return _state().rank_in("ep")


def get_expert_model_parallel_world_size():
    return _state().size("ep")


def get_expert_tensor_parallel_rank():
    return _state().rank_in("etp")


def get_expert_tensor_parallel_world_size():
    return _state().size("etp")


def get_expert_tensor_and_model_parallel_rank():
    return _state().rank_in("etp-ep")


def get_expert_tensor_and_model_parallel_world_size():
    return _state().size("etp-ep")


def get_expert_data_parallel_rank(partial_expert_data_parallel=False):
    _no_partial(partial_expert_data_parallel, "expert data parallel")
    return _state().rank_in("edp")


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False):
    _no_partial(partial_expert_data_parallel, "expert data parallel")
    return _state().size("edp")


# ----------------------------------------------------------------------------- pipeline stages
def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    return _state().is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    return _state().is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    return _state().is_rank_in_embedding_group(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def is_rank_in_position_embedding_group():
    state = _state()
    return state.rank in state.ranks("position-embedding")


def get_virtual_pipeline_model_parallel_rank():
    return _state().vpp_rank


def set_virtual_pipeline_model_parallel_rank(rank):
    state = _state()
    if rank is not None and (state.vpp_size is None or not 0 <= rank < state.vpp_size):
        raise ValueError(f"virtual pipeline rank must be in [0, {state.vpp_size}) "
                         f"(vpp_size={state.vpp_size}), got {rank!r}")
    state.vpp_rank = rank


def get_virtual_pipeline_model_parallel_world_size():
    return _state().vpp_size


def set_virtual_pipeline_model_parallel_world_size(world_size):
    state = _state()
    if world_size is not None and (isinstance(world_size, bool) or
                                   not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"virtual pipeline world size must be an integer >= 1 or None, "
                         f"got {world_size!r}")
    state.vpp_size = world_size


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage; the last stage's next is the first (a ring)."""
    return _state().next_pp_rank


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage; the first stage's previous is the last (a ring)."""
    return _state().prev_pp_rank


def get_pipeline_model_parallel_first_rank():
    return _state().ranks("pp")[0]


def get_pipeline_model_parallel_last_rank():
    return _state().ranks("pp")[-1]


# ----------------------------------------------------------------------------- global rank lists
def get_tensor_model_parallel_src_rank():
    """Global rank of the first member of this rank's tensor-parallel group."""
    return _state().ranks("tp")[0]


def get_model_parallel_src_rank():
    return _state().ranks("tp-pp")[0]


def get_data_parallel_src_rank(with_context_parallel=False):
    return _state().ranks("dp-cp" if with_context_parallel else "dp")[0]


def get_expert_model_parallel_src_rank():
    return _state().ranks("ep")[0]


def get_context_parallel_global_ranks(check_initialized=True):
    if not check_initialized and not has_default_state():
        return None
    return _state().ranks("cp")


def get_pipeline_model_parallel_global_ranks():
    """tpfuse addition: the global ranks of this rank's pipeline, first stage first."""
    return _state().ranks("pp")


def get_tensor_model_parallel_global_ranks():
    """tpfuse addition: the global ranks of this rank's tensor-parallel group."""
    return _state().ranks("tp")


def get_data_parallel_global_ranks(with_context_parallel=False):
    """tpfuse addition: the global ranks of this rank's data-parallel group."""
    return _state().ranks("dp-cp" if with_context_parallel else "dp")


def get_embedding_global_ranks():
    """tpfuse addition: this rank's embedding group ([] on middle pipeline stages)."""
    return _state().ranks("embedding")
