"""Triton kernels with plain-torch references (see kernels/backend.py for how one is chosen).

Names are imported lazily (PEP 562), so ``import tpfuse.kernels`` stays cheap and each op's module
is loaded on first use.
"""
import importlib
import importlib.util

_EXPORTS = {
    "set_backend": "backend", "get_backend": "backend", "use_backend": "backend",
    "matmul": "matmul",
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
    "flash_attention": "flash_attention",
    "cross_entropy": "cross_entropy",
    "cross_entropy_shard_stats": "cross_entropy",
    "cross_entropy_shard_grad": "cross_entropy",
    "bias_dropout_add": "bias_dropout_add",
    "all_gather_matmul": "ag_matmul",
    "matmul_reduce_scatter": "matmul_rs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpfuse.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return __all__


# An op defined in a submodule of the same name (matmul.py defines matmul) would be shadowed by the
# module object as soon as anyone imports that submodule (the import system sets the package
# attribute), so those ops are bound eagerly whenever their file exists.
for _name, _module in _EXPORTS.items():
    if _name == _module and importlib.util.find_spec(f"{__name__}.{_module}") is not None:
        globals()[_name] = getattr(importlib.import_module(f".{_module}", __name__), _name)
