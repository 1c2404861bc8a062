"""Pure tests of tpfuse.pipeline.schedules and .simulate (no processes, no torch)."""
import itertools

import pytest

from tpfuse.pipeline.schedules import (
    Action, bubble_fraction_formula, build_no_pipelining_schedule, build_schedule,
    format_actions, forward_only, interleaved_table, warmup_forwards)
from tpfuse.pipeline.simulate import (
    ScheduleError, link_message_order, simulate, validate_actions)


def _parse(text):
    """'F0.1 B2.0' -> [Action('F', 0, 1), Action('B', 2, 0)]."""
    return [Action(tok[0], int(tok[1:].split(".")[0]), int(tok.split(".")[1]))
            for tok in text.split()]


def _valid_configs():
    """Every (p, m, v, g) with p ≤ 4, m ≤ 10, v ≤ 3 that Megatron accepts."""
    for p, v, m in itertools.product(range(1, 5), range(1, 4), range(1, 11)):
        for g in ([None] if v == 1 else range(p, m + 1)):
            if v > 1 and m % g and m % g < p:
                continue
            yield p, m, v, g


# --- hand-checked tables -------------------------------------------------------------------

def test_interleaved_p2_v2_m4_matches_megatron_notes_example():
    # the example observed from megatron-core 0.16.1 (shared/notes/megatron-semantics.md)
    expected_rank0 = "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    schedule = build_schedule(2, 4, vpp_size=2)
    assert format_actions(schedule[0]) == expected_rank0
    # rank 1 by hand: warm-up 2·0 + 1·2 = 2 forwards, then F/B pairs over the same tables
    assert schedule[1] == _parse(
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0")


def test_1f1b_p4_m6_by_hand():
    schedule = build_schedule(4, 6)
    assert format_actions(schedule[0]) == (
        "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0")
    assert format_actions(schedule[3]) == (
        "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0")


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (3, 1), (8, 3), (1, 5)])
def test_1f1b_warmup_counts(p, m):
    for rank, actions in enumerate(build_schedule(p, m)):
        expected = min(p - rank - 1, m)
        leading_forwards = next((i for i, a in enumerate(actions) if a.kind == "B"), len(actions))
        # warm-up forwards, then one more forward before the first backward (if any remain)
        assert leading_forwards == expected + (1 if expected < m else 0)
        assert warmup_forwards(p, rank, m) == expected


def test_interleaved_table_with_remainder_block():
    # m = 5, g = 3 (remainder 2 ≥ p = 2): blocks [0,1,2] and [3,4]
    assert interleaved_table(5, 2, 3) == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]


def test_interleaved_warmup_is_capped_and_becomes_all_forward_first():
    # p4 v2 m4: rank 0 warm-up 2·3 + 1·4 = 10 > m·v = 8 -> all forwards, then all backwards
    actions = build_schedule(4, 4, vpp_size=2)[0]
    assert warmup_forwards(4, 0, 4, 2) == 8
    assert [a.kind for a in actions] == ["F"] * 8 + ["B"] * 8
    # backward order: the forward table with chunks reversed
    assert [(a.microbatch, a.chunk) for a in actions[8:]] == [
        (0, 1), (1, 1), (2, 1), (3, 1), (0, 0), (1, 0), (2, 0), (3, 0)]


def test_interleaved_group_size_changes_the_order():
    # p2 v2 m4 g4: warm-up rank 1 = 0 + 4; table is one block of all four micro-batches
    actions = build_schedule(2, 4, vpp_size=2, microbatch_group_size=4)[1]
    assert format_actions(actions) == (
        "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 B0.0 B1.0 B2.0 B3.0")


def test_no_pipelining_schedule():
    assert format_actions(build_no_pipelining_schedule(3)) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"


# --- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("p, m, v, g, words", [
    (4, 8, 2, 3, ["microbatch_group_size=3", "pp_size=4"]),          # g < p
    (2, 4, 2, 5, ["microbatch_group_size=5", "num_microbatches=4"]),  # g > m
    (2, 1, 2, None, ["microbatch_group_size=2", "num_microbatches=1"]),  # m < p
    (4, 9, 2, 4, ["num_microbatches=9", "= 1", "pp_size=4"]),        # 9 mod 4 = 1 < 4
    (3, 7, 3, 5, ["num_microbatches=7", "= 2", "pp_size=3"]),        # 7 mod 5 = 2 < 3
    (0, 4, 1, None, ["pp_size", "0"]),
    (2, 0, 1, None, ["num_microbatches", "0"]),
    (2, 4, 0, None, ["vpp_size", "0"]),
])
def test_invalid_settings_raise_value_error_naming_them(p, m, v, g, words):
    with pytest.raises(ValueError) as info:
        build_schedule(p, m, vpp_size=v, microbatch_group_size=g)
    for word in words:
        assert word in str(info.value)


def test_validate_actions_rejects_bad_lists():
    with pytest.raises(ScheduleError, match="B0.0 is missing"):
        validate_actions(_parse("F0.0 F1.0 B1.0"), 2, 1)
    with pytest.raises(ScheduleError, match="out of order"):
        validate_actions(_parse("B0.0 F0.0"), 1, 1)
    with pytest.raises(ScheduleError, match="twice"):
        validate_actions(_parse("F0.0 F0.0 B0.0"), 1, 1)


# --- every schedule is a valid, deadlock-free execution --------------------------------------

def test_every_valid_config_is_valid_deadlock_free_and_in_order():
    checked = 0
    for p, m, v, g in _valid_configs():
        schedule = build_schedule(p, m, v, g)
        assert len(schedule) == p
        for rank, actions in enumerate(schedule):
            validate_actions(actions, m, v, rank)  # each (mb, chunk): F once, then B once
            assert len(actions) == 2 * m * v
        result = simulate(schedule, m, v)
        assert not result.deadlocked, (p, m, v, g, result.blocked)
        # each virtual-stage channel (s -> s±1) is FIFO; whole physical links may interleave
        # channels differently at both ends when g > p (p2p.py posts in the sender's order)
        assert result.reordered_channels == [], (p, m, v, g)
        if p > 1 and (v == 1 or g == p):
            assert result.reordered_links == [], (p, m, v, g)
        fwd = simulate([forward_only(a) for a in schedule], m, v)
        assert not fwd.deadlocked
        checked += 1
    assert checked > 200


def test_simulation_detects_deadlock():
    # rank 0 waits for B0's gradient before it has sent F1; rank 1 wants F1 before B0... built
    # by swapping rank 1's order: it runs F1 before F0 while rank 0 runs B0 before F1.
    schedule = [_parse("F0.0 B0.0 F1.0 B1.0"), _parse("F1.0 B1.0 F0.0 B0.0")]
    result = simulate(schedule, 2, 1)
    assert result.deadlocked
    assert result.blocked == {0: Action("B", 0, 0), 1: Action("F", 1, 0)}


def test_simulation_detects_reordered_link():
    # rank 1 consumes micro-batch 1's activation before micro-batch 0's: FIFO p2p would swap them
    schedule = [_parse("F0.0 F1.0 B0.0 B1.0"), _parse("F1.0 F0.0 B0.0 B1.0")]
    result = simulate(schedule, 2, 1)
    assert not result.deadlocked
    assert result.reordered_links == [(0, 1)]
    assert result.reordered_channels == [(0, 1)]


def test_group_size_above_pp_reorders_a_physical_link_but_no_channel():
    # p2 v2 m4 g4: rank 1 sends act 3 (stage 1->2) before grad 0 (stage 3->2); rank 0 needs the
    # gradient first. A FIFO p2p that posts receives in the receiver's order would swap them.
    result = simulate(build_schedule(2, 4, 2, 4), 4, 2)
    assert (1, 0) in result.reordered_links
    assert result.reordered_channels == []


# --- bubble fraction -------------------------------------------------------------------------

@pytest.mark.parametrize("f, b", [(1, 1), (1, 2), (2, 1), (1, 3)])
def test_simulated_bubble_equals_formula(f, b):
    # With uniform per-action costs and zero p2p latency the formula is exact for every valid
    # config: each rank is busy m·v·(f+b); the makespan is that plus (p − 1) chunk-sized (f+b)
    # steps of fill and drain, because the first rank's first backward cannot start before the
    # activation has crossed all p·v stages and the gradient come back. (Non-zero latency or
    # uneven stage costs break exactness; only floating-point sums differ here, hence 1e-12.)
    for p, m, v, g in _valid_configs():
        result = simulate(build_schedule(p, m, v, g), m, v, forward_cost=f, backward_cost=b)
        assert result.bubble_fraction == pytest.approx(bubble_fraction_formula(p, m, v),
                                                       abs=1e-12), (p, m, v, g)


def test_bubble_hand_values():
    assert bubble_fraction_formula(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction_formula(4, 8, 2) == pytest.approx(3 / 19)
    result = simulate(build_schedule(4, 8), forward_cost=1, backward_cost=2)
    assert result.makespan == pytest.approx((8 + 4 - 1) * 3)


def test_latency_adds_bubble():
    m, p = 8, 4
    exact = simulate(build_schedule(p, m)).bubble_fraction
    slow = simulate(build_schedule(p, m), p2p_latency=0.5).bubble_fraction
    assert slow > exact


def test_link_message_order_agrees_with_both_program_orders():
    result = simulate(build_schedule(2, 4, vpp_size=2), 4, 2)
    order = link_message_order(result, 0, 1)
    sent_01 = [msg for msg in order if msg.src_stage % 2 == 0]
    sent_10 = [msg for msg in order if msg.src_stage % 2 == 1]
    assert sent_01 == result.send_order[(0, 1)]
    assert sent_10 == result.send_order[(1, 0)]
    # every message exactly once: 4 mbs × (3 activations + 3 gradients) across 4 stages
    assert len(order) == len(set(order)) == 4 * 6


# --- tpfuse-schedule -------------------------------------------------------------------------

def test_cli_json_matches_build_schedule_and_formula(capsys):
    import json

    from tpfuse.pipeline.cli import main

    assert main(["--pp", "2", "--vpp", "2", "--microbatches", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"] == [[str(a) for a in r] for r in build_schedule(2, 4, 2)]
    assert out["group_size"] == 2 and not out["deadlocked"]
    assert out["simulated_bubble_fraction"] == pytest.approx(1 / 9)   # (2-1)/(2·4+2-1)
    assert out["formula_bubble_fraction"] == pytest.approx(1 / 9)


def test_cli_table_and_png(tmp_path, capsys):
    from tpfuse.pipeline.cli import main

    png = tmp_path / "gantt.png"
    assert main(["--pp", "4", "--microbatches", "6", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: F0.0 F1.0 F2.0 F3.0 B0.0 F4.0" in out
    assert "formula (p-1)/(v*m+p-1) = 0.3333" in out   # 3 / (6 + 3)
    assert "simulated 0.3333" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, words", [
    (["--pp", "4", "--vpp", "2", "--microbatches", "9"], ["num_microbatches=9", "pp_size=4"]),
    (["--pp", "2", "--vpp", "2", "--microbatches", "4", "--group-size", "1"],
     ["microbatch_group_size=1"]),
    (["--pp", "0", "--microbatches", "4"], ["pp_size", "0"]),
    (["--pp", "2", "--microbatches", "x"], ["--microbatches", "'x'"]),
    (["--pp", "2", "--microbatches", "4", "--backward-cost", "0"], ["backward_cost", "0"]),
])
def test_cli_bad_input_exits_2_with_message(argv, words, capsys):
    from tpfuse.pipeline.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


# --- ZB-H1 (stretch) -----------------------------------------------------------------------

def test_zb_h1_p2_m3_by_hand():
    # F = I = W = 1. Rank 1 may defer one W, rank 0 none. Times: rank 0 F0 0-1, F1 1-2, waits
    # for grad 0 (rank 1's I0 ends at 3), I0 3-4, W0 4-5, F2 5-6, I1 6-7, W1 7-8, I2 8-9, W2
    # 9-10; rank 1 F0 1-2, I0 2-3, F1 3-4, I1 4-5, then two W's pending > 1: W0 5-6, F2 6-7,
    # I2 7-8, W1 8-9, W2 9-10. Makespan 10 = 3·3 + (2 − 1).
    from tpfuse.pipeline.zero_bubble import build_zb_h1_schedule

    schedule = build_zb_h1_schedule(2, 3)
    assert format_actions(schedule[0]) == "F0.0 F1.0 I0.0 W0.0 F2.0 I1.0 W1.0 I2.0 W2.0"
    assert format_actions(schedule[1]) == "F0.0 I0.0 F1.0 I1.0 W0.0 F2.0 I2.0 W1.0 W2.0"
    result = simulate(schedule, 3, 1, forward_cost=1, input_grad_cost=1, weight_grad_cost=1)
    assert result.makespan == 10


@pytest.mark.parametrize("costs", [(1, 1, 1), (2, 1, 1), (1, 2, 0.5), (1, 1.5, 0.5)])
def test_zb_h1_valid_same_memory_and_formula(costs):
    from tpfuse.pipeline.zero_bubble import build_zb_h1_schedule, zb_h1_bubble_formula

    f, i, w = costs
    for p in range(1, 6):
        for m in range(p, 11):   # the formula needs m ≥ p (and W ≤ min(F, I): a W fits a wait)
            schedule = build_zb_h1_schedule(p, m, f, i, w)
            one_f_one_b = build_schedule(p, m)
            for rank, actions in enumerate(schedule):
                validate_actions(actions, m, 1, rank)            # F < I < W for every mb
                # F and I keep 1F1B's order (I in B's place)
                assert [(a.kind, a.microbatch) for a in actions if a.kind != "W"] == [
                    ("I" if a.kind == "B" else "F", a.microbatch) for a in one_f_one_b[rank]]
                live = peak = 0
                for a in actions:
                    live += (a.kind == "F") - (a.kind == "W")
                    peak = max(peak, live)
                assert peak <= p                                  # 1F1B's peak (rank 0's)
            result = simulate(schedule, m, 1, forward_cost=f, input_grad_cost=i,
                              weight_grad_cost=w)
            assert not result.deadlocked
            assert result.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
            assert result.bubble_fraction == pytest.approx(zb_h1_bubble_formula(p, m, f, i, w))
            if p > 1:   # a third of 1F1B's bubble time at equal costs, less in general
                plain = simulate(one_f_one_b, m, 1, forward_cost=f, backward_cost=i + w)
                assert result.bubble_fraction < plain.bubble_fraction


def test_cli_zb_h1(capsys):
    from tpfuse.pipeline.cli import main

    assert main(["--pp", "4", "--microbatches", "8", "--zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "rank 3: F0.0 I0.0 F1.0 I1.0" in out
    assert "simulated 0.1111" in out and "= 0.1111" in out   # 3 / (24 + 3)
    with pytest.raises(SystemExit) as info:
        main(["--pp", "4", "--vpp", "2", "--microbatches", "8", "--zb-h1"])
    assert info.value.code == 2
    assert "--zb-h1" in capsys.readouterr().err
