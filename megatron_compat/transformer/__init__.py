"""megatron-core 0.16's ``transformer`` package: ``TransformerConfig``."""
from .transformer_config import TransformerConfig

__all__ = ["TransformerConfig"]
