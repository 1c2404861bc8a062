"""Triton kernels with plain-torch references (see kernels/backend.py for how one is chosen).

Exports go through ``tpfuse._lazy``: an op whose module has its name (``matmul``, ``layer_norm``, ...)
is bound at import, the others (``all_gather_matmul``, the shard pieces) on first use.

Imported as the bare ``kernels`` (Python started in the repository root, whose folder shadows the
``kernels`` distribution transformers imports), this folder hands the name over to that
distribution (``tpfuse._shadow``); tpfuse's own module is always ``tpfuse.kernels``.
"""
if __name__ == "kernels":
    from tpfuse._shadow import hand_over

    hand_over(__name__, __file__)
else:
    from tpfuse._lazy import lazy_exports

    _EXPORTS = {
        "set_backend": "backend", "get_backend": "backend", "use_backend": "backend",
        "matmul": "matmul",
        "layer_norm": "layer_norm",
        "rms_norm": "rms_norm",
        "flash_attention": "flash_attention",
        "attention_forward": "flash_attention",
        "attention_backward": "flash_attention",
        "merge_attention": "flash_attention",
        "cross_entropy": "cross_entropy",
        "cross_entropy_shard_stats": "cross_entropy",
        "cross_entropy_shard_grad": "cross_entropy",
        "bias_dropout_add": "bias_dropout_add",
        "all_gather_matmul": "ag_matmul",
        "matmul_reduce_scatter": "matmul_rs",
    }
    __getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
