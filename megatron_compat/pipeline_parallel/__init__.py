"""megatron-core 0.16's ``pipeline_parallel`` package: ``get_forward_backward_func``."""
from .schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
