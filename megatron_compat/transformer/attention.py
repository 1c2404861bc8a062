"""megatron-core 0.16's ``transformer.attention``: the names a layer spec gives the attention
block. tpfuse's TransformerLayer builds its own attention (QKV column-parallel, core attention,
row-parallel projection: Megatron's local spec); these classes are what a spec names, and are
built as part of a ``TransformerLayer``, not on their own.

The q / k norm slots (Megatron's ``qk_layernorm``: ``get_gpt_layer_local_spec(qk_layernorm=True)``
puts ``WrappedTorchNorm`` there) are what ``TransformerConfig.qk_layernorm`` says tpfuse's
attention builds: ``qk_norm_slots_checked`` refuses a spec that disagrees with the config."""
import dataclasses
from dataclasses import dataclass
from typing import Union

from .spec_utils import ModuleSpec, get_module


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


@dataclass
class CrossAttentionSubmodules:
    linear_q: Union[ModuleSpec, type] = None
    linear_kv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None


class _BuiltByTheLayer:
    def __init__(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__} is built by tpfuse's TransformerLayer from the "
                         "layer spec (build the TransformerLayer / GPTModel), not on its own")


class Attention(_BuiltByTheLayer):
    pass


class SelfAttention(Attention):
    pass


class CrossAttention(Attention):
    def __init__(self, *args, **kwargs):
        raise ValueError("CrossAttention is not implemented by tpfuse (decoder-only GPT)")


def _slot_has_norm(slot: str, given) -> bool:
    """True for WrappedTorchNorm, False for IdentityOp / None; ValueError for anything else."""
    from .identity_op import IdentityOp
    from .torch_norm import WrappedTorchNorm

    module = get_module(given) if given is not None else None
    if module in (None, IdentityOp, WrappedTorchNorm):
        return module is WrappedTorchNorm
    raise ValueError(f"layer spec: self_attention.{slot} is {getattr(module, '__name__', module)!r}; "
                     "tpfuse's attention computes WrappedTorchNorm (qk_layernorm) or IdentityOp "
                     "there (use get_gpt_layer_local_spec(qk_layernorm=...))")


def qk_norm_slots_checked(spec, config):
    """The layer spec with its self-attention q / k norm slots checked against
    ``config.qk_layernorm`` (both ``WrappedTorchNorm`` with it, both ``IdentityOp`` without) and
    then given as ``IdentityOp``, the form the rest of the spec check takes; a spec of another
    shape is returned as it is (the layer spec check names what is wrong with it)."""
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    slots = getattr(attention, "submodules", None)
    if not isinstance(slots, SelfAttentionSubmodules):
        return spec
    from .identity_op import IdentityOp

    for slot in ("q_layernorm", "k_layernorm"):
        has_norm = _slot_has_norm(slot, getattr(slots, slot))
        if has_norm != bool(config.qk_layernorm):
            raise ValueError(f"layer spec: self_attention.{slot} is "
                             f"{'a norm' if has_norm else 'IdentityOp'} but "
                             f"TransformerConfig.qk_layernorm={config.qk_layernorm}: use "
                             f"get_gpt_layer_local_spec(qk_layernorm={config.qk_layernorm}) "
                             "(tpfuse builds the q / k norms from the config)")
    slots = dataclasses.replace(slots, q_layernorm=IdentityOp, k_layernorm=IdentityOp)
    attention = dataclasses.replace(attention, submodules=slots)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    self_attention=attention))
