"""The shared pieces tp_layers is built on: communication mappings and kernels.

One import site, so every layer calls exactly the collectives of ``tpfuse.parallel.mappings`` and
the ops of ``tpfuse.kernels`` (no copies of either live in tp_layers).
"""
import importlib

_MAPPINGS = (
    "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
)
_KERNELS = (
    "matmul", "layer_norm", "rms_norm", "flash_attention", "cross_entropy_shard_stats",
    "cross_entropy_shard_grad", "bias_dropout_add", "all_gather_matmul", "matmul_reduce_scatter",
)


def _load(module, name):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # TEMPORARY SHIM until issues 3/4 land
        from . import _tmp_shim
        return getattr(_tmp_shim, name)


for _name in _MAPPINGS:
    globals()[_name] = _load("tpfuse.parallel.mappings", _name)
for _name in _KERNELS:
    globals()[_name] = _load("tpfuse.kernels", _name)
