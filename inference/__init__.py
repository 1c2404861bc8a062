"""tpfuse.inference: load a model without training state, KV-cache decoding, ``generate``.

``load_model(checkpoint_dir, state=None)`` (loading.py), ``InferenceContext`` (context.py: the KV
cache ``GPTModel.forward(..., inference_context=)`` reads and extends), ``generate(model,
prompt_ids, max_new_tokens, ...)`` (generate.py), which steps run with sequence parallelism
(sequence_parallel.py), ``SamplingParams`` (sampling.py); the
``tpfuse-generate`` command lives in cli.py.
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "load_model": "loading", "load_tokenizer": "loading", "inference_config": "loading",
    "InferenceContext": "context",
    "generate": "generate", "pipeline_forward": "generate",
    "SamplingParams": "sampling", "sample_next_tokens": "sampling",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
