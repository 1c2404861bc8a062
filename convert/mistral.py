"""Mistral (``MistralForCausalLM``) ↔ tpfuse GPTModel: Llama's tensors and layout (``llama.py``)
with sliding-window attention.

HF's ``sliding_window`` S lets a query attend to itself and the S − 1 keys before it; tpfuse's
``window_size = (L, 0)`` lets it see the L keys before it and itself, so L = S − 1 (the KV-cached
decode masks by the same rule). A Mistral config without a window is a Llama and imports as one
(``sliding_window: null``); a dense windowed tpfuse model exports as Mistral.
"""
from __future__ import annotations

from tpfuse.parallel.checks import is_int

from . import llama

MODEL_TYPE = "mistral"
ARCHITECTURE = "MistralForCausalLM"


def window_from_hf(hf: dict):
    window = hf.get("sliding_window")
    if window is None:
        return None
    if not is_int(window) or window < 1:
        raise ValueError(f"sliding_window={window!r} must be a positive int (or null)")
    return (window - 1, 0)


def config_from_hf(hf: dict) -> dict:
    return dict(llama.config_from_hf(hf), window_size=window_from_hf(hf))


def mismatches(config) -> list[str]:
    """Why ``config`` is not a Mistral (empty when it is): Llama's checks, with a window."""
    problems = [p for p in llama.mismatches(config) if not p.startswith("window_size")]
    if config.window_size is None:
        problems.append("window_size=None (needs a sliding window; without one it is a Llama)")
    return problems


def config_to_hf(config, eos_id: int | None) -> dict:
    hf = llama.config_to_hf(config, eos_id)
    hf.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
              sliding_window=config.window_size[0] + 1)
    return hf


tensors_from_hf = llama.tensors_from_hf
tensors_to_hf = llama.tensors_to_hf
