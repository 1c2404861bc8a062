"""The details Megatron's own unit tests reach, checked against megatron-core 0.16's behaviour:
the calculator's module global and Megatron's assertion points, the RNG tracker's ``set_states``,
the parallel-state group globals and ``create_all_gather_group``."""
import pytest
import torch
import torch.distributed as dist

from tpfuse.megatron_compat import num_microbatches_calculator as nmc
from tpfuse.megatron_compat import parallel_state as mpu
from tpfuse.megatron_compat.tensor_parallel import CudaRNGStatesTracker, get_cuda_rng_tracker
from tpfuse.parallel.microbatches import MicrobatchCalculator


def test_calculator_global_is_megatrons_and_checks_where_megatron_asserts():
    nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None            # as Megatron's tests reset it
    nmc.init_num_microbatches_calculator(0, None, 32, 8, 2, False)
    assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR.get() == 2
    with pytest.raises(AssertionError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 32, 8, 2, False)
    built = nmc._build_num_microbatches_calculator(0, None, 33, 8, 2, True)
    assert (built.get(), built.get_current_running_global_batch_size()) == (2, 32)
    assert nmc.get_num_microbatches() == 2                     # _build left the global alone
    with pytest.raises(AssertionError, match="not divisible"):  # constant: at construction
        nmc._build_num_microbatches_calculator(0, None, 33, 8, 2, False)
    # ramp 16 -> 32 by 8 over 96 samples at micro 8 x dp 2: the 24 step is not divisible by 16;
    # Megatron builds it and asserts at the update that reaches it (tpfuse's native refuses it)
    with pytest.raises(ValueError, match="not divisible"):
        MicrobatchCalculator(32, 8, 2, rampup_batch_size=[16, 8, 96])
    nmc.reconfigure_num_microbatches_calculator(0, [16, 8, 96], 32, 8, 2, False)
    assert nmc.get_num_microbatches() == 1
    nmc.update_num_microbatches(48, False)                     # no check: floored
    assert (nmc.get_current_global_batch_size(), nmc.get_num_microbatches()) == (24, 1)
    with pytest.raises(AssertionError, match="not divisible"):
        nmc.update_num_microbatches(49, True)
    native = MicrobatchCalculator(32, 4, 2, rampup_batch_size=[16, 8, 96])
    nmc.reconfigure_num_microbatches_calculator(0, [16, 8, 96], 32, 4, 2, False)
    for consumed in (0, 47, 48, 96, 97):                       # the same schedule as the native
        nmc.update_num_microbatches(consumed)
        native.update(consumed)
        assert nmc.get_num_microbatches() == native.num_microbatches, consumed
    nmc.destroy_num_microbatches_calculator()
    assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None


def test_rng_tracker_set_states_stores_what_it_is_given():
    tracker = CudaRNGStatesTracker()
    tracker.set_states({"state1": 1234})
    assert tracker.get_states()["state1"] == 1234
    with pytest.raises(RuntimeError, match="'state1' holds int"):
        with tracker.fork("state1"):
            pass
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("s", 7)
    copy = CudaRNGStatesTracker()
    copy.set_states(tracker.get_states())                      # generator states: streams
    with copy.fork("s"):
        drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert isinstance(get_cuda_rng_tracker(), CudaRNGStatesTracker)


def _draws(tracker, plan):
    """Run ``plan`` (nested lists of stream names) drawing 3 numbers on entering each fork and
    on leaving it; {stream: its draws in order}."""
    drawn = {}

    def run(name, inner):
        with tracker.fork(name):
            drawn.setdefault(name, []).append(torch.randn(3))
            for child in inner:
                run(*child)
            drawn[name].append(torch.randn(3))
    for item in plan:
        run(*item)
    return drawn


@pytest.mark.parametrize("graphable", [False, True])
def test_rng_tracker_nested_forks_continue_each_stream(graphable):
    """a inside b inside a: each stream's draws are the ones of forking it alone, in sequence
    (Megatron's nesting), the default generator comes back unchanged; the graph-safe tracker
    (emulated on CPU with Generator objects) behaves the same."""
    def fresh():
        tracker = CudaRNGStatesTracker(use_cudagraphable_rng=graphable)
        tracker.add("a", 1234)
        tracker.add("b", 5678)
        return tracker
    before = torch.get_rng_state()
    nested = _draws(fresh(), [("a", [("b", [("a", [])])])])
    alone = _draws(fresh(), [("a", []), ("a", []), ("b", [])])
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(torch.cat(nested["a"]), torch.cat(alone["a"]))
    assert torch.equal(torch.cat(nested["b"]), torch.cat(alone["b"]))


def test_rng_states_convert_between_plain_and_graph_safe_trackers():
    from tpfuse.megatron_compat.tensor_parallel import (convert_cuda_rng_state,
                                                        is_graph_safe_cuda_rng_tracker)

    plain = CudaRNGStatesTracker()
    plain.add("s", 9)
    graph_safe = CudaRNGStatesTracker(use_cudagraphable_rng=True)
    assert is_graph_safe_cuda_rng_tracker(graph_safe) and not is_graph_safe_cuda_rng_tracker(plain)
    graph_safe.set_states({"s": convert_cuda_rng_state(plain.states_["s"], to_graphable=True)})
    assert isinstance(graph_safe.get_states()["s"], torch.Generator)
    with plain.fork("s"), torch.random.fork_rng():
        expected = torch.rand(4)
    with graph_safe.fork("s"):
        assert torch.equal(torch.rand(4), expected)
    back = convert_cuda_rng_state(graph_safe.states_["s"], to_graphable=False)
    assert torch.equal(back, graph_safe.get_states()["s"].get_state())


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _group_globals():
    assert mpu._MODEL_PARALLEL_GROUP is None and mpu._DATA_PARALLEL_GROUP_WITH_CP_AG is None
    mpu.initialize_model_parallel(2, context_parallel_size=2)
    assert _ranks(mpu._MODEL_PARALLEL_GROUP) == _ranks(mpu.get_model_parallel_group())
    assert mpu._DATA_PARALLEL_GROUP_WITH_CP_AG is None and not mpu.has_separate_all_gather_group()
    mpu._MODEL_PARALLEL_GROUP = None                            # Megatron's tests do this
    with pytest.raises(AssertionError, match="model parallel group is not initialized"):
        mpu.get_model_parallel_group()
    assert mpu.get_model_parallel_group(check_initialized=False) is None
    mpu.destroy_model_parallel()
    assert mpu._MODEL_PARALLEL_GROUP is None
    mpu.initialize_model_parallel(2, context_parallel_size=2, create_all_gather_group=True)
    assert _ranks(mpu.get_model_parallel_group()) == _ranks(mpu.get_tensor_model_parallel_group())
    assert mpu.has_separate_all_gather_group()
    all_gather = mpu.get_data_parallel_group(with_context_parallel=True,
                                             independent_all_gather=True)
    regular = mpu.get_data_parallel_group(with_context_parallel=True)
    assert all_gather is not regular and _ranks(all_gather) == _ranks(regular)
    value = torch.ones(1)
    dist.all_reduce(value, group=all_gather)
    assert value.item() == 2
    mpu.destroy_model_parallel()
    assert mpu._DATA_PARALLEL_GROUP_WITH_CP_AG is None
    return 1


def test_parallel_state_group_globals_and_all_gather_group(run_distributed):
    assert run_distributed(4, _group_globals) == [1] * 4


class _Chunk(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


def _interleaved_checks_and_shape():
    from tpfuse.megatron_compat.model_parallel_config import ModelParallelConfig
    from tpfuse.megatron_compat.pipeline_parallel import schedules
    mpu.initialize_model_parallel(1, 2, 2)
    try:
        config = ModelParallelConfig(pipeline_model_parallel_size=2,
                                     virtual_pipeline_model_parallel_size=2,
                                     pipeline_dtype=torch.float32)
        config.hidden_size = 8
        chunks = [_Chunk(config), _Chunk(config)]
        call = dict(forward_step_func=None, data_iterator=[iter([]), iter([])], model=chunks,
                    seq_length=16, micro_batch_size=2, forward_only=True)
        with pytest.raises(RuntimeError, match="mod microbatch_group_size_per_vp_stage=2 = 1"):
            schedules.forward_backward_pipelining_with_interleaving(num_microbatches=7, **call)
        with pytest.raises(ValueError, match=r"must lie in \[pp=2, num_microbatches=1\]"):
            schedules.forward_backward_pipelining_with_interleaving(num_microbatches=1, **call)
        seen = {}

        def spy(native, interleaved, **kwargs):
            seen.update(kwargs)
            return []
        original, schedules._run = schedules._run, spy
        try:
            schedules.forward_backward_pipelining_with_interleaving(
                num_microbatches=4, decoder_seq_length=512, **call)
            assert "decoder_seq_length" not in seen and seen["seq_length"] == 16
            seen.clear()
            schedules.forward_backward_pipelining_without_interleaving(
                num_microbatches=4, decoder_seq_length=512, **dict(call, data_iterator=iter([])))
            assert seen["decoder_seq_length"] == 512      # 1F1B uses it, as Megatron's
        finally:
            schedules._run = original
    finally:
        mpu.destroy_model_parallel()
    return 1


def test_interleaved_schedule_checks_like_megatron_and_ignores_decoder_seq_length(
        run_distributed):
    assert run_distributed(2, _interleaved_checks_and_shape) == [1] * 2


def _distributed_saved_activations():
    """checkpoint(f, True, x, ...): after the forward x holds this tp rank's half of its flat
    elements; backward gathers it back and gives the gradients of the plain run (the same
    arithmetic: compared exactly), dropout from a tracker stream included."""
    from tpfuse.megatron_compat.tensor_parallel import (checkpoint,
                                                        model_parallel_cuda_manual_seed)
    from tpfuse.megatron_compat.utils import get_tensor_model_parallel_group_if_none

    mpu.initialize_model_parallel(2)
    try:
        tp_group = mpu.get_tensor_model_parallel_group()
        assert get_tensor_model_parallel_group_if_none(None) is tp_group
        assert get_tensor_model_parallel_group_if_none(None, is_expert=True) is \
            mpu.get_expert_tensor_parallel_group()
        given = object()
        assert get_tensor_model_parallel_group_if_none(given) is given
        weight = torch.linspace(-1.0, 1.0, 12).view(3, 4).requires_grad_()

        def block(x, scale):
            with get_cuda_rng_tracker().fork():
                return torch.nn.functional.dropout((x @ weight.t()).tanh() * scale, 0.5)

        runs = []
        for distribute in (None, True):
            model_parallel_cuda_manual_seed(3)
            weight.grad = None
            x = torch.arange(8.0).view(2, 4).div(8).requires_grad_()
            scale = torch.full((2, 3), 2.0, requires_grad=True)
            out = block(x, scale) if distribute is None else checkpoint(block, True, x, scale)
            if distribute:
                rank = mpu.get_tensor_model_parallel_rank()
                assert x.shape == (4,)
                assert torch.equal(x.detach(), torch.arange(8.0).div(8)[4 * rank:4 * rank + 4])
            (out * torch.arange(6.0).view(2, 3)).sum().backward()
            runs.append((out.detach(), x.grad, scale.grad, weight.grad.clone()))
        for plain, checkpointed in zip(*runs):
            assert torch.equal(plain, checkpointed)
    finally:
        mpu.destroy_model_parallel()
        get_cuda_rng_tracker().reset()
    return 1


def test_checkpoint_distributes_saved_activations_over_tp(run_distributed):
    assert run_distributed(2, _distributed_saved_activations) == [1] * 2


@pytest.mark.parametrize("shape, names", [([2, 1, 4, 1], ["tp", "cp", "pp", "dp"]),
                                          ([2, 2, 2, 1], ["tp", "cp", "dp", "pp"])])
def test_hyper_comm_grid_enumerates_as_the_rank_generator(monkeypatch, shape, names):
    """HyperCommGrid's groups of one dim are the RankGenerator's for the same order string;
    inside a multi-dim group the last named dim varies fastest (Megatron's enumeration)."""
    from tpfuse.megatron_compat.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid(shape, names)
    sizes = dict(zip(names, shape))
    generator = mpu.RankGenerator(tp=sizes["tp"], ep=1, dp=sizes["dp"], pp=sizes["pp"],
                                  cp=sizes["cp"], order="-".join(names))
    for dim in names:
        assert grid.get_rank_enum(dim) == generator.get_ranks(dim), dim
    assert HyperCommGrid([2, 2, 2], ["a", "b", "c"]).get_rank_enum(["a", "b"]) == \
        [[0, 2, 1, 3], [4, 6, 5, 7]]
    with pytest.raises(RuntimeError, match="over sized"):
        HyperCommGrid([4, 4], ["tp", "dp"])


def _grid_groups_and_stage_predicates():
    from tpfuse.megatron_compat.hyper_comm_grid import HyperCommGrid
    from tpfuse.megatron_compat.pipeline_parallel.p2p_communication import P2PCommunicator
    from tpfuse.megatron_compat.pipeline_parallel.utils import is_pp_first_stage, \
        is_pp_last_stage
    from tpfuse.megatron_compat.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid([1, 2], ["tp", "pp"])
    pp_group = grid.create_pg("pp")
    assert grid.get_pg("pp") is pp_group and _ranks(pp_group) == [0, 1]
    with pytest.raises(KeyError, match="already been created"):
        grid.create_pg("pp")
    rank = dist.get_rank()
    assert (is_pp_first_stage(pp_group), is_pp_last_stage(pp_group)) == (rank == 0, rank == 1)
    p2p = P2PCommunicator(pp_group, config=None)
    assert (p2p.next_rank, p2p.prev_rank) == (1 - rank, 1 - rank)
    collection = ProcessGroupCollection(pp=pp_group)
    assert collection.pp is pp_group and collection.tp is None
    return 1


def test_grid_groups_and_pipeline_stage_predicates(run_distributed):
    assert run_distributed(2, _grid_groups_and_stage_predicates) == [1] * 2
