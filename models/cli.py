"""TransformerConfig ↔ command-line flags, and ``tpfuse-config``.

Every field becomes a flag by underscore → dash (``num_layers`` ↔ ``--num-layers``). Where Megatron
spells the flag differently the field's metadata ``"flag"`` names it and it is the primary option
(``layernorm_epsilon`` ↔ ``--norm-epsilon``, also accepted as ``--layernorm-epsilon``). Booleans take
``--x`` / ``--no-x``; Megatron's extra spellings are kept: ``--swiglu`` (activation=swiglu),
``--disable-bias-linear`` (add_bias_linear=False).

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)            # the trainer adds its own flags to the same parser
    config = config_from_args(parser.parse_args(argv))

``config_to_dict(config)`` / ``config_from_dict(values, **overrides)``: the same as plain values
(what checkpoints store). ``tpfuse-config --list`` prints the fields by category with flag, type, default and doc;
``tpfuse-config --num-layers 8 ...`` validates a configuration and prints it (exit 2 on error).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from tpfuse.parallel.checks import parse_int_pair

from .config import (ACTIVATIONS, CATEGORIES, CP_COMM_TYPE_ALIASES, CP_COMM_TYPES, DERIVED, DTYPES,
                     NORMALIZATIONS, PIPELINE_SCHEDULES, POSITION_EMBEDDINGS, TransformerConfig,
                     config_fields)
from .mla_config import MLA_RECOMPUTE_MODULES, ROPE_TYPES
from .moe_config import (MOE_LOAD_BALANCING_TYPES, MOE_ROUTER_DTYPES, MOE_SCORE_FUNCTIONS,
                         MOE_TOKEN_DISPATCHER_TYPES, MOE_TOKEN_DROP_POLICIES, parse_moe_layer_freq)
from .recompute_config import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, RECOMPUTE_MODULES

CHOICES = {
    "normalization": NORMALIZATIONS, "activation": ACTIVATIONS,
    "position_embedding_type": POSITION_EMBEDDINGS,
    "recompute_granularity": RECOMPUTE_GRANULARITIES, "recompute_method": RECOMPUTE_METHODS,
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "recompute_modules": RECOMPUTE_MODULES + MLA_RECOMPUTE_MODULES, "rope_type": ROPE_TYPES,
    "cp_comm_type": CP_COMM_TYPES + tuple(CP_COMM_TYPE_ALIASES),
    "moe_router_score_function": MOE_SCORE_FUNCTIONS,
    "moe_router_load_balancing_type": MOE_LOAD_BALANCING_TYPES,
    "moe_token_drop_policy": MOE_TOKEN_DROP_POLICIES,
    "moe_token_dispatcher_type": MOE_TOKEN_DISPATCHER_TYPES, "moe_router_dtype": MOE_ROUTER_DTYPES,
}


def _dtype(text):
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {sorted(DTYPES)}")
    return DTYPES[text]


def _int_pair(text):
    """Megatron's tuple flags: ``--window-size 128,0``."""
    try:
        return parse_int_pair("value", text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _layer_freq(text):
    try:
        return parse_moe_layer_freq(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


TYPES = {"int": int, "float": float, "str": str, "bool": bool, "torch.dtype": _dtype,
         "tuple[int, int]": _int_pair, "int | list[int]": _layer_freq}


METAVARS = {"tuple[int, int]": "L,R", "int | list[int]": "INT|LIST"}


def field_type_name(f):
    """'int', 'float', 'str', 'bool' or 'torch.dtype' from the annotation ('int | None' → 'int')."""
    return str(f.type).replace(" | None", "")


def dashed(name):
    return "--" + name.replace("_", "-")


def option_strings(f):
    """The field's flags, the primary (Megatron's spelling where it differs) first."""
    primary = f.metadata.get("flag", dashed(f.name))
    return [primary] if primary == dashed(f.name) else [primary, dashed(f.name)]


def field_default(f):
    """The dataclass default, or None for a required field."""
    return None if f.default is dataclasses.MISSING else f.default


def add_config_arguments(parser):
    """Add one argument group per category with a flag for every TransformerConfig field."""
    groups = {c: parser.add_argument_group(f"model config: {c}") for c in CATEGORIES}
    for f in config_fields():
        group = groups[f.metadata["category"]]
        kind, default = field_type_name(f), field_default(f)
        help_text = f.metadata["help"] + (" (required)" if f.default is dataclasses.MISSING else "")
        if kind == "bool":
            group.add_argument(*option_strings(f), dest=f.name, default=default, help=help_text,
                               action=argparse.BooleanOptionalAction)
            if "negative_flag" in f.metadata:
                group.add_argument(f.metadata["negative_flag"], dest=f.name, action="store_false",
                                   default=default, help=f"same as --no-{dashed(f.name)[2:]}")
            continue
        if kind.startswith("list["):                 # several values: --flag A B
            group.add_argument(*option_strings(f), dest=f.name, default=default, help=help_text,
                               nargs="+", type=TYPES[kind[5:-1]], choices=CHOICES.get(f.name),
                               metavar=kind[5:-1].upper())
            continue
        group.add_argument(*option_strings(f), dest=f.name, default=default, help=help_text,
                           type=TYPES[kind], choices=CHOICES.get(f.name),
                           metavar=METAVARS.get(kind, kind.upper().replace("TORCH.", "")))
        for alias, value in f.metadata.get("aliases", {}).items():
            group.add_argument(alias, dest=f.name, action="store_const", const=value,
                               default=default, help=f"same as {dashed(f.name)} {value}")
    return parser


def config_from_args(args, **overrides):
    """A validated TransformerConfig from parsed args (plus keyword overrides)."""
    names = {f.name for f in config_fields()}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown TransformerConfig fields in overrides: {sorted(unknown)}")
    values = {}
    for f in config_fields():
        value = overrides[f.name] if f.name in overrides else getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
        elif f.default is dataclasses.MISSING:
            raise ValueError(f"{f.name} is required ({option_strings(f)[0]})")
    return TransformerConfig(**values)


def config_to_argv(config):
    """Flags that rebuild ``config`` through add_config_arguments + config_from_args."""
    argv = []
    for f in config_fields():
        value = getattr(config, f.name)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(dashed(f.name) if value else "--no-" + dashed(f.name)[2:])
        elif isinstance(value, torch.dtype):
            argv += [dashed(f.name), _dtype_name(value)]
        elif field_type_name(f).startswith("tuple["):          # Megatron's tuple flags: L,R
            argv += [dashed(f.name), ",".join(str(v) for v in value)]
        elif isinstance(value, (list, tuple)) and field_type_name(f) != "int | list[int]":
            argv += [dashed(f.name), *map(str, value)]
        else:
            argv += [dashed(f.name), str(value)]
    return argv


def _dtype_name(dtype):
    return next(name for name, d in DTYPES.items() if d == dtype)


def config_to_dict(config):
    """Every field's value as plain Python (dtypes by name): JSON- and ``weights_only``-safe.

    Checkpoints store it so a model can be rebuilt without the flags it was trained with."""
    values = {}
    for f in config_fields():
        value = getattr(config, f.name)
        values[f.name] = _dtype_name(value) if isinstance(value, torch.dtype) else value
    return values


def config_from_dict(values, **overrides):
    """The TransformerConfig ``config_to_dict`` described, with keyword overrides applied."""
    names = {f.name for f in config_fields()}
    unknown = (set(values) | set(overrides)) - names
    if unknown:
        raise ValueError(f"unknown TransformerConfig fields {sorted(unknown)} (a model config "
                         "written by another version of tpfuse?)")
    return TransformerConfig(**{**values, **overrides})


def format_field_table():
    """The fields by category: flag(s), type, default, doc — what ``--list`` prints."""
    lines = []
    for category in CATEGORIES:
        lines.append(f"[{category}]")
        for f in config_fields():
            if f.metadata["category"] != category:
                continue
            flags = option_strings(f)
            if field_type_name(f) == "bool":
                flags = [flags[0] + " / --no-" + dashed(f.name)[2:]] + flags[1:]
            flags += [f.metadata["negative_flag"]] if "negative_flag" in f.metadata else []
            flags += list(f.metadata.get("aliases", {}))
            kind = "|".join(CHOICES[f.name]) if f.name in CHOICES else field_type_name(f)
            lines.append(f"  {', '.join(flags)}")
            lines.append(f"      {kind:24s} default={_default_text(f):18s} {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def _default_text(f):
    if f.default is dataclasses.MISSING:
        return "(required)"
    if f.default is None:
        return "(derived)" if f.name in DERIVED else "None"
    return repr(f.default)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="tpfuse-config",
        description="List TransformerConfig's flags, or validate a configuration given as flags.")
    parser.add_argument("--list", action="store_true", help="print every field by category")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.list:
        try:
            print(format_field_table())
        except BrokenPipeError:        # `tpfuse-config --list | head`
            sys.stderr.close()
        return 0
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"tpfuse-config: invalid configuration: {error}", file=sys.stderr)
        return 2
    for f in config_fields():
        print(f"{f.name} = {getattr(config, f.name)}")
    print(f"padded_vocab_size = {config.padded_vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
