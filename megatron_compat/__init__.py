"""megatron-core 0.16's API on tpfuse: change ``megatron.core`` to ``tpfuse.megatron_compat``.

    from tpfuse.megatron_compat import parallel_state, tensor_parallel
    from tpfuse.megatron_compat.model_parallel_config import ModelParallelConfig
    from tpfuse.megatron_compat.transformer import TransformerConfig
    from tpfuse.megatron_compat.pipeline_parallel import get_forward_backward_func
    from tpfuse.megatron_compat.num_microbatches_calculator import init_num_microbatches_calculator
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.distributed import DistributedDataParallel
    from tpfuse.megatron_compat import dist_checkpointing

Module paths mirror ``megatron.core``; signatures, defaults and return conventions are
Megatron's, the work is tpfuse's (layers, collectives, schedules, RNG tracker). ``mpu`` is
``parallel_state`` (Megatron's legacy alias). See docs/interfaces.md for what differs and
docs/megatron_coverage.md for the modules covered.
"""
import importlib

__version__ = "0.16.1"
_SUBMODULES = ("parallel_state", "tensor_parallel", "utils", "model_parallel_config",
               "num_microbatches_calculator", "pipeline_parallel", "transformer", "enums",
               "datasets", "models", "distributed", "optimizer", "dist_checkpointing",
               "optimizer_param_scheduler", "fusions", "hyper_comm_grid",
               "process_groups_config")
__all__ = ["parallel_state", "tensor_parallel", "utils", "ModelParallelConfig", "mpu"]


def __getattr__(name):
    """Submodules and ``ModelParallelConfig`` load on first use (importing this package stays
    cheap)."""
    if name == "mpu":
        name = "parallel_state"
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name == "ModelParallelConfig":
        return importlib.import_module(".model_parallel_config", __name__).ModelParallelConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
