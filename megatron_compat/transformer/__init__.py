"""megatron-core 0.16's ``transformer`` package: ``TransformerConfig`` and the pieces a layer
spec names (``ModuleSpec``, ``TransformerLayer``, ``TransformerBlock``, ``MegatronModule``)."""
from .transformer_config import TransformerConfig

__all__ = ["TransformerConfig", "ModuleSpec", "build_module", "MegatronModule",
           "TransformerLayer", "TransformerLayerSubmodules", "TransformerBlock",
           "TransformerBlockSubmodules"]

_LAZY = {"ModuleSpec": "spec_utils", "build_module": "spec_utils", "MegatronModule": "module",
         "TransformerLayer": "transformer_layer",
         "TransformerLayerSubmodules": "transformer_layer",
         "TransformerBlock": "transformer_block",
         "TransformerBlockSubmodules": "transformer_block"}


def __getattr__(name):
    """The spec pieces load on first use (the config alone stays a light import)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
