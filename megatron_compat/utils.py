"""The helpers of megatron-core 0.16's ``utils`` that model and training code commonly import."""
from .pipeline_parallel.schedules import get_model_config  # noqa: F401
from .tensor_parallel.utils import divide  # noqa: F401
from .transformer.transformer_config import (init_method_normal,  # noqa: F401
                                             scaled_init_method_normal)


def get_attr_wrapped_model(model, attr, allow_none=True, return_model_obj=False):
    """``attr`` of ``model`` or of the module it wraps (``.module`` chain)."""
    if isinstance(model, list):
        raise ValueError("get_attr_wrapped_model takes one model chunk, not a list")
    while not hasattr(model, attr) and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, attr) or (not allow_none and getattr(model, attr) is None):
        raise RuntimeError(f"couldn't find attribute {attr!r} on the model")
    return model if return_model_obj else getattr(model, attr)


def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
    """``tp_group``, or when it is None the (expert) tensor-parallel group of parallel_state;
    None without torch.distributed, ``tp_group`` unchanged before parallel_state is set up
    (megatron-core 0.16's helper for layers that take an optional group)."""
    import torch.distributed as dist

    from . import parallel_state

    if not dist.is_initialized():
        return None
    if not parallel_state.is_initialized() or tp_group is not None:
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(
            check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def is_torch_min_version(version, check_equality=True):
    """Whether the installed torch is at least ``version`` (megatron-core 0.16's helper):
    ``Version(torch.__version__) >= Version(version)``, strictly ``>`` with
    ``check_equality=False``; versions compare as ``packaging.version`` orders them (PEP 440:
    ``2.4.0a0 < 2.4.0rc1 < 2.4.0 < 2.4.0+cu121 < 2.4.1``)."""
    try:
        from packaging.version import Version
    except ImportError as error:
        raise ImportError("packaging is not installed. Please install it with "
                          "`pip install packaging`.") from error
    import torch

    installed = Version(torch.__version__)
    if check_equality:
        return installed >= Version(version)
    return installed > Version(version)
