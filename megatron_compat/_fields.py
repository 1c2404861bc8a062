"""How a Megatron config field is treated by tpfuse, recorded in the field's metadata.

``_used(default)``  the field drives tpfuse's behaviour (layers, schedules, initialisation);
``_free(default)``  any value is accepted: a description the user's own model code reads (shapes,
                    activation, MoE sizes, ...) or an option whose request tpfuse already meets
                    (CPU initialisation, gradient accumulation into ``main_grad``, batched p2p);
``_only(default)``  Megatron machinery tpfuse does not implement (FP8, CUDA graphs, Transformer
                    Engine, offloading, overlapped p2p, ...): any other value is a ValueError at
                    construction, never silently ignored.
"""
from __future__ import annotations

import dataclasses

USED, FREE, ONLY = "used", "free", "default-only"


def _make(support, default, factory):
    metadata = {"support": support}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _used(default=None, factory=None):
    return _make(USED, default, factory)


def _free(default=None, factory=None):
    return _make(FREE, default, factory)


def _only(default=None, factory=None):
    return _make(ONLY, default, factory)


def _same(value, default) -> bool:
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # pragma: no cover - exotic values that do not compare
        return False


def check_default_only(config) -> None:
    """ValueError naming the first default-only field set to another value."""
    for f in dataclasses.fields(config):
        if f.metadata.get("support") != ONLY:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        value = getattr(config, f.name)
        if not _same(value, default):
            raise ValueError(
                f"{type(config).__name__}.{f.name}={value!r} is not supported by tpfuse (Megatron "
                f"machinery tpfuse does not implement); leave it at its default {default!r}")


def support_of(config_cls) -> dict[str, str]:
    """Field name → "used" / "free" / "default-only" (for documentation and tests)."""
    return {f.name: f.metadata["support"] for f in dataclasses.fields(config_cls)}
