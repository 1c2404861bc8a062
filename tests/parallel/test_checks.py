"""The shared validators of tpfuse.parallel.checks: a bool is never an int, each bound is
inclusive or exclusive as its name says, and every error names the setting and its value."""
import pytest

from tpfuse.parallel.checks import (check_int_at_least, check_int_at_least_or_none,
                                    check_int_in_range, check_non_negative_int,
                                    check_positive_int, is_int, is_real)


@pytest.mark.parametrize("value, expected", [(0, True), (-3, True), (2**70, True),
                                             (True, False), (False, False), (1.0, False),
                                             ("1", False), (None, False)])
def test_is_int_refuses_bools_floats_and_strings(value, expected):
    assert is_int(value) is expected


@pytest.mark.parametrize("value, expected", [(0, True), (-2.5, True), (float("inf"), True),
                                             (True, False), ("1.5", False), (None, False),
                                             (1j, False)])
def test_is_real_takes_ints_and_floats_but_no_bool(value, expected):
    assert is_real(value) is expected


def test_check_positive_int_returns_the_value_and_names_a_bad_one():
    assert check_positive_int("hidden_size", 64) == 64
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError) as error:
            check_positive_int("hidden_size", bad)
        assert str(error.value) == f"hidden_size={bad!r} must be a positive integer"


def test_check_non_negative_int_takes_zero_and_refuses_a_bool():
    check_non_negative_int("p2p_recv_ahead", 0)
    with pytest.raises(ValueError, match=r"^p2p_recv_ahead=False must be an integer >= 0$"):
        check_non_negative_int("p2p_recv_ahead", False)
    with pytest.raises(ValueError, match=r"^p2p_recv_ahead=-1 must be an integer >= 0$"):
        check_non_negative_int("p2p_recv_ahead", -1)


def test_check_int_at_least_bound_is_inclusive():
    assert check_int_at_least("consumed_samples", 0, 0) == 0
    assert check_int_at_least("tp", 3, 1) == 3
    with pytest.raises(ValueError) as error:
        check_int_at_least("tp", 0, 1)
    assert str(error.value) == "tp must be an integer >= 1, got 0"
    with pytest.raises(ValueError, match=r"^tp must be an integer >= 1, got True$"):
        check_int_at_least("tp", True, 1)


def test_check_int_at_least_or_none_lets_none_through_and_says_so():
    assert check_int_at_least_or_none("vpp", None, 1) is None
    assert check_int_at_least_or_none("vpp", 2, 1) == 2
    for bad in (0, False, 1.5):
        with pytest.raises(ValueError) as error:
            check_int_at_least_or_none("vpp", bad, 1)
        assert str(error.value) == f"vpp must be an integer >= 1 or None, got {bad!r}"


def test_check_int_in_range_is_half_open():
    assert check_int_in_range("rank", 0, 0, 4) == 0
    assert check_int_in_range("rank", 3, 0, 4) == 3
    for bad in (-1, 4, True, 1.0, None):
        with pytest.raises(ValueError) as error:
            check_int_in_range("rank", bad, 0, 4)
        assert str(error.value) == f"rank must be in [0, 4), got {bad!r}"
