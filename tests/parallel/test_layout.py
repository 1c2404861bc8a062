"""RankLayout: pure rank arithmetic, checked against hand-derived Megatron-core 0.16 groups.

Hand derivations use rank = Σ coord_t · stride_t with the order's tokens fastest first, e.g. for
the default order "tp-cp-ep-dp-pp" at world 8, tp 2, pp 2: strides tp 1, dp 2, pp 4.
"""
import itertools
import json

import pytest

from tpfuse.parallel.layout import GROUP_NAMES, RankLayout

DECODER_DIMS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}
EXPERT_DIMS = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
# group name -> (dims spanned by the group, all dims of that decomposition)
SPANS = {
    "tp": (("tp",), DECODER_DIMS), "pp": (("pp",), DECODER_DIMS), "dp": (("dp",), DECODER_DIMS),
    "cp": (("cp",), DECODER_DIMS), "dp-cp": (("dp", "cp"), DECODER_DIMS),
    "tp-pp": (("tp", "pp"), DECODER_DIMS), "tp-dp": (("tp", "dp"), DECODER_DIMS),
    "tp-cp": (("tp", "cp"), DECODER_DIMS), "tp-dp-cp": (("tp", "dp", "cp"), DECODER_DIMS),
    "ep": (("ep",), EXPERT_DIMS), "etp": (("etp",), EXPERT_DIMS),
    "etp-ep": (("etp", "ep"), EXPERT_DIMS), "etp-ep-pp": (("etp", "ep", "pp"), EXPERT_DIMS),
    "edp": (("edp",), EXPERT_DIMS),
}

CONFIGS = [
    dict(world_size=8, tp=2, pp=2),
    dict(world_size=8, tp=2, pp=2, cp=2),
    dict(world_size=8, tp=2, etp=1, ep=2),
    dict(world_size=8, tp=2, ep=2, pp=2),
    dict(world_size=8, tp=2, pp=2, order="tp-pp-dp"),
    dict(world_size=8, tp=2, cp=2, order="tp-dp-cp-pp"),
    dict(world_size=16, tp=2, cp=2, ep=2, etp=1, pp=2),
    dict(world_size=24, tp=2, pp=4, order="tp-dp-pp"),
    dict(world_size=1),
]


# ----------------------------------------------------------------------------- hand-checked cases
def test_seed_example_world8_tp2_pp2():
    layout = RankLayout(8, tp=2, pp=2)
    assert (layout.tp, layout.pp, layout.dp, layout.cp) == (2, 2, 2, 1)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups("tp-dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("dp-cp") == layout.groups("dp")
    assert layout.groups("cp") == [[r] for r in range(8)]
    assert layout.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("position-embedding") == [[0], [1], [2], [3]]
    # the DESIGN.md table: R0 = tp0 pp0 dp0, R3 = tp1 pp0 dp1, R6 = tp0 pp1 dp1
    for rank, (tp, pp, dp) in {0: (0, 0, 0), 3: (1, 0, 1), 6: (0, 1, 1)}.items():
        coords = layout.coords(rank)
        assert (coords["tp"], coords["pp"], coords["dp"]) == (tp, pp, dp)


def test_megatron_docstring_example_16_ranks_tp2_pp4():
    layout = RankLayout(16, tp=2, pp=4)
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                   [12, 14], [13, 15]]
    assert layout.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.groups("embedding") == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_context_parallel_world8_tp2_pp2_cp2():
    # strides tp 1, cp 2, dp 4 (size 1), pp 4: DP groups are single ranks, DP+CP = CP
    layout = RankLayout(8, tp=2, pp=2, cp=2)
    assert layout.dp == 1
    assert layout.groups("dp") == [[r] for r in range(8)]
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp-cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("tp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("tp-dp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("tp-dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # expert side: etp 2, ep 1, edp = 8/(2·1·2) = 2 cuts across decoder CP
    assert layout.edp == 2
    assert layout.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.coords(5) == {"rank": 5, "tp": 1, "cp": 0, "dp": 0, "pp": 1,
                                "ep": 0, "etp": 1, "edp": 0}


def test_expert_tp2_etp1_ep2_groups_equal_tp_groups():
    # expert strides: etp 1 (size 1), ep 1 (size 2), edp 2 (size 4)
    layout = RankLayout(8, tp=2, etp=1, ep=2)
    assert (layout.dp, layout.etp, layout.edp) == (4, 1, 4)
    assert layout.groups("ep") == layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("etp") == [[r] for r in range(8)]
    assert layout.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("etp-ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("etp-ep-pp") == layout.groups("etp-ep")
    assert layout.coords(5)["ep"] == 1 and layout.coords(5)["edp"] == 2


def test_expert_etp2_ep2_second_decomposition():
    # world 8, tp = etp = 2, ep 2, pp 2: expert strides etp 1, ep 2, edp 4 (size 1), pp 4
    layout = RankLayout(8, tp=2, ep=2, pp=2)
    assert (layout.dp, layout.edp) == (2, 1)
    assert layout.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("edp") == [[r] for r in range(8)]
    assert layout.groups("etp-ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("etp-ep-pp") == [list(range(8))]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # decoder DP = expert EP here


def test_expert_ep4_world16():
    # world 16, tp 2, etp 1, ep 4, pp 2: edp = 16/(1·4·2) = 2; expert strides ep 1, edp 4, pp 8
    layout = RankLayout(16, tp=2, etp=1, ep=4, pp=2)
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13],
                                    [10, 14], [11, 15]]
    assert layout.groups("pp") == [[r, r + 8] for r in range(8)]


def test_order_tp_pp_dp():
    # strides tp 1, pp 2, dp 4
    layout = RankLayout(8, tp=2, pp=2, order="tp-pp-dp")
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp-pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("tp-dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups("embedding") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("edp") == layout.groups("dp")  # etp = tp, ep 1: edp = dp allowed
    assert layout.coords(6) == {"rank": 6, "tp": 0, "cp": 0, "dp": 1, "pp": 1,
                                "ep": 0, "etp": 0, "edp": 1}


def test_order_megatron_docstring_tp_dp_pp_24_ranks():
    # Megatron's generate_masked_orthogonal_rank_groups docstring: sizes [tp, dp, pp] = [2, 3, 4]
    layout = RankLayout(24, tp=2, pp=4, order="tp-dp-pp")
    groups = layout.groups("dp")
    assert len(groups) == 8
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]


def test_group_follows_layout_order_not_name_spelling():
    # order tp-dp-cp-pp, world 8, tp 2, cp 2: strides tp 1, dp 2, cp 4
    layout = RankLayout(8, tp=2, cp=2, order="tp-dp-cp-pp")
    assert layout.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_missing_size1_dimension_is_appended_and_order_is_case_insensitive():
    assert RankLayout(8, tp=2, order="TP-DP").groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_world_size_one():
    layout = RankLayout(1)
    for name in GROUP_NAMES:
        assert layout.groups(name) == [[0]]


# ----------------------------------------------------------------------------- properties
def _members(layout, name):
    spanned, dims = SPANS[name]
    others = [d for d in dims.values() if d not in spanned]
    return spanned, others


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_every_rank_in_exactly_one_group_per_kind(config):
    layout = RankLayout(**config)
    sizes = layout.sizes
    for name in SPANS:
        groups = layout.groups(name)
        spanned, _ = SPANS[name]
        expected_size = 1
        for dim in spanned:
            expected_size *= sizes[dim]
        assert sorted(itertools.chain(*groups)) == list(range(layout.world_size)), name
        assert all(len(g) == expected_size for g in groups), name
        assert all(g == sorted(g) for g in groups), name


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_groups_agree_with_coordinates(config):
    """A group = the ranks whose other coordinates agree (coords() is computed separately)."""
    layout = RankLayout(**config)
    coords = [layout.coords(r) for r in range(layout.world_size)]
    for name in SPANS:
        _, others = _members(layout, name)
        for group in layout.groups(name):
            key = [coords[group[0]][d] for d in others]
            same = [r for r in range(layout.world_size) if [coords[r][d] for d in others] == key]
            assert group == same, (name, group)
    for rank in range(layout.world_size):
        for dim in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            assert layout.rank_in(dim, rank) == coords[rank][dim], (dim, rank)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_groups_of_different_dimensions_are_orthogonal(config):
    layout = RankLayout(**config)
    for dims in (("tp", "cp", "dp", "pp"), ("etp", "ep", "edp", "pp")):
        for a, b in itertools.combinations(dims, 2):
            for ga in layout.groups(a):
                for gb in layout.groups(b):
                    assert len(set(ga) & set(gb)) <= 1, (a, b, ga, gb)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_embedding_groups_are_first_and_last_pipeline_stage(config):
    layout = RankLayout(**config)
    for pipe, emb, pos in zip(layout.groups("pp"), layout.groups("embedding"),
                              layout.groups("position-embedding")):
        assert emb == ([pipe[0], pipe[-1]] if len(pipe) > 1 else [pipe[0]])
        assert pos == [pipe[0]]


def test_to_dict_is_json_and_complete():
    layout = RankLayout(8, tp=2, pp=2)
    data = json.loads(json.dumps(layout.to_dict()))
    assert data["world_size"] == 8 and data["order"] == "tp-cp-ep-dp-pp"
    assert data["sizes"] == {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "ep": 1, "etp": 2, "edp": 2}
    assert data["ranks"][3] == layout.coords(3)
    assert set(data["groups"]) == set(GROUP_NAMES)
    assert data["groups"]["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=8, tp=3), ["world_size=8", "tp*pp*cp=3"]),
    (dict(world_size=8, tp=2, pp=2, cp=4), ["world_size=8", "tp*pp*cp=16"]),
    (dict(world_size=8, ep=3), ["world_size=8", "etp*ep*pp=3"]),
    (dict(world_size=8, tp=2, etp=4, ep=4), ["etp*ep*pp=16"]),
    (dict(world_size=8, tp=0), ["tp", "0"]),
    (dict(world_size=8, pp=-1), ["pp", "-1"]),
    (dict(world_size=8, etp=0), ["etp", "0"]),
    (dict(world_size=0), ["world_size", "0"]),
    (dict(world_size=8, tp=2.0), ["tp", "2.0"]),
    (dict(world_size=8, order="tp-xx-dp-pp"), ["'xx'", "unknown"]),
    (dict(world_size=8, order="tp-dp-tp-pp"), ["repeats", "'tp'"]),
    (dict(world_size=8, tp=2, pp=2, order="tp-dp"), ["lacks 'pp'", "pp=2"]),
    (dict(world_size=8, tp=2, etp=1, ep=2, order="tp-dp-pp"), ["lacks 'ep'", "ep=2"]),
    (dict(world_size=8, tp=2, pp=2, etp=1, order="tp-pp-dp"), ["'pp'", "edp=4", "dp=2"]),
    (dict(world_size=8, tp=2, pp=2, etp=1, ep=2, order="tp-pp-ep-dp"), ["pipeline groups"]),
])
def test_invalid_settings_raise_value_error_naming_them(kwargs, words):
    with pytest.raises(ValueError) as info:
        RankLayout(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_unknown_group_name_and_bad_rank():
    layout = RankLayout(8, tp=2)
    with pytest.raises(ValueError, match="unknown group name 'xp'"):
        layout.groups("xp")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\), got 8"):
        layout.coords(8)
