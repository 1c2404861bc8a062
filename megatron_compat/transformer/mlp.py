"""megatron-core 0.16's ``transformer.mlp``: ``MLP`` / ``MLPSubmodules`` as a spec names them
(fc1 column-parallel, activation, fc2 row-parallel: tpfuse's ParallelMLP); built as part of a
TransformerLayer. ``apply_swiglu_sharded_factory``: Megatron's checkpoint layout of a gated
fc1 (the model's ``sharded_state_dict`` applies it to every strided weight itself)."""
from dataclasses import dataclass
from typing import Union

from ..dist_checkpointing.mapping import strided_factory
from .attention import _BuiltByTheLayer
from .spec_utils import ModuleSpec


@dataclass
class MLPSubmodules:
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None


class MLP(_BuiltByTheLayer):
    pass


def apply_swiglu_sharded_factory(original_sh_ten, sharded_offsets,
                                 singleton_local_shards: bool = False):
    """The ShardedTensorFactory storing a gated fc1's local ``[gate_r; up_r]`` (``original_sh_ten``
    cut over tp along its first own axis like any column-parallel weight) as Megatron does: the
    gate rows at block r, the up rows at block tp + r of 2·tp (``strided_factory``)."""
    if singleton_local_shards:
        raise ValueError("apply_swiglu_sharded_factory(singleton_local_shards=True) is not "
                         "supported by tpfuse (it writes Megatron's default layout)")
    axis = len(sharded_offsets)
    local_rows = original_sh_ten.local_shape[0]
    rank = original_sh_ten.global_offset[axis] // local_rows
    size = (original_sh_ten.axis_fragmentations or (1,) * (axis + 1))[axis]
    return strided_factory(original_sh_ten.key, original_sh_ten.data, tuple(sharded_offsets),
                           axis, rank, size, 2, original_sh_ten.replica_id)
