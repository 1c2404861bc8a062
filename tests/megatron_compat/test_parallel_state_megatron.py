"""tpfuse.megatron_compat.parallel_state against megatron-core 0.16's parallel_state: every public
function (its name and parameter names, from the table below), the setters' override semantics,
the Megatron-only options and errors, and the extra groups (gloo, hierarchical context parallel,
hybrid DP×CP, distributed-optimizer instances) compared with hand-computed rank lists and
exercised with real all-reduces. (Its layout getters are checked against the facade's in
test_parallel_state.py.)
"""
import datetime
import inspect

import pytest
import torch
import torch.distributed as dist

from tpfuse.megatron_compat import parallel_state as mpu
from tpfuse.parallel.state import ParallelState

# megatron-core 0.16 parallel_state: public function -> its parameter names, in order
MEGATRON_FUNCTIONS = {
    'create_group': 'ranks timeout backend pg_options use_local_synchronization group_desc',
    'create_hierarchical_groups': (
        'rank ranks hierarchical_group_sizes create_gloo_process_groups pg_options '
        'timeout group_desc'),
    'create_hybrid_dp_cp_groups': 'rank ranks pg_options',
    'default_embedding_ranks': 'pp_ranks',
    'default_position_embedding_ranks': 'pp_ranks',
    'destroy_global_memory_buffer': '',
    'destroy_global_symmetric_memory_buffer': '',
    'destroy_model_parallel': '',
    'generate_masked_orthogonal_rank_groups': 'world_size parallel_size mask',
    'get_all_ranks': '',
    'get_amax_reduction_group': 'with_context_parallel tp_only_amax_red',
    'get_context_parallel_global_ranks': 'check_initialized',
    'get_context_parallel_group': 'check_initialized',
    'get_context_parallel_rank': '',
    'get_context_parallel_world_size': '',
    'get_data_modulo_expert_parallel_group': 'partial_expert_data_parallel',
    'get_data_parallel_group': (
        'with_context_parallel partial_data_parallel independent_all_gather'),
    'get_data_parallel_group_gloo': 'with_context_parallel partial_data_parallel',
    'get_data_parallel_rank': 'with_context_parallel partial_data_parallel',
    'get_data_parallel_src_rank': 'with_context_parallel',
    'get_data_parallel_world_size': 'with_context_parallel partial_data_parallel',
    'get_embedding_group': 'check_initialized',
    'get_expert_data_parallel_group': 'check_initialized partial_expert_data_parallel',
    'get_expert_data_parallel_group_gloo': 'partial_expert_data_parallel',
    'get_expert_data_parallel_rank': 'partial_expert_data_parallel',
    'get_expert_data_parallel_world_size': 'partial_expert_data_parallel',
    'get_expert_model_parallel_group': 'check_initialized',
    'get_expert_model_parallel_rank': '',
    'get_expert_model_parallel_src_rank': '',
    'get_expert_model_parallel_world_size': '',
    'get_expert_tensor_and_model_parallel_group': 'check_initialized',
    'get_expert_tensor_and_model_parallel_rank': '',
    'get_expert_tensor_and_model_parallel_world_size': '',
    'get_expert_tensor_model_pipeline_parallel_group': 'check_initialized',
    'get_expert_tensor_parallel_group': 'check_initialized',
    'get_expert_tensor_parallel_rank': '',
    'get_expert_tensor_parallel_world_size': '',
    'get_global_memory_buffer': '',
    'get_global_symmetric_memory_buffer': '',
    'get_hierarchical_context_parallel_groups': 'check_initialized',
    'get_hybrid_data_context_parallel_groups': 'check_initialized group_size',
    'get_inter_distributed_optimizer_instance_group': 'check_initialized',
    'get_intra_distributed_optimizer_instance_group': 'check_initialized',
    'get_model_parallel_group': 'check_initialized',
    'get_model_parallel_src_rank': '',
    'get_nccl_options': 'pg_name nccl_comm_cfgs',
    'get_pipeline_model_parallel_first_rank': '',
    'get_pipeline_model_parallel_group': 'check_initialized',
    'get_pipeline_model_parallel_last_rank': '',
    'get_pipeline_model_parallel_next_rank': '',
    'get_pipeline_model_parallel_prev_rank': '',
    'get_pipeline_model_parallel_rank': '',
    'get_pipeline_model_parallel_world_size': '',
    'get_position_embedding_group': 'check_initialized',
    'get_tensor_and_context_parallel_group': 'check_initialized',
    'get_tensor_and_context_parallel_rank': '',
    'get_tensor_and_context_parallel_world_size': '',
    'get_tensor_and_data_parallel_group': 'check_initialized with_context_parallel',
    'get_tensor_model_parallel_group': 'check_initialized',
    'get_tensor_model_parallel_rank': '',
    'get_tensor_model_parallel_src_rank': '',
    'get_tensor_model_parallel_world_size': '',
    'get_virtual_pipeline_model_parallel_rank': '',
    'get_virtual_pipeline_model_parallel_world_size': '',
    'has_separate_all_gather_group': '',
    'initialize_model_parallel': (
        'tensor_model_parallel_size pipeline_model_parallel_size '
        'virtual_pipeline_model_parallel_size pipeline_model_parallel_comm_backend '
        'use_sharp context_parallel_size hierarchical_context_parallel_sizes '
        'hybrid_context_parallel expert_model_parallel_size '
        'num_distributed_optimizer_instances expert_tensor_parallel_size '
        'nccl_communicator_config_path distributed_timeout_minutes order '
        'get_embedding_ranks get_position_embedding_ranks create_gloo_process_groups '
        'high_priority_stream_groups sharp_enabled_group create_all_gather_group'),
    'is_initialized': '',
    'is_pipeline_first_stage': 'ignore_virtual vp_stage',
    'is_pipeline_last_stage': 'ignore_virtual vp_stage',
    'is_rank_in_embedding_group': 'ignore_virtual vp_stage',
    'is_rank_in_position_embedding_group': '',
    'is_unitialized': '',
    'model_parallel_is_initialized': '',
    'overwrite_nccl_comm_cfgs': 'nccl_comm_cfgs pg_name key_value_pair',
    'set_data_parallel_rank': 'rank',
    'set_expert_model_parallel_rank': 'rank',
    'set_expert_model_parallel_world_size': 'world_size',
    'set_expert_tensor_parallel_rank': 'rank',
    'set_expert_tensor_parallel_world_size': 'world_size',
    'set_pipeline_model_parallel_rank': 'rank',
    'set_pipeline_model_parallel_world_size': 'world_size',
    'set_tensor_model_parallel_rank': 'rank',
    'set_tensor_model_parallel_world_size': 'world_size',
    'set_virtual_pipeline_model_parallel_rank': 'rank',
    'set_virtual_pipeline_model_parallel_world_size': 'world_size',
    'update_pg_timeout': 'timeout pg',
}


def test_every_megatron_function_exists_with_its_parameters():
    assert len(MEGATRON_FUNCTIONS) == 86
    for name, params in MEGATRON_FUNCTIONS.items():
        fn = getattr(mpu, name)
        ours = [p.name for p in inspect.signature(fn).parameters.values()]
        assert ours == params.split(), name


def test_setters_override_getters_without_initialization():
    mpu.destroy_model_parallel()
    assert mpu.get_virtual_pipeline_model_parallel_rank() is None       # Megatron's default
    assert mpu.get_virtual_pipeline_model_parallel_world_size() is None
    with pytest.raises(AssertionError, match="not initialized"):        # Megatron's assert type
        mpu.get_tensor_model_parallel_rank()
    mpu.set_tensor_model_parallel_world_size(4)
    mpu.set_tensor_model_parallel_rank(3)
    mpu.set_pipeline_model_parallel_world_size(2)
    mpu.set_pipeline_model_parallel_rank(1)
    mpu.set_data_parallel_rank(5)
    mpu.set_expert_model_parallel_world_size(8)
    mpu.set_expert_model_parallel_rank(6)
    mpu.set_virtual_pipeline_model_parallel_world_size(3)
    with pytest.warns(DeprecationWarning):
        mpu.set_virtual_pipeline_model_parallel_rank(2)
    try:
        assert (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(),
                mpu.get_pipeline_model_parallel_world_size(),
                mpu.get_pipeline_model_parallel_rank(), mpu.get_data_parallel_rank(),
                mpu.get_expert_model_parallel_world_size(),
                mpu.get_expert_model_parallel_rank()) == (4, 3, 2, 1, 5, 8, 6)
        # expert-tensor falls back to the tensor-parallel override, as in Megatron
        assert mpu.get_expert_tensor_parallel_world_size() == 4
        assert mpu.get_expert_tensor_parallel_rank() == 3
        mpu.set_expert_tensor_parallel_world_size(1)
        mpu.set_expert_tensor_parallel_rank(0)
        assert (mpu.get_expert_tensor_parallel_world_size(),
                mpu.get_expert_tensor_parallel_rank()) == (1, 0)
        assert mpu.is_pipeline_last_stage() and not mpu.is_pipeline_first_stage()
        assert mpu.is_pipeline_last_stage(ignore_virtual=False)           # vp rank 2 of 3
        assert not mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
        with pytest.raises(ValueError, match="non-negative"):
            mpu.set_tensor_model_parallel_rank(-1)
    finally:
        mpu.destroy_model_parallel()
    assert mpu.get_virtual_pipeline_model_parallel_world_size() is None
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        mpu.get_tensor_model_parallel_world_size()                        # overrides cleared


def test_rank_arithmetic_matches_megatron_examples():
    # the worked example of Megatron's docstring: sizes [tp, dp, pp] = [2, 3, 4], the dp groups
    groups = mpu.generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]
    # 16 ranks, tp 2, pp 4: Megatron's documented tp / dp / pp groups
    gen = mpu.RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert gen.get_ranks("dp")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert mpu.RankGenerator(2, 1, 2, 2, 1, "tp-cp-ep-dp-pp", rank_offset=8).get_ranks("tp") \
        == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert mpu.default_embedding_ranks([3, 7, 11]) == [3, 11]
    assert mpu.default_embedding_ranks([5]) == [5]
    assert mpu.default_position_embedding_ranks([3, 7, 11]) == [3]
    cfgs = {}
    mpu.overwrite_nccl_comm_cfgs(cfgs, "dp", ("max_ctas", 4))
    assert cfgs == {"dp": {"max_ctas": 4}} and mpu.get_nccl_options("tp", cfgs) is None
    with pytest.raises(ValueError, match="product"):
        mpu.generate_masked_orthogonal_rank_groups(8, [2, 2], [True, False])
    with pytest.warns(DeprecationWarning):
        assert mpu.is_unitialized()


WORLD = 8


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _sum(group):
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, group=group)
    return int(value.item())


def _mine(groups):
    return next(g for g in groups if dist.get_rank() in g)


def _extra_groups():
    rank = dist.get_rank()
    # tp 2, pp 2: gloo twins, amax groups, one optimizer instance over the whole world
    mpu.initialize_model_parallel(2, 2)
    dp = _ranks(mpu.get_data_parallel_group())
    assert _ranks(mpu.get_data_parallel_group_gloo()) == dp
    assert _ranks(mpu.get_data_parallel_group_gloo(with_context_parallel=True)) == dp
    assert _ranks(mpu.get_expert_data_parallel_group_gloo()) == dp
    assert _ranks(mpu.get_amax_reduction_group()) == _mine([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert _ranks(mpu.get_amax_reduction_group(tp_only_amax_red=True)) == _ranks(
        mpu.get_tensor_model_parallel_group())
    assert _ranks(mpu.get_intra_distributed_optimizer_instance_group()) == list(range(WORLD))
    assert _ranks(mpu.get_data_parallel_group(True, partial_data_parallel=True)) == dp
    assert mpu.get_inter_distributed_optimizer_instance_group(check_initialized=False) is None
    with pytest.raises(RuntimeError, match="num_distributed_optimizer_instances > 1"):
        mpu.get_inter_distributed_optimizer_instance_group()
    assert not mpu.has_separate_all_gather_group()
    assert mpu.get_all_ranks() == "_".join(str(r) for r in (
        rank % 2, (rank // 2) % 2, 0, rank // 4, 0))
    buffer = mpu.get_global_memory_buffer()
    a = buffer.get_tensor((2, 3), torch.float32, "mpu")
    b = buffer.get_tensor((6,), torch.float32, "mpu")
    assert a.data_ptr() == b.data_ptr() and tuple(a.shape) == (2, 3)
    mpu.update_pg_timeout(datetime.timedelta(seconds=123), mpu.get_data_parallel_group())
    mpu.destroy_model_parallel()
    # tp 2, dp 4, two distributed-optimizer instances
    mpu.initialize_model_parallel(2, num_distributed_optimizer_instances=2)
    partial = mpu.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    assert _ranks(partial) == _mine([[0, 2], [4, 6], [1, 3], [5, 7]])
    assert _sum(partial) == sum(r + 1 for r in _ranks(partial))
    assert mpu.get_data_parallel_world_size(True, partial_data_parallel=True) == 2
    inter = mpu.get_inter_distributed_optimizer_instance_group()
    assert _ranks(inter) == _mine([[0, 4], [2, 6], [1, 5], [3, 7]])
    assert _ranks(mpu.get_intra_distributed_optimizer_instance_group()) == _mine(
        [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert _ranks(mpu.get_expert_data_parallel_group(partial_expert_data_parallel=True)) == \
        _ranks(partial)
    mpu.destroy_model_parallel()
    # cp 4 as two levels of 2, and the hybrid DP×CP groups of 2 and 4
    mpu.initialize_model_parallel(context_parallel_size=4,
                                  hierarchical_context_parallel_sizes=[2, 2],
                                  hybrid_context_parallel=True)
    inner, outer = mpu.get_hierarchical_context_parallel_groups()
    assert _ranks(inner) == _mine([[0, 1], [2, 3], [4, 5], [6, 7]])
    assert _ranks(outer) == _mine([[0, 2], [1, 3], [4, 6], [5, 7]])
    assert _sum(outer) == sum(r + 1 for r in _ranks(outer))
    assert _ranks(mpu.get_hybrid_data_context_parallel_groups(group_size=4)) == _mine(
        [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert _ranks(mpu.get_hybrid_data_context_parallel_groups(group_size=8)) == list(range(8))
    with pytest.raises(ValueError, match="size 3"):
        mpu.get_hybrid_data_context_parallel_groups(group_size=3)
    mpu.destroy_model_parallel()
    with pytest.raises(ValueError, match="multiply to context_parallel_size=2"):
        mpu.initialize_model_parallel(context_parallel_size=2,
                                      hierarchical_context_parallel_sizes=[2, 2])
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances=3"):
        mpu.initialize_model_parallel(2, num_distributed_optimizer_instances=3)
    return len(dist.distributed_c10d._world.pg_map)


def test_extra_groups_match_hand_computed_ranks(run_distributed):
    assert run_distributed(WORLD, _extra_groups) == [1] * WORLD


def _virtual_pipeline_via_facade():
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                                  virtual_pipeline_model_parallel_size=2)
    stage = mpu.get_pipeline_model_parallel_rank()
    with pytest.warns(DeprecationWarning, match="vp_stage"):
        mpu.set_virtual_pipeline_model_parallel_rank(1)
    assert mpu.get_virtual_pipeline_model_parallel_rank() == 1
    assert not mpu.is_pipeline_first_stage(ignore_virtual=False)
    assert mpu.is_pipeline_last_stage(ignore_virtual=False) == (stage == 3)
    assert mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) == (stage == 0)
    assert mpu.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=1) == (stage == 3)
    assert mpu.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=0) == (stage == 0)
    with pytest.raises(ValueError, match="virtual pipeline rank"), \
            pytest.warns(DeprecationWarning):
        mpu.set_virtual_pipeline_model_parallel_rank(2)
    mpu.set_virtual_pipeline_model_parallel_world_size(4)
    assert mpu.get_virtual_pipeline_model_parallel_world_size() == 4


def test_virtual_pipeline_via_facade(run_distributed):
    run_distributed(WORLD, _virtual_pipeline_via_facade)


GETTERS_BEFORE_INIT = [
    ("get_tensor_model_parallel_rank", ()), ("get_tensor_model_parallel_world_size", ()),
    ("get_tensor_model_parallel_group", ()), ("get_pipeline_model_parallel_rank", ()),
    ("get_data_parallel_group", ()), ("get_data_parallel_rank", ()),
    ("get_data_parallel_world_size", ()), ("get_context_parallel_rank", ()),
    ("get_expert_model_parallel_world_size", ()), ("get_expert_data_parallel_rank", ()),
    ("get_expert_tensor_parallel_group", ()), ("get_model_parallel_group", ()),
    ("get_embedding_group", ()), ("is_pipeline_first_stage", ()), ("is_pipeline_last_stage", ()),
    ("is_rank_in_embedding_group", ()), ("get_global_memory_buffer", ()),
    ("get_pipeline_model_parallel_next_rank", ()), ("get_tensor_model_parallel_src_rank", ()),
]


def _errors_before_and_around_init():
    mpu.destroy_model_parallel()  # safe when nothing is initialised
    assert not mpu.model_parallel_is_initialized()
    for getter, args in GETTERS_BEFORE_INIT:
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            getattr(mpu, getter)(*args)
    assert mpu.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(ValueError, match="tp\\*pp\\*cp=3"):
        mpu.initialize_model_parallel(tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="use_sharp=True"):
        mpu.initialize_model_parallel(use_sharp=True)
    with pytest.raises(TypeError, match="no_such_option"):
        mpu.initialize_model_parallel(no_such_option=1)
    assert len(dist.distributed_c10d._world.pg_map) == 1  # nothing was created
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    with pytest.raises(RuntimeError, match="already initialized"):
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="partial"):
        mpu.get_data_parallel_group(partial_data_parallel=True)
    # a state the job forgets to destroy is destroyed by destroy_model_parallel too
    ParallelState.initialize(pp=2)
    mpu.destroy_model_parallel()
    mpu.destroy_model_parallel()
    return len(dist.distributed_c10d._world.pg_map)


def test_errors_before_init_and_cleanup(run_distributed):
    assert run_distributed(WORLD, _errors_before_and_around_init) == [1] * WORLD


def _facade_destroy_releases_megatron_groups():
    """The facade's destroy_model_parallel (what the worker pool calls after a job) also
    destroys the extra groups and forgets the overrides of megatron_compat's module."""
    from tpfuse.parallel import parallel_state as facade

    mpu.initialize_model_parallel(2, context_parallel_size=2,
                                  hierarchical_context_parallel_sizes=[2, 1])
    mpu.set_tensor_model_parallel_world_size(4)
    facade.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        mpu.get_tensor_model_parallel_world_size()
    assert mpu.get_hierarchical_context_parallel_groups(check_initialized=False) is None
    return len(dist.distributed_c10d._world.pg_map)


def test_facade_destroy_releases_megatron_groups(run_distributed):
    assert run_distributed(WORLD, _facade_destroy_releases_megatron_groups) == [1] * WORLD
