"""Validators shared by every layer above: the field checks and parsers that TransformerConfig's
validation, the pipeline's p2p settings and the executor are written with. Each raises ValueError
naming the field and its value; they read plain values or attributes of any object, nothing else
(the lowest layer: no tpfuse import).

A bool is an int in Python (``isinstance(True, int)``); a flag is never a count, so ``is_int`` and
``is_real`` refuse it and every integer check here is written with them."""
from __future__ import annotations


def is_int(value) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """True for an int or a float that is not a bool (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_int(name, value):
    """``value`` if it is an int >= 1, else ValueError '{name}={value!r} must be a positive
    integer'."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def require_positive(config, *names):
    for name in names:
        check_positive_int(name, getattr(config, name))


def require_positive_or_none(config, *names):
    require_positive(config, *(n for n in names if getattr(config, n) is not None))


def check_non_negative_int(name, value):
    if not is_int(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")


def check_int_at_least(name, value, low: int):
    """``value`` if it is an int >= ``low``, else ValueError '{name} must be an integer >= {low},
    got {value!r}'."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_int_at_least_or_none(name, value, low: int):
    """``check_int_at_least`` that also lets None through (its message says so)."""
    if value is not None and (not is_int(value) or value < low):
        raise ValueError(f"{name} must be an integer >= {low} or None, got {value!r}")
    return value


def check_int_in_range(name, value, low: int, high: int):
    """``value`` if it is an int with low <= value < high, else ValueError '{name} must be in
    [{low}, {high}), got {value!r}'."""
    if not is_int(value) or not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
    return value


def require_non_negative_or_none(config, *names):
    for name in names:
        if getattr(config, name) is not None:
            check_non_negative_int(name, getattr(config, name))


def require_choice(config, name, choices):
    if getattr(config, name) not in choices:
        raise ValueError(f"{name}={getattr(config, name)!r} must be one of {list(choices)}")


def parse_int_pair(name, text):
    parts = [p.strip() for p in text.strip("()[] ").split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) not in (1, 2):
        raise ValueError(f"{name}={text!r} must be 'L,R' (two ints) or 'L'")
    return values if len(values) == 2 else (values[0], 0)
