"""tpfuse.convert: HuggingFace GPT-2 / Llama / Mistral / Mixtral / Qwen2 / Qwen2-MoE / Qwen3 /
Qwen3-MoE checkpoints ↔ tpfuse checkpoints (safetensors I/O).

``import_hf(hf_dir, save_dir, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ...)``
and ``export_hf(load_dir, save_dir)`` (hf.py; the ``tpfuse-convert`` command in cli.py), one
module per architecture (gpt2.py, llama.py, ..., qwen3.py, qwen3_moe.py), the fused-QKV and
vocabulary helpers (common.py), the two on-disk formats (hf_io.py, tpfuse_io.py).
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {"import_hf": "hf", "export_hf": "hf", "ARCHITECTURES": "hf"}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
