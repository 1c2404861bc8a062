"""tpfuse.training.plan: ``tpfuse-plan``, the per-rank memory and communication of a layout from
tpfuse-train's flags alone (no model, no process group).

- ``memory.py``: the parameters' shapes, the gradient buffers or FSDP units they fall into, and
  the four static memory kinds of a rank (``static_memory``);
- ``activations.py``: the activation memory at the schedule's peak, and the bubble;
- ``comm.py``: the bytes each group kind moves per optimizer step;
- ``report.py``: one layout's plan, every rank (``plan_layout``, ``format_plan``);
- ``search.py``: every layout of a world size, ranked by a roofline step time;
- ``cli.py``: the ``tpfuse-plan`` command.

The submodules import each other directly; this ``__init__`` only re-exports ``memory.py``'s
names, lazily.
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "MEMORY_KINDS": "memory", "DTYPE_BYTES": "memory",
    "ParamShape": "memory", "element_bytes": "memory", "layout_of": "memory",
    "layer_shapes": "memory", "chunk_shapes": "memory", "rank_shapes": "memory",
    "BufferSettings": "memory", "buffer_settings": "memory", "buffer_plans": "memory",
    "FsdpUnit": "memory", "fsdp_units": "memory", "fsdp_static_memory": "memory",
    "static_memory": "memory", "shard_group": "memory", "replica_group": "memory",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
