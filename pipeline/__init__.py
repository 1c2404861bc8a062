"""Pipeline parallelism: schedules as data, their simulation, p2p and a small executor.

Names are imported lazily (PEP 562): the pure schedule/simulation modules never pull in
``torch.distributed``.
"""
import importlib

_EXPORTS = {
    "Action": "schedules", "build_schedule": "schedules",
    "build_no_pipelining_schedule": "schedules", "bubble_fraction_formula": "schedules",
    "build_zb_h1_schedule": "zero_bubble",
    "simulate": "simulate", "SimulationResult": "simulate",
    "get_forward_backward_func": "executor", "forward_backward_no_pipelining": "executor",
    "forward_backward_pipelining_without_interleaving": "executor",
    "forward_backward_pipelining_with_interleaving": "executor",
    "forward_backward_pipelining_zb_h1": "executor",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpfuse.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return __all__
