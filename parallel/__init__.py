"""The parallel_state core: rank arithmetic, process groups, micro-batches, communication.

Names are imported lazily (PEP 562): ``RankLayout`` and ``MicrobatchCalculator`` never pull in
``torch.distributed``.
"""
import importlib

_EXPORTS = {
    "RankLayout": "layout",
    "ParallelState": "state", "get_default_state": "state", "set_default_state": "state",
    "MicrobatchCalculator": "microbatches", "bubble_fraction": "microbatches",
    "WorkerPool": "launch", "WorkerError": "launch", "spawn": "launch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpfuse.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return __all__
