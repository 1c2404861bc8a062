"""tpfuse.models: TransformerConfig, the pure layer assignment, GPT stages and build_model.

Names are imported lazily (PEP 562) so ``TransformerConfig`` does not pull in the TP layers.
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "TransformerConfig": "config",
    "add_config_arguments": "cli", "config_from_args": "cli", "config_to_argv": "cli",
    "config_to_dict": "cli", "config_from_dict": "cli",
    "layers_for": "layer_assignment", "layer_offset": "layer_assignment",
    "stage_layer_counts": "layer_assignment",
    "GPTModel": "gpt", "allreduce_embedding_grads": "gpt",
    "gpt_model_provider": "build", "make_gpt_model_provider": "build", "build_model": "build",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
