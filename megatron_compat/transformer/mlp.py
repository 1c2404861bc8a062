"""megatron-core 0.16's ``transformer.mlp``: ``MLP`` / ``MLPSubmodules`` as a spec names them
(fc1 column-parallel, activation, fc2 row-parallel: tpfuse's ParallelMLP); built as part of a
TransformerLayer."""
from dataclasses import dataclass
from typing import Union

from .attention import _BuiltByTheLayer
from .spec_utils import ModuleSpec


@dataclass
class MLPSubmodules:
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None


class MLP(_BuiltByTheLayer):
    pass
