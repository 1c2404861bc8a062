"""The module-level ``parallel_state`` functions: one thin layer over the default ParallelState.

    from tpfuse.parallel import parallel_state
    state = parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                                     pipeline_model_parallel_size=2)
    parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_group()
    parallel_state.destroy_model_parallel()

Every function here reads (or, ``initialize_model_parallel`` / ``destroy_model_parallel``, sets)
the default ``ParallelState`` — ``tpfuse.parallel.state.resolve_state()`` — and nothing else:
``get_<kind>_group()`` is ``state.group(kind)``, ``get_<kind>_rank()`` is ``state.rank_in(kind)``,
``get_<kind>_world_size()`` is ``state.size(kind)``, under megatron-core's names for the group
kinds of the layout (tensor, pipeline, data with and without context, context, tensor+context,
tensor+data[+context], model = tp×pp, expert, expert-tensor, expert-data, embedding,
position-embedding). New code passes a ``ParallelState`` explicitly instead.

Before ``initialize_model_parallel`` every getter raises ``ModelParallelNotInitializedError`` (a
RuntimeError, and an AssertionError so code written against Megatron's asserts catches it);
group getters with ``check_initialized=False`` return None then, the virtual-pipeline getters
return None (Megatron's default).

Megatron's full module — its positional ``initialize_model_parallel`` returning None, the setters
that override the getters, the gloo / hierarchical context-parallel / hybrid DP×CP /
distributed-optimizer-instance groups, the memory buffer, ``RankGenerator`` — is
``tpfuse.megatron_compat.parallel_state``, built on this one. What it creates beyond the
ParallelState is released by ``destroy_model_parallel`` here too, through
``register_destroy_hook``.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from .layout import DEFAULT_ORDER, RankLayout
from .state import (ParallelState, destroy_all_states, get_default_state,  # noqa: F401
                    has_default_state, resolve_state, set_default_state)


class ModelParallelNotInitializedError(RuntimeError, AssertionError):
    """A parallel_state getter was called before ``initialize_model_parallel``."""


# ----------------------------------------------------------------------------- set up / tear down
_DESTROY_HOOKS: list = []   # what layers above created next to the default state (see below)


def register_destroy_hook(hook) -> None:
    """Make ``destroy_model_parallel()`` call ``hook()`` first (once per registration of the same
    function): a layer above that creates groups or settings next to the default state releases
    them there, whichever module's ``destroy_model_parallel`` a job (or the worker pool's
    clean-up) calls."""
    if hook not in _DESTROY_HOOKS:
        _DESTROY_HOOKS.append(hook)


def model_parallel_layout(tensor_model_parallel_size: int = 1,
                          pipeline_model_parallel_size: int = 1, *,
                          context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                          expert_tensor_parallel_size: int | None = None,
                          order: str = DEFAULT_ORDER) -> RankLayout:
    """The RankLayout ``initialize_model_parallel`` would build over the current world, checked
    (ValueError naming the setting) without creating any group; RuntimeError when model parallel
    is already initialised or torch.distributed is not."""
    if has_default_state():
        raise RuntimeError("model parallel is already initialized; call "
                           "destroy_model_parallel() first")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "first (torch.distributed.init_process_group)")
    return RankLayout(dist.get_world_size(), tp=tensor_model_parallel_size,
                      pp=pipeline_model_parallel_size, cp=context_parallel_size,
                      ep=expert_model_parallel_size, etp=expert_tensor_parallel_size, order=order)


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None, *,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: int | None = None,
                              distributed_timeout_minutes: float | None = None,
                              order: str = DEFAULT_ORDER,
                              num_distributed_optimizer_instances: int = 1) -> ParallelState:
    """Build every group of the layout and make it the default state (returned as well).

    dp = world / (tp·pp·cp); the expert side uses etp (default tp), ep and
    edp = world / (etp·ep·pp) over the same ranks. Every size is checked before any group is
    created. ``distributed_timeout_minutes`` defaults to the world group's timeout.
    ``num_distributed_optimizer_instances`` (Megatron's): the dp-cp and edp groups are also cut
    into that many optimizer instances (``ParallelState``'s intra / inter groups).
    """
    layout = model_parallel_layout(
        tensor_model_parallel_size, pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size, order=order)
    timeout = None
    if distributed_timeout_minutes is not None:
        timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
    state = ParallelState(layout, vpp_size=virtual_pipeline_model_parallel_size, timeout=timeout,
                          num_distributed_optimizer_instances=num_distributed_optimizer_instances)
    set_default_state(state)
    return state


def destroy_model_parallel() -> None:
    """Run the registered destroy hooks, then destroy the groups of every live ParallelState
    (the default one included); safe when nothing is initialised."""
    for hook in list(_DESTROY_HOOKS):
        hook()
    destroy_all_states()


def model_parallel_is_initialized() -> bool:
    return has_default_state()


def is_initialized() -> bool:
    return has_default_state()


def _state() -> ParallelState:
    """The default ParallelState (ModelParallelNotInitializedError before initialisation)."""
    if not has_default_state():
        raise ModelParallelNotInitializedError(
            "model parallel state is not initialized: call "
            "parallel_state.initialize_model_parallel(...) first")
    return resolve_state()


def _dp_kind(with_context_parallel: bool) -> str:
    return "dp-cp" if with_context_parallel else "dp"


# ----------------------------------------------------------------------------- groups
def _group(name: str, check_initialized: bool = True):
    """This rank's group of kind ``name``; None before initialisation if not checking."""
    if not check_initialized and not has_default_state():
        return None
    return _state().group(name)


def get_model_parallel_group(check_initialized=True):
    """tp × pp: the ranks that together hold one model replica."""
    return _group("tp-pp", check_initialized)


def get_tensor_model_parallel_group(check_initialized=True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized=True):
    return _group("pp", check_initialized)


def get_data_parallel_group(with_context_parallel=False):
    """Data-parallel group without context parallelism, or dp × cp with it."""
    return _state().group(_dp_kind(with_context_parallel))


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


def get_expert_data_parallel_group(check_initialized=True):
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
    """Group of the first and last pipeline stage (tied word embeddings); on a middle stage a
    RuntimeError, or None with ``check_initialized=False``."""
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


def get_data_parallel_rank(with_context_parallel=False):
    return _state().rank_in(_dp_kind(with_context_parallel))


def get_data_parallel_world_size(with_context_parallel=False):
    return _state().size(_dp_kind(with_context_parallel))


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


def get_expert_data_parallel_rank():
    return _state().rank_in("edp")


def get_expert_data_parallel_world_size():
    return _state().size("edp")


# ----------------------------------------------------------------------------- pipeline stages
def get_virtual_pipeline_model_parallel_rank():
    """The running model chunk (``state.vpp_rank``); None without a virtual pipeline or before
    initialisation (Megatron's default)."""
    return resolve_state().vpp_rank if has_default_state() else None


def get_virtual_pipeline_model_parallel_world_size():
    """Model chunks per pipeline rank (``state.vpp_size``); None without a virtual pipeline or
    before initialisation (Megatron's default)."""
    return resolve_state().vpp_size if has_default_state() else None


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """First pipeline stage; unless ``ignore_virtual``, also model chunk 0 (``vp_stage``,
    defaulting to the state's running chunk ``vpp_rank``)."""
    return _state().is_pipeline_first_stage(ignore_virtual, vp_stage)


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """Last pipeline stage; unless ``ignore_virtual``, also the last model chunk."""
    return _state().is_pipeline_last_stage(ignore_virtual, vp_stage)


def get_pipeline_model_parallel_first_rank():
    return _state().ranks("pp")[0]


def get_pipeline_model_parallel_last_rank():
    return _state().ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage; the last stage's next is the first (a ring)."""
    return _state().next_pp_rank


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage; the first stage's previous is the last (a ring)."""
    return _state().prev_pp_rank


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """In the embedding group; unless ``ignore_virtual``, only with the chunk holding the
    embedding (chunk 0 on the first stage, the last chunk on the last stage)."""
    return _state().is_rank_in_embedding_group(ignore_virtual, vp_stage)


def is_rank_in_position_embedding_group():
    state = _state()
    return state.rank in state.ranks("position-embedding")


# ----------------------------------------------------------------------------- global rank lists
def get_tensor_model_parallel_src_rank():
    """Global rank of the first member of this rank's tensor-parallel group."""
    return _state().ranks("tp")[0]


def get_model_parallel_src_rank():
    return _state().ranks("tp-pp")[0]


def get_data_parallel_src_rank(with_context_parallel=False):
    return _state().ranks(_dp_kind(with_context_parallel))[0]


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
    return _state().ranks(_dp_kind(with_context_parallel))


def get_embedding_global_ranks():
    """tpfuse addition: this rank's embedding group ([] on middle pipeline stages)."""
    return _state().ranks("embedding")
