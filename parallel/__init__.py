"""The parallel_state core: rank arithmetic, process groups, micro-batches, communication.

Names are imported lazily (PEP 562): ``RankLayout`` and ``MicrobatchCalculator`` never pull in
``torch.distributed``.
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "RankLayout": "layout",
    "ParallelState": "state", "get_default_state": "state", "set_default_state": "state",
    "has_default_state": "state", "resolve_state": "state", "resolve_state_or_none": "state",
    "collective_device": "devices", "model_device": "devices",
    "MicrobatchCalculator": "microbatches", "bubble_fraction": "microbatches",
    "WorkerPool": "launch", "WorkerError": "launch", "spawn": "launch",
    "copy_to_region": "mappings", "copy_many_to_region": "mappings", "reduce_from_region": "mappings",
    "scatter_to_region": "mappings", "gather_from_region": "mappings",
    "scatter_to_sequence_parallel_region": "mappings",
    "gather_from_sequence_parallel_region": "mappings",
    "reduce_scatter_to_sequence_parallel_region": "mappings",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
