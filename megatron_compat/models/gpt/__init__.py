"""megatron-core 0.16's ``models.gpt``: ``GPTModel`` and its layer specs."""
from .gpt_model import GPTModel

__all__ = ["GPTModel"]
