"""ParallelState and the module-level parallel_state facade, in a world of 8 gloo processes.

Every getter is compared with the pure RankLayout (itself hand-checked in test_layout.py), and
every group is exercised with a real all-reduce so a wrong group cannot hide behind right numbers.
Megatron's own parallel_state (setters, extra groups, Megatron-only options) is tested in
test_parallel_state_megatron.py; here its getters are checked to equal the facade's.
"""
import importlib

import pytest
import torch
import torch.distributed as dist

from tpfuse.parallel import parallel_state as mpu
from tpfuse.parallel.launch import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpfuse.parallel.layout import GROUP_NAMES, RankLayout
from tpfuse.parallel.state import ParallelState, get_default_state, set_default_state

WORLD = 8
CONFIGS = [
    dict(tp=2, pp=2),
    dict(tp=2, pp=2, cp=2),
    dict(tp=2, etp=1, ep=2),
    dict(tp=2, pp=2, order="tp-pp-dp"),
    dict(tp=1, pp=8),
]


def _sum_of_ranks(group) -> int:
    """All-reduce (global rank + 1) over ``group``: identifies the members by their sum."""
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, group=group)
    return int(value.item())


# ----------------------------------------------------------------------------- ParallelState
def _state_matches_layout(configs):
    rank = dist.get_rank()
    for config in configs:
        state = ParallelState.initialize(**config)
        layout = RankLayout(WORLD, **config)
        for name in GROUP_NAMES:
            expected = layout.group_of(name, rank)
            group = state.group(name)
            if expected is None:  # an embedding group this rank is not in
                assert group is None and state.ranks(name) == [] and state.rank_in(name) is None
                continue
            assert state.ranks(name) == expected, (config, name)
            assert dist.get_process_group_ranks(group) == expected, (config, name)
            assert state.size(name) == group.size() == len(expected)
            assert state.rank_in(name) == group.rank() == expected.index(rank)
            assert _sum_of_ranks(group) == sum(r + 1 for r in expected), (config, name)
        coords = layout.coords(rank)
        assert (state.tp_rank, state.pp_rank, state.dp_rank, state.cp_rank) == (
            coords["tp"], coords["pp"], coords["dp"], coords["cp"])
        assert (state.ep_rank, state.etp_rank, state.edp_rank) == (
            coords["ep"], coords["etp"], coords["edp"])
        assert (state.tp_size, state.pp_size, state.dp_size, state.cp_size) == (
            layout.tp, layout.pp, layout.dp, layout.cp)
        assert state.dp_cp_size == layout.dp * layout.cp
        assert state.dp_cp_group is state.group("dp-cp")
        pipe = layout.group_of("pp", rank)
        stage = pipe.index(rank)
        assert state.next_pp_rank == pipe[(stage + 1) % len(pipe)]
        assert state.prev_pp_rank == pipe[(stage - 1) % len(pipe)]
        assert state.is_pipeline_first_stage() == (stage == 0)
        assert state.is_pipeline_last_stage() == (stage == len(pipe) - 1)
        state.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            state.tp_group
    return len(dist.distributed_c10d._world.pg_map)


def test_state_groups_match_layout_and_communicate(run_distributed):
    # destroy() leaves only the world group behind on every rank
    assert run_distributed(WORLD, _state_matches_layout, CONFIGS) == [1] * WORLD


def _size_one_groups_are_real_groups():
    state = ParallelState.initialize(tp=1, pp=1)  # tp, pp, cp groups of one rank
    value = torch.tensor([3.0 + dist.get_rank()])
    for group in (state.tp_group, state.pp_group, state.cp_group):
        dist.all_reduce(value, group=group)
        out = [torch.zeros(1)]
        dist.all_gather(out, value, group=group)
        assert out[0].item() == value.item()
    assert value.item() == 3.0 + dist.get_rank()
    # groups inherit the world group's timeout (the pool's), not torch's 30 min default
    cpu = torch.device("cpu")
    world_timeout = dist.distributed_c10d._get_default_group()._get_backend(cpu).options._timeout
    assert state.dp_group._get_backend(cpu).options._timeout == world_timeout
    assert world_timeout.total_seconds() == DEFAULT_COLLECTIVE_TIMEOUT_S
    state.destroy()


def test_size_one_groups_are_noop_groups(run_distributed):
    run_distributed(WORLD, _size_one_groups_are_real_groups)


def _virtual_pipeline_stages():
    state = ParallelState.initialize(tp=2, pp=2, vpp=3)
    first, last = state.pp_rank == 0, state.pp_rank == 1
    assert state.vpp_size == 3 and state.vpp_rank == 0
    assert state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) == first
    assert not state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
    assert state.is_pipeline_first_stage(vp_stage=1) == first  # ignore_virtual defaults to True
    assert state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=2) == last
    assert not state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    state.vpp_rank = 2  # used when vp_stage is not given
    assert state.is_pipeline_last_stage(ignore_virtual=False) == last
    assert not state.is_pipeline_first_stage(ignore_virtual=False)
    # the tied embedding lives in chunk 0 of the first stage and the last chunk of the last
    assert state.is_rank_in_embedding_group()
    assert state.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=0) == first
    assert state.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=2) == last
    with pytest.raises(ValueError, match="vp_stage"):
        state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=3)
    state.destroy()


def test_virtual_pipeline_stages(run_distributed):
    run_distributed(WORLD, _virtual_pipeline_stages)


def _invalid_settings_raise_before_any_group():
    before = len(dist.distributed_c10d._world.pg_map)
    messages = []
    for kwargs in (dict(tp=3), dict(tp=2, pp=2, etp=1, order="tp-pp-dp"), dict(vpp=2),
                   dict(pp=2, vpp=0)):
        with pytest.raises(ValueError) as info:
            ParallelState.initialize(**kwargs)
        messages.append(str(info.value))
    with pytest.raises(ValueError, match="layout.world_size=4"):
        ParallelState(RankLayout(4))
    assert len(dist.distributed_c10d._world.pg_map) == before
    return messages


def test_invalid_settings_raise_value_error_before_groups(run_distributed):
    messages = run_distributed(WORLD, _invalid_settings_raise_before_any_group)[0]
    assert "tp*pp*cp=3" in messages[0]
    assert "edp=4" in messages[1] and "dp=2" in messages[1]
    assert "vpp=2" in messages[2] and "pp=1" in messages[2]
    assert "vpp" in messages[3] and "0" in messages[3]


def _default_state_roundtrip():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        get_default_state()
    state = ParallelState.initialize(tp=4, set_default=True)
    assert get_default_state() is state
    state.destroy()  # destroying the default clears it
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        get_default_state()
    other = ParallelState.initialize(pp=2)
    set_default_state(other)
    assert get_default_state() is other
    set_default_state(None)
    other.destroy()
    with pytest.raises(ValueError, match="ParallelState or None"):
        set_default_state("tp")


def test_default_state(run_distributed):
    run_distributed(WORLD, _default_state_roundtrip)


def _resolver_and_comm_options():
    from tpfuse.parallel.comm_options import CommOptions
    from tpfuse.parallel.state import resolve_state, resolve_state_or_none
    from tpfuse.tp_layers._group import resolve_tp_group

    for resolve in (resolve_state, resolve_state_or_none):   # a distributed run must name one
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            resolve()
    options = CommOptions(reduce_scatter="all_reduce", fused_min_flops=0)
    state = ParallelState.initialize(tp=2, set_default=True, comm_options=options)
    explicit = ParallelState.initialize(tp=4)
    try:
        assert resolve_state() is state and resolve_state_or_none() is state
        assert resolve_state(explicit) is explicit and resolve_state_or_none(explicit) is explicit
        assert state.comm_options is options and explicit.comm_options == CommOptions()
        tp = resolve_tp_group()                                    # from the default state
        assert tp.options is options
        state.comm_options = None                                  # back to the defaults, live
        assert tp.options == CommOptions()
        with pytest.raises(ValueError, match="CommOptions or None"):
            state.comm_options = {"fused_min_flops": 0}
        assert resolve_tp_group(group=state.tp_group).options == CommOptions()
    finally:
        explicit.destroy()
        state.destroy()
    return True


def test_resolver_and_comm_options_of_a_state(run_distributed):
    assert all(run_distributed(WORLD, _resolver_and_comm_options))


def test_plain_process_resolves_to_none_and_default_options():
    from tpfuse.parallel.comm_options import CommOptions
    from tpfuse.parallel.state import resolve_state, resolve_state_or_none
    from tpfuse.tp_layers._group import resolve_tp_group

    assert resolve_state_or_none() is None                     # no default, no torch.distributed
    with pytest.raises(RuntimeError, match="pass state= explicitly"):
        resolve_state()
    assert resolve_tp_group().size == 1 and resolve_tp_group().options == CommOptions()
    with pytest.raises(ValueError, match="reduce-scatter strategy.*'ring'"):
        CommOptions(reduce_scatter="ring")
    with pytest.raises(ValueError, match="symm_mem must be a bool"):
        CommOptions(symm_mem="yes")


def test_shortcut_properties_are_written_out():
    """Every ``<kind>_group / _rank / _size`` is a real property of the class with a docstring."""
    kinds = ("tp", "pp", "dp", "cp", "dp_cp", "ep", "etp", "edp", "embedding",
             "position_embedding")
    for kind in kinds:
        for suffix in ("group", "rank", "size"):
            prop = ParallelState.__dict__[f"{kind}_{suffix}"]
            assert isinstance(prop, property) and prop.__doc__, f"{kind}_{suffix}"


# ----------------------------------------------------------------------------- Megatron facade
# facade group getter -> layout group name
FACADE_GROUPS = {
    "get_tensor_model_parallel_group": "tp",
    "get_pipeline_model_parallel_group": "pp",
    "get_data_parallel_group": "dp",
    "get_context_parallel_group": "cp",
    "get_model_parallel_group": "tp-pp",
    "get_tensor_and_data_parallel_group": "tp-dp",
    "get_tensor_and_context_parallel_group": "tp-cp",
    "get_expert_model_parallel_group": "ep",
    "get_expert_tensor_parallel_group": "etp",
    "get_expert_tensor_and_model_parallel_group": "etp-ep",
    "get_expert_tensor_model_pipeline_parallel_group": "etp-ep-pp",
    "get_expert_data_parallel_group": "edp",
}
# facade prefix of get_<prefix>_rank / get_<prefix>_world_size -> layout group name
FACADE_RANKS = {
    "tensor_model_parallel": "tp", "pipeline_model_parallel": "pp", "data_parallel": "dp",
    "context_parallel": "cp", "tensor_and_context_parallel": "tp-cp",
    "expert_model_parallel": "ep", "expert_tensor_parallel": "etp",
    "expert_tensor_and_model_parallel": "etp-ep", "expert_data_parallel": "edp",
}
FACADE_CONFIGS = [
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2),
    dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
         expert_tensor_parallel_size=1),
    dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
         virtual_pipeline_model_parallel_size=2, order="tp-cp-ep-dp-pp"),
]


def _layout_of(config) -> RankLayout:
    return RankLayout(
        WORLD, tp=config.get("tensor_model_parallel_size", 1),
        pp=config.get("pipeline_model_parallel_size", 1),
        cp=config.get("context_parallel_size", 1), ep=config.get("expert_model_parallel_size", 1),
        etp=config.get("expert_tensor_parallel_size"), order=config.get("order", "tp-cp-ep-dp-pp"))


def _check_facade(config, mpu=mpu):
    """Every getter of ``mpu`` (the facade, or a module offering the same functions) against
    the layout."""
    rank = dist.get_rank()
    layout = _layout_of(config)
    for getter, name in FACADE_GROUPS.items():
        expected = layout.group_of(name, rank)
        group = getattr(mpu, getter)()
        assert dist.get_process_group_ranks(group) == expected, (getter, expected)
        assert _sum_of_ranks(group) == sum(r + 1 for r in expected), getter
    for prefix, name in FACADE_RANKS.items():
        assert getattr(mpu, f"get_{prefix}_rank")() == layout.rank_in(name, rank), prefix
        assert getattr(mpu, f"get_{prefix}_world_size")() == len(layout.group_of(name, rank))
    dp_cp = layout.group_of("dp-cp", rank)
    assert dist.get_process_group_ranks(mpu.get_data_parallel_group(with_context_parallel=True)) \
        == dp_cp
    assert mpu.get_data_parallel_rank(with_context_parallel=True) == dp_cp.index(rank)
    assert mpu.get_data_parallel_world_size(with_context_parallel=True) == len(dp_cp)
    assert mpu.get_data_parallel_src_rank(with_context_parallel=True) == dp_cp[0]
    tp_dp_cp = mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)
    assert dist.get_process_group_ranks(tp_dp_cp) == layout.group_of("tp-dp-cp", rank)
    # pipeline helpers
    pipe = layout.group_of("pp", rank)
    stage = pipe.index(rank)
    assert mpu.is_pipeline_first_stage() == (stage == 0)
    assert mpu.is_pipeline_last_stage() == (stage == len(pipe) - 1)
    assert mpu.get_pipeline_model_parallel_next_rank() == pipe[(stage + 1) % len(pipe)]
    assert mpu.get_pipeline_model_parallel_prev_rank() == pipe[(stage - 1) % len(pipe)]
    assert mpu.get_pipeline_model_parallel_first_rank() == pipe[0]
    assert mpu.get_pipeline_model_parallel_last_rank() == pipe[-1]
    assert mpu.get_pipeline_model_parallel_global_ranks() == pipe
    # rank-list getters
    assert mpu.get_tensor_model_parallel_src_rank() == layout.group_of("tp", rank)[0]
    assert mpu.get_tensor_model_parallel_global_ranks() == layout.group_of("tp", rank)
    assert mpu.get_model_parallel_src_rank() == layout.group_of("tp-pp", rank)[0]
    assert mpu.get_data_parallel_src_rank() == layout.group_of("dp", rank)[0]
    assert mpu.get_data_parallel_global_ranks() == layout.group_of("dp", rank)
    assert mpu.get_expert_model_parallel_src_rank() == layout.group_of("ep", rank)[0]
    assert mpu.get_context_parallel_global_ranks() == layout.group_of("cp", rank)
    # embedding groups: first and last stage, position embedding: first stage
    embedding = layout.group_of("embedding", rank)
    assert mpu.is_rank_in_embedding_group() == (embedding is not None)
    assert mpu.is_rank_in_position_embedding_group() == (stage == 0)
    if embedding is None:
        with pytest.raises(RuntimeError, match="not in a embedding group"):
            mpu.get_embedding_group()
        assert mpu.get_embedding_group(check_initialized=False) is None
        assert mpu.get_embedding_global_ranks() == []
    else:
        assert dist.get_process_group_ranks(mpu.get_embedding_group()) == embedding
        assert _sum_of_ranks(mpu.get_embedding_group()) == sum(r + 1 for r in embedding)
    if stage == 0:
        assert dist.get_process_group_ranks(mpu.get_position_embedding_group()) == [rank]


def _facade_matches_layout(configs):
    for config in configs:
        state = mpu.initialize_model_parallel(**config)
        assert mpu.model_parallel_is_initialized() and get_default_state() is state
        _check_facade(config)
        vpp = config.get("virtual_pipeline_model_parallel_size")
        assert mpu.get_virtual_pipeline_model_parallel_world_size() == vpp
        assert mpu.get_virtual_pipeline_model_parallel_rank() == (0 if vpp else None)
        mpu.destroy_model_parallel()
        assert not mpu.model_parallel_is_initialized()
    return len(dist.distributed_c10d._world.pg_map)


def test_facade_getters_match_layout_then_reinitialize(run_distributed):
    # one job re-initialises four times with different sizes; only the world group remains
    assert run_distributed(WORLD, _facade_matches_layout, FACADE_CONFIGS) == [1] * WORLD


def _megatron_module_equals_facade(configs):
    """megatron_compat.parallel_state's getters (no override set) return what the facade's do."""
    megatron = importlib.import_module("tpfuse.megatron_compat.parallel_state")
    for config in configs:
        assert megatron.initialize_model_parallel(**config) is None   # Megatron returns None
        _check_facade(config, megatron)
        _check_facade(config, mpu)
        assert megatron.get_virtual_pipeline_model_parallel_world_size() == \
            mpu.get_virtual_pipeline_model_parallel_world_size()
        megatron.destroy_model_parallel()
    return len(dist.distributed_c10d._world.pg_map)


def test_megatron_module_getters_equal_the_facade(run_distributed):
    assert run_distributed(WORLD, _megatron_module_equals_facade, FACADE_CONFIGS) == [1] * WORLD


GETTERS_BEFORE_INIT = [
    ("get_tensor_model_parallel_rank", ()), ("get_tensor_model_parallel_world_size", ()),
    ("get_tensor_model_parallel_group", ()), ("get_pipeline_model_parallel_rank", ()),
    ("get_data_parallel_group", ()), ("get_data_parallel_rank", ()),
    ("get_data_parallel_world_size", ()), ("get_context_parallel_rank", ()),
    ("get_expert_model_parallel_world_size", ()), ("get_expert_data_parallel_rank", ()),
    ("get_expert_tensor_parallel_group", ()), ("get_model_parallel_group", ()),
    ("get_embedding_group", ()), ("is_pipeline_first_stage", ()), ("is_pipeline_last_stage", ()),
    ("is_rank_in_embedding_group", ()),
    ("get_pipeline_model_parallel_next_rank", ()), ("get_tensor_model_parallel_src_rank", ()),
]


def _errors_before_and_around_init():
    mpu.destroy_model_parallel()  # safe when nothing is initialised
    assert not mpu.model_parallel_is_initialized()
    for getter, args in GETTERS_BEFORE_INIT:
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            getattr(mpu, getter)(*args)
    assert mpu.get_tensor_model_parallel_group(check_initialized=False) is None
    assert mpu.get_virtual_pipeline_model_parallel_world_size() is None
    with pytest.raises(ValueError, match="tp\\*pp\\*cp=3"):
        mpu.initialize_model_parallel(tensor_model_parallel_size=3)
    with pytest.raises(TypeError, match="use_sharp"):    # Megatron's options: megatron_compat's
        mpu.initialize_model_parallel(use_sharp=True)
    with pytest.raises(TypeError, match="no_such_option"):
        mpu.initialize_model_parallel(no_such_option=1)
    assert len(dist.distributed_c10d._world.pg_map) == 1  # nothing was created
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="already initialized"):
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    # a state the job forgets to destroy is destroyed by destroy_model_parallel too
    ParallelState.initialize(pp=2)
    mpu.destroy_model_parallel()
    mpu.destroy_model_parallel()
    return len(dist.distributed_c10d._world.pg_map)


def test_errors_before_init_and_cleanup(run_distributed):
    assert run_distributed(WORLD, _errors_before_and_around_init) == [1] * WORLD
