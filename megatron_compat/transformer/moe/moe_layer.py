"""megatron-core 0.16's ``transformer.moe.moe_layer``: ``MoELayer`` / ``MoESubmodules`` as a spec
names them; tpfuse's ``tpfuse.moe.layer.MoELayer`` is built in their place by the
TransformerLayer (sizes, router and dispatcher from the TransformerConfig's ``moe_*`` fields)."""
from dataclasses import dataclass
from typing import Union

from ..attention import _BuiltByTheLayer
from ..spec_utils import ModuleSpec


@dataclass
class MoESubmodules:
    experts: Union[ModuleSpec, type] = None
    shared_experts: Union[ModuleSpec, type] = None


class MoELayer(_BuiltByTheLayer):
    pass
