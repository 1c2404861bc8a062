"""megatron-core 0.16's ``transformer.attention``: the names a layer spec gives the attention
block. tpfuse's TransformerLayer builds its own attention (QKV column-parallel, core attention,
row-parallel projection: Megatron's local spec); these classes are what a spec names, and are
built as part of a ``TransformerLayer``, not on their own."""
from dataclasses import dataclass
from typing import Union

from .spec_utils import ModuleSpec


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
