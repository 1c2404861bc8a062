"""ParallelState and the Megatron-style facade, in a world of 8 gloo processes.

Every getter is compared with the pure RankLayout (itself hand-checked in test_layout.py), and
every group is exercised with a real all-reduce so a wrong group cannot hide behind right numbers.
"""
import pytest
import torch
import torch.distributed as dist

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
    assert "vpp_size=2" in messages[2] and "pp=1" in messages[2]
    assert "vpp_size" in messages[3] and "0" in messages[3]


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
