"""Validators shared by every layer above: the field checks and parsers that TransformerConfig's
validation, the pipeline's p2p settings and the executor are written with. Each raises ValueError
naming the field and its value; they read plain values or attributes of any object, nothing else
(the lowest layer: no tpfuse import)."""
from __future__ import annotations


def require_positive(config, *names):
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def require_positive_or_none(config, *names):
    require_positive(config, *(n for n in names if getattr(config, n) is not None))


def check_non_negative_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")


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
