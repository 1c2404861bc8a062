"""MicrobatchCalculator and bubble_fraction against hand-computed values."""
from fractions import Fraction

import pytest

from tpfuse.parallel import MicrobatchCalculator, bubble_fraction


def _state(calc):
    return (calc.current_global_batch_size, calc.current_running_global_batch_size,
            calc.num_microbatches)


# ----------------------------------------------------------------------------- constant
@pytest.mark.parametrize("global_batch, micro, dp, m", [
    (1536, 1, 12, 128),   # DESIGN.md example
    (16, 2, 2, 4),
    (8, 8, 1, 1),
    (1, 1, 1, 1),
])
def test_constant_microbatches(global_batch, micro, dp, m):
    calc = MicrobatchCalculator(global_batch, micro, dp)
    assert _state(calc) == (global_batch, global_batch, m)
    calc.update(10_000)
    assert calc.get() == m and calc.get_current_global_batch_size() == global_batch


def test_constant_indivisible_is_rejected_or_rounded_down():
    with pytest.raises(ValueError, match=r"global batch size 10 is not divisible by "
                                         r"micro_batch_size=2 x data_parallel_size=2 = 4"):
        MicrobatchCalculator(10, 2, 2)
    calc = MicrobatchCalculator(10, 2, 2, decrease_batch_size_if_needed=True)
    assert _state(calc) == (10, 8, 2)  # 10 rounded down to a multiple of 2·2
    with pytest.raises(ValueError, match="zero micro-batches"):
        MicrobatchCalculator(3, 2, 2, decrease_batch_size_if_needed=True)


# ----------------------------------------------------------------------------- ramp-up
def test_rampup_steps_by_hand():
    # B 32 from 8 in steps of 8 over 300 samples: n = 3 increments, one per 100 samples; b·d = 4
    calc = MicrobatchCalculator(32, 2, 2, rampup_batch_size=[8, 8, 300])
    expected = {0: (8, 2), 99: (8, 2), 100: (16, 4), 199: (16, 4), 200: (24, 6), 299: (24, 6),
                300: (32, 8), 301: (32, 8), 10_000: (32, 8)}
    for consumed, (batch, m) in expected.items():
        calc.update(consumed, consistency_check=True)
        assert (calc.current_global_batch_size, calc.num_microbatches) == (batch, m), consumed
        assert calc.current_running_global_batch_size == batch


def test_rampup_uneven_increment_length_uses_megatron_float_boundaries():
    # 1000 samples over n = 3 increments: boundaries at 333.33.. and 666.66..; b·d = 1
    calc = MicrobatchCalculator(4, 1, 1, rampup_batch_size=[1, 1, 1000])
    for consumed, batch in {333: 1, 334: 2, 666: 2, 667: 3, 1000: 4, 1001: 4}.items():
        calc.update(consumed)
        assert calc.num_microbatches == batch, consumed


def test_rampup_with_decrease_rounds_each_step_down():
    # B 32 from 6 in steps of 2 over 13 samples (one increment per sample); b·d = 4
    calc = MicrobatchCalculator(32, 2, 2, rampup_batch_size=[6, 2, 13],
                                decrease_batch_size_if_needed=True)
    expected = {0: (6, 4, 1), 1: (8, 8, 2), 2: (10, 8, 2), 3: (12, 12, 3), 12: (30, 28, 7),
                13: (32, 32, 8), 14: (32, 32, 8)}
    for consumed, state in expected.items():
        calc.update(consumed)
        assert _state(calc) == state, consumed


def test_rampup_start_equal_to_global_is_constant():
    calc = MicrobatchCalculator(16, 2, 2, rampup_batch_size=[16, 4, 100])
    for consumed in (0, 50, 200):
        calc.update(consumed)
        assert _state(calc) == (16, 16, 4)


def test_rampup_accepts_megatrons_cli_strings_and_integral_numbers():
    # Megatron's --rampup-batch-size arrives as strings and is int()-ed; fractions are refused
    for rampup in (["8", "8", "48"], [8.0, 8, 48], ["8", 8, "48"]):
        calc = MicrobatchCalculator(32, 2, 2, rampup_batch_size=rampup)
        assert calc.rampup_batch_size == [8, 8, 48]
        calc.update(16)
        assert calc.current_global_batch_size == 16
    with pytest.raises(ValueError, match="rampup_batch_size"):
        MicrobatchCalculator(32, 2, 2, rampup_batch_size=["8", "8.5", "48"])


def test_reachable_batch_sizes():
    calc = MicrobatchCalculator(32, 1, 2, rampup_batch_size=[8, 8, 300])
    assert calc.reachable_global_batch_sizes() == [8, 16, 24, 32]


# ----------------------------------------------------------------------------- invalid input
@pytest.mark.parametrize("args, kwargs, words", [
    ((0, 1, 1), {}, ["global_batch_size", "0"]),
    ((8, 0, 1), {}, ["micro_batch_size", "0"]),
    ((8, 1, -2), {}, ["data_parallel_size", "-2"]),
    ((8, 1.5, 1), {}, ["micro_batch_size", "1.5"]),
    # Megatron silently floors an indivisible start on its first update; tpfuse refuses
    ((32, 2, 2), dict(rampup_batch_size=[6, 2, 100]), ["global batch size 6", "= 4"]),
    ((32, 2, 2), dict(rampup_batch_size=[8, 5, 100]), ["32 - 8 = 24", "increment 5"]),
    ((32, 2, 2), dict(rampup_batch_size=[8, 8, 100, 1]), ["[start, increment, samples]"]),
    ((32, 2, 2), dict(rampup_batch_size=[40, 8, 100]), ["start=40", "global_batch_size=32"]),
    ((32, 2, 2), dict(rampup_batch_size=[8, 0, 100]), ["increment", "0"]),
    ((32, 2, 2), dict(rampup_batch_size=[8, 8, 0]), ["samples=0"]),
    ((32, 2, 2), dict(rampup_batch_size=[8, 8, -1]), ["samples", "-1"]),
    ((32, 4, 2), dict(rampup_batch_size=[8, 4, 100]), ["global batch size 12", "= 8", "ramp"]),
])
def test_invalid_sizes_raise_value_error_at_construction(args, kwargs, words):
    with pytest.raises(ValueError) as info:
        MicrobatchCalculator(*args, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_negative_consumed_samples():
    with pytest.raises(ValueError, match="consumed_samples"):
        MicrobatchCalculator(8, 1, 1).update(-1)


# ----------------------------------------------------------------------------- bubble
@pytest.mark.parametrize("pp, m, vpp, expected", [
    (1, 8, 1, Fraction(0)),          # no pipeline, no bubble
    (2, 1, 1, Fraction(1, 2)),       # one micro-batch: each stage idles half the time
    (4, 8, 1, Fraction(3, 11)),      # (p-1)/(m+p-1)
    (4, 8, 2, Fraction(3, 19)),      # (p-1)/(v·m+p-1)
    (8, 128, 1, Fraction(7, 135)),
    (8, 128, 4, Fraction(7, 519)),
])
def test_bubble_fraction_by_hand(pp, m, vpp, expected):
    assert bubble_fraction(pp, m, vpp) == pytest.approx(float(expected), rel=1e-15, abs=0)


@pytest.mark.parametrize("args, word", [((0, 4), "pp"), ((2, 0), "num_microbatches"),
                                        ((2, 4, 0), "vpp")])
def test_bubble_fraction_rejects_bad_sizes(args, word):
    with pytest.raises(ValueError, match=word):
        bubble_fraction(*args)
