"""The machinery of the trainer's typed settings: a dataclass field that carries its command-line
flag, a base class that validates a settings group from that metadata, and the argparse group
built from a settings class.

    @dataclass(frozen=True, kw_only=True)
    class EvaluationSettings(SettingsGroup):
        TITLE: ClassVar[str] = "evaluation"
        eval_iters: int = setting(100, "validation batches per evaluation", minimum=0)

A field's metadata holds what argparse needs (``help``; and where the field name with dashes and
the annotation are not enough: ``flag``, ``nargs``, ``choices``, ``metavar``) and what validation
needs (``required``, ``minimum``, ``bounds``). ``add_group_arguments(parser, cls)`` turns a group's
fields into one argument group whose defaults *are* the fields' defaults, so the parser and the
dataclasses cannot disagree. The flag of a field is ``--`` + its name with dashes (Megatron's
names: ``micro_batch_size`` ↔ ``--micro-batch-size``) unless ``flag`` says otherwise (the
negative booleans: ``manual_gc_eval`` ↔ ``--no-manual-gc-eval``).

Validation at construction (``SettingsGroup.__post_init__``), each error a ValueError naming the
flag: required values given; the value has the annotated type (an int for a float is accepted);
floats finite (``allow_inf``: infinity is a value, NaN still refused); ``minimum`` (``--x must be >= n``); ``bounds`` ``(low, low inclusive, high, high
inclusive)`` (``--x must be in [0.0, 1.0)``); ``choices``; then the group's own ``check()``.
Unknown fields fail too: a misspelled keyword is a TypeError from the dataclass, a misspelled
attribute assignment an error from the frozen instance.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
from dataclasses import field, fields

_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def setting(default, help: str, *, flag: str | None = None, required: bool = False,
            minimum: int | None = None, bounds: tuple | None = None, allow_inf: bool = False,
            nargs=None, choices=None, metavar=None):
    """A settings field: its default, one-line doc, flag and checks (see the module docstring)."""
    metadata = {"help": help, "flag": flag, "required": required, "minimum": minimum,
                "bounds": bounds, "allow_inf": allow_inf, "nargs": nargs,
                "choices": None if choices is None else tuple(choices), "metavar": metavar}
    if isinstance(default, list):               # a mutable default: a fresh copy per instance
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a settings field (``--micro-batch-size``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def annotation_of(f: dataclasses.Field) -> tuple[str, bool]:
    """``("int", optional)`` from ``int | None``; ``("list[int]", False)`` from ``list[int]``."""
    text = str(f.type)
    return text.replace(" | None", ""), text.endswith(" | None")


# ---------------------------------------------------------------------------- validation
def _is_a(item, expected: type) -> bool:
    """``isinstance`` where a bool is no number and an int is a float."""
    if isinstance(item, bool):
        return expected is bool
    return isinstance(item, expected) or (expected is float and isinstance(item, int))


def _type_error(f, value) -> str | None:
    kind, optional = annotation_of(f)
    if value is None:
        return None if optional else f"{flag_of(f)} must be given (it has no default)"
    element = kind[5:-1] if kind.startswith("list[") else None
    values = value if element else [value]
    if element and not isinstance(value, (list, tuple)):
        return f"{flag_of(f)} must be a list of {element}, got {value!r}"
    expected = _SCALARS.get(element or kind)
    if expected is None:
        return None
    for item in values:
        if not _is_a(item, expected):
            return f"{flag_of(f)} must be {element or kind}, got {item!r}"
    return None


def _bounds_text(low, low_ok, high, high_ok) -> str:
    return (f"{'[' if low_ok else '('}{low}, {high if high is not None else '∞'}"
            f"{']' if high_ok else ')'}")


def _range_error(f, value) -> str | None:
    flag, metadata = flag_of(f), f.metadata
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, float) and (math.isnan(item) or (
                math.isinf(item) and not metadata.get("allow_inf"))):
            return f"{flag} must be a finite number, got {item}"
    minimum = metadata.get("minimum")
    if minimum is not None and any(item < minimum for item in items):
        return f"{flag} must be >= {minimum}, got {value}"
    if metadata.get("bounds") is not None:
        low, low_ok, high, high_ok = metadata["bounds"]
        if value < low or (value == low and not low_ok) or (
                high is not None and (value > high or (value == high and not high_ok))):
            return f"{flag} must be in {_bounds_text(low, low_ok, high, high_ok)}, got {value}"
    choices = metadata.get("choices")
    if choices is not None and any(item not in choices for item in items):
        return f"{flag} must be one of {', '.join(map(str, choices))}, got {value!r}"
    return None


def field_error(f: dataclasses.Field, value) -> str | None:
    """What is wrong with ``value`` for field ``f`` (None: nothing)."""
    if value is None and f.metadata.get("required"):
        return f"{flag_of(f)} is required (Megatron has no default for it)"
    return _type_error(f, value) or (None if value is None else _range_error(f, value))


class SettingsGroup:
    """Base of the settings dataclasses: every field checked from its metadata at construction,
    then the group's own ``check()`` (cross-field rules, ValueErrors naming the flags)."""

    TITLE = "settings"          # the argparse group's title (a ClassVar in each group)

    def __post_init__(self):
        for f in fields(self):
            error = field_error(f, getattr(self, f.name))
            if error:
                raise ValueError(error)
        self.check()

    def check(self) -> None:
        """The group's rules across its fields (none by default)."""


def unknown_setting_error(name: str, known) -> str:
    """``unknown setting 'lrr' (--lrr); did you mean --lr?``"""
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else ""
    return f"unknown setting {name!r} (--{name.replace('_', '-')}){hint}"


# ---------------------------------------------------------------------------- argparse
_ARGPARSE_TYPES = {"int": int, "float": float}


def _argument_kwargs(f: dataclasses.Field) -> dict:
    kind, _ = annotation_of(f)
    default = default_of(f)
    kwargs = {"dest": f.name, "default": default, "help": f.metadata["help"]}
    if kind == "bool":
        kwargs["action"] = "store_false" if default else "store_true"
        return kwargs
    element = kind[5:-1] if kind.startswith("list[") else kind
    if element in _ARGPARSE_TYPES:
        kwargs["type"] = _ARGPARSE_TYPES[element]
    for name in ("nargs", "metavar"):
        if f.metadata.get(name) is not None:
            kwargs[name] = f.metadata[name]
    if f.metadata.get("choices") is not None:
        kwargs["choices"] = list(f.metadata["choices"])
    return kwargs


def add_group_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One argument group titled ``cls.TITLE`` with a flag per field of the settings class."""
    group = parser.add_argument_group(cls.TITLE)
    for f in fields(cls):
        group.add_argument(flag_of(f), **_argument_kwargs(f))
