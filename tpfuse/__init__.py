"""tpfuse: tensor- and pipeline-parallel GPT training (Megatron-core's ideas, small and clear).

Subpackages: ``tpfuse.parallel``, ``tpfuse.kernels``, ``tpfuse.tp_layers``, ``tpfuse.models``,
``tpfuse.pipeline``, ``tpfuse.data``, ``tpfuse.checkpoint``, ``tpfuse.runtime``,
``tpfuse.training``.
"""
__version__ = "0.1.0"
