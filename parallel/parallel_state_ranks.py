"""Rank and size getters of the ``parallel_state`` facade, and Megatron's setters.

As in megatron-core, ``set_tensor_model_parallel_world_size(2)`` (and the other setters) makes the
matching getter return 2 from then on, initialised or not — Megatron code and tests use this to
mock a layout without processes. The override applies to that getter only (the groups, and
``ParallelState`` objects passed to layers, are unchanged) and is cleared by
``destroy_model_parallel``. Without an override, a getter reads the default ``ParallelState`` and
raises ``ModelParallelNotInitializedError`` (a ``RuntimeError`` that is also an
``AssertionError``, so code written for Megatron's asserts catches it) before initialisation.

The virtual-pipeline getters return Megatron's default ``None`` when nothing is set.
"""
from __future__ import annotations

import warnings

from .state import has_default_state, resolve_state


class ModelParallelNotInitializedError(RuntimeError, AssertionError):
    """A parallel_state getter was called before ``initialize_model_parallel``."""


class _Overrides:
    """What the setters stored: getter name → value (None = not set)."""

    def __init__(self):
        self.values: dict[str, int | None] = {}

    def get(self, name: str):
        return self.values.get(name)

    def set(self, name: str, value) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        self.values[name] = value

    def clear(self) -> None:
        self.values.clear()


OVERRIDES = _Overrides()


def state():
    """The default ParallelState (ModelParallelNotInitializedError before initialisation)."""
    if not has_default_state():
        raise ModelParallelNotInitializedError(
            "model parallel state is not initialized: call "
            "parallel_state.initialize_model_parallel(...) first")
    return resolve_state()


def _read(name: str, group: str, what: str):
    value = OVERRIDES.get(name)
    if value is not None:
        return value
    st = state()
    return st.rank_in(group) if what == "rank" else st.size(group)


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


# ----------------------------------------------------------------------------- getters
def get_tensor_model_parallel_rank():
    return _read("tp_rank", "tp", "rank")


def get_tensor_model_parallel_world_size():
    return _read("tp_size", "tp", "size")


def get_pipeline_model_parallel_rank():
    return _read("pp_rank", "pp", "rank")


def get_pipeline_model_parallel_world_size():
    return _read("pp_size", "pp", "size")


def _dp_kind(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel:
        raise ValueError("partial_data_parallel=True: the partial data-parallel rank and size "
                         "are those of get_data_parallel_group(with_context_parallel=True, "
                         "partial_data_parallel=True)")
    return "dp-cp" if with_context_parallel else "dp"


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    if OVERRIDES.get("dp_rank") is not None:
        return OVERRIDES.get("dp_rank")
    if partial_data_parallel:
        return _partial_dp_group(with_context_parallel).rank()
    return state().rank_in(_dp_kind(with_context_parallel, False))


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    if partial_data_parallel:
        return _partial_dp_group(with_context_parallel).size()
    return state().size(_dp_kind(with_context_parallel, False))


def _partial_dp_group(with_context_parallel):
    from .parallel_state import get_data_parallel_group

    return get_data_parallel_group(with_context_parallel, partial_data_parallel=True)


def get_context_parallel_rank():
    return state().rank_in("cp")


def get_context_parallel_world_size():
    return state().size("cp")


def get_tensor_and_context_parallel_rank():
    return state().rank_in("tp-cp")


def get_tensor_and_context_parallel_world_size():
    return state().size("tp-cp")


def get_expert_model_parallel_rank():
    return _read("ep_rank", "ep", "rank")


def get_expert_model_parallel_world_size():
    return _read("ep_size", "ep", "size")


def get_expert_tensor_parallel_rank():
    """Override, else the etp group's rank; before initialisation Megatron falls back to the
    tensor-parallel override."""
    if OVERRIDES.get("etp_rank") is None and not has_default_state() \
            and OVERRIDES.get("tp_rank") is not None:
        return OVERRIDES.get("tp_rank")
    return _read("etp_rank", "etp", "rank")


def get_expert_tensor_parallel_world_size():
    if OVERRIDES.get("etp_size") is None and not has_default_state() \
            and OVERRIDES.get("tp_size") is not None:
        return OVERRIDES.get("tp_size")
    return _read("etp_size", "etp", "size")


def get_expert_tensor_and_model_parallel_rank():
    return state().rank_in("etp-ep")


def get_expert_tensor_and_model_parallel_world_size():
    return state().size("etp-ep")


def get_expert_data_parallel_rank(partial_expert_data_parallel=False):
    if partial_expert_data_parallel:
        from .parallel_state import get_expert_data_parallel_group

        return get_expert_data_parallel_group(partial_expert_data_parallel=True).rank()
    return state().rank_in("edp")


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False):
    if partial_expert_data_parallel:
        from .parallel_state import get_expert_data_parallel_group

        return get_expert_data_parallel_group(partial_expert_data_parallel=True).size()
    return state().size("edp")


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
        return resolve_state().vpp_rank
    return OVERRIDES.get("vpp_rank")


def get_virtual_pipeline_model_parallel_world_size():
    """Model chunks per pipeline rank; None without a virtual pipeline (Megatron's default)."""
    if has_default_state():
        return resolve_state().vpp_size
    return OVERRIDES.get("vpp_size")


def set_virtual_pipeline_model_parallel_rank(rank):
    """Set the running model chunk (deprecated in Megatron in favour of passing vp_stage)."""
    warnings.warn("set_virtual_pipeline_model_parallel_rank in global scope is deprecated; pass "
                  "vp_stage to is_pipeline_first_stage / is_pipeline_last_stage instead",
                  DeprecationWarning, stacklevel=2)
    size = get_virtual_pipeline_model_parallel_world_size()
    if rank is not None and size is not None and (isinstance(rank, bool) or
                                                  not isinstance(rank, int)
                                                  or not 0 <= rank < size):
        raise ValueError(f"virtual pipeline rank must be in [0, {size}) (vpp_size={size}), "
                         f"got {rank!r}")
    if has_default_state():
        resolve_state().vpp_rank = rank
    else:
        OVERRIDES.set("vpp_rank", rank)


def set_virtual_pipeline_model_parallel_world_size(world_size):
    if world_size is not None and (isinstance(world_size, bool) or
                                   not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"virtual pipeline world size must be an integer >= 1 or None, "
                         f"got {world_size!r}")
    if has_default_state():
        resolve_state().vpp_size = world_size
    else:
        OVERRIDES.set("vpp_size", world_size)


# ----------------------------------------------------------------------------- pipeline stages
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
    defaulting to the virtual rank set by ``set_virtual_pipeline_model_parallel_rank``)."""
    return _vp_stage_matches(ignore_virtual, vp_stage, False) and \
        get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """Last pipeline stage; unless ``ignore_virtual``, also the last model chunk."""
    return _vp_stage_matches(ignore_virtual, vp_stage, True) and \
        get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def _pipeline_ranks():
    return state().ranks("pp")


def get_pipeline_model_parallel_first_rank():
    return _pipeline_ranks()[0]


def get_pipeline_model_parallel_last_rank():
    return _pipeline_ranks()[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage; the last stage's next is the first (a ring)."""
    ranks = _pipeline_ranks()
    size = get_pipeline_model_parallel_world_size()
    return ranks[(get_pipeline_model_parallel_rank() + 1) % size]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage; the first stage's previous is the last (a ring)."""
    ranks = _pipeline_ranks()
    size = get_pipeline_model_parallel_world_size()
    return ranks[(get_pipeline_model_parallel_rank() - 1) % size]


# ----------------------------------------------------------------------------- membership
def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """In the embedding group; unless ``ignore_virtual``, only with the chunk holding the
    embedding (chunk 0 on the first stage, the last chunk on the last stage)."""
    st = state()
    ranks = st.ranks("embedding")
    if st.rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if st.rank == ranks[0]:
        return is_pipeline_first_stage(False, vp_stage)
    if st.rank == ranks[-1]:
        return is_pipeline_last_stage(False, vp_stage)
    return True  # pragma: no cover - default embedding groups hold only first and last


def is_rank_in_position_embedding_group():
    st = state()
    return st.rank in st.ranks("position-embedding")


# ----------------------------------------------------------------------------- global rank lists
def get_tensor_model_parallel_src_rank():
    """Global rank of the first member of this rank's tensor-parallel group."""
    return state().ranks("tp")[0]


def get_model_parallel_src_rank():
    return state().ranks("tp-pp")[0]


def get_data_parallel_src_rank(with_context_parallel=False):
    return state().ranks("dp-cp" if with_context_parallel else "dp")[0]


def get_expert_model_parallel_src_rank():
    return state().ranks("ep")[0]


def get_pipeline_model_parallel_global_ranks():
    """tpfuse addition: the global ranks of this rank's pipeline, first stage first."""
    return state().ranks("pp")


def get_tensor_model_parallel_global_ranks():
    """tpfuse addition: the global ranks of this rank's tensor-parallel group."""
    return state().ranks("tp")


def get_data_parallel_global_ranks(with_context_parallel=False):
    """tpfuse addition: the global ranks of this rank's data-parallel group."""
    return state().ranks("dp-cp" if with_context_parallel else "dp")


def get_embedding_global_ranks():
    """tpfuse addition: this rank's embedding group ([] on middle pipeline stages)."""
    return state().ranks("embedding")
