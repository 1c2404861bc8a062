"""megatron-core 0.16's ``dist_checkpointing.mapping``: what a sharded state dict holds.

``ShardedTensor``: this rank's piece ``data`` of a global tensor named ``key``::

    global_shape = (*prepended axes, *data.shape scaled up along the sharded axes)
    global_offset = where data[0, ..., 0] sits in the global tensor (one entry per global axis)

``prepend_axis_num`` leading global axes do not exist in ``data`` (Megatron stacks the layers
of a GPT this way: ``decoder.layers.<name>`` has a leading axis of ``num_layers``).
``replica_id`` is 0 (or all zeros) for the one copy that is written; other copies (the same
piece on another tp / dp rank) are only read. ``ShardedObject``: any picklable ``data`` stored
under ``unique_key``. ``LocalNonpersistentObject``: returned as it is, never stored.
``ShardedTensorFactory``: a tensor stored as the ShardedTensors its ``build_fn`` makes and
loaded back through its ``merge_fn`` (a strided partition: the gated fc1, stacked experts).
``flattened_range`` (pieces of a flattened tensor, Megatron's distributed optimizer format) is
not supported.

``make_sharded_tensors_for_module`` turns a module's state dict into ShardedTensors from the
tpfuse parameter attributes (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Tuple, Union

import torch

ReplicaId = Union[int, Tuple[int, ...]]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Megatron's rule: the copy whose replica id is 0 (every entry 0) is written."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase:
    """Common base of what ``save`` writes and ``load`` reads."""
    key: str
    data: object
    replica_id: ReplicaId


@dataclass
class ShardedTensor(ShardedBase):
    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """ValueError naming the key when shapes, offsets and data disagree."""
        if self.flattened_range is not None:
            raise ValueError(f"ShardedTensor {self.key!r}: flattened_range (flattened pieces of "
                             "Megatron's distributed-optimizer format) is not supported by tpfuse")
        if len(self.global_shape) != len(self.global_offset):
            raise ValueError(f"ShardedTensor {self.key!r}: global_shape {self.global_shape} and "
                             f"global_offset {self.global_offset} differ in length")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise ValueError(f"ShardedTensor {self.key!r}: local_shape {self.local_shape} plus "
                             f"{self.prepend_axis_num} prepended axes != global_shape "
                             f"{self.global_shape}")
        if self.data is not None and tuple(self.data.shape) != tuple(self.local_shape):
            raise ValueError(f"ShardedTensor {self.key!r}: data shape {tuple(self.data.shape)} "
                             f"!= local_shape {self.local_shape}")
        for offset, size, total in zip(self.global_offset, self.chunk_sizes(), self.global_shape):
            if offset < 0 or offset + size > total:
                raise ValueError(f"ShardedTensor {self.key!r}: piece at {self.global_offset} of "
                                 f"sizes {self.chunk_sizes()} leaves global_shape "
                                 f"{self.global_shape}")

    def chunk_sizes(self) -> Tuple[int, ...]:
        """The piece's extent in every global axis (1 along the prepended ones)."""
        return (1,) * self.prepend_axis_num + tuple(self.local_shape)

    def global_slice(self):
        return tuple(slice(o, o + s) for o, s in zip(self.global_offset, self.chunk_sizes()))

    def without_data(self):
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(cls, key: str, data: torch.Tensor, *rank_offsets,
                          replica_id: ReplicaId = 0, prepend_axis_num: int = 0,
                          flattened_range=None, **init_kwargs):
        """``rank_offsets``: ``(axis, rank along it, number of pieces along it)`` per sharded
        axis (axes count the prepended ones first); the piece sits at rank · local size."""
        if flattened_range is not None:
            raise ValueError(f"ShardedTensor {key!r}: flattened_range is not supported by tpfuse")
        global_offset = [0] * (data.ndim + prepend_axis_num)
        global_shape = [1] * prepend_axis_num + list(data.shape)
        fragments = [1] * len(global_shape)
        seen = set()
        for axis, axis_rank, axis_fragments in rank_offsets:
            if axis in seen:
                raise ValueError(f"ShardedTensor {key!r}: axis {axis} given twice in rank_offsets")
            seen.add(axis)
            global_offset[axis] = axis_rank * global_shape[axis]
            global_shape[axis] *= axis_fragments
            fragments[axis] = axis_fragments
        return cls(key, data, data.dtype, tuple(data.shape), tuple(global_shape),
                   tuple(global_offset), tuple(fragments), replica_id, prepend_axis_num,
                   **init_kwargs)

    def init_data(self, device, init_fn=torch.empty):
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)


@dataclass
class ShardedObject(ShardedBase):
    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    @property
    def unique_key(self) -> str:
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    def without_data(self):
        return replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key, replica_id: ReplicaId = 0) -> "ShardedObject":
        key, shard = unique_key.rsplit("/shard_", 1)
        offset, shape = shard.split("_")
        return cls(key, None, tuple(int(x) for x in shape.split(".")),
                   tuple(int(x) for x in offset.split(".")), replica_id)


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved as the sub-state-dict ``build_fn(key, data, replica_id, flattened_range)``
    (ShardedTensors of other pieces / layouts) and loaded back as ``merge_fn(loaded
    sub-state-dict)``: Megatron's way to store a gated MLP's fc1 or stacked experts so that the
    stored tensor does not depend on the layout (see ``strided_factory``)."""
    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    build_fn: Callable = field(repr=False)
    merge_fn: Callable = field(repr=False)
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self):
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before the build (Megatron's rule)."""

    def without_data(self):
        return replace(self, data=None)


def apply_factories(tree):
    """The nesting with every ShardedTensorFactory replaced by its built sub-state-dict."""
    if isinstance(tree, ShardedTensorFactory):
        return tree.build()
    if isinstance(tree, dict):
        return {key: apply_factories(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [apply_factories(value) for value in tree]
    return tree


def apply_factory_merges(loaded, sharded):
    """``loaded`` (the load of ``apply_factories(sharded)``) with every factory position merged
    back by its ``merge_fn``; entries ``loaded`` lacks are left out."""
    if isinstance(sharded, ShardedTensorFactory):
        return sharded.merge_fn(loaded)
    if isinstance(sharded, dict) and isinstance(loaded, dict):
        for key, value in sharded.items():
            if key in loaded:
                loaded[key] = apply_factory_merges(loaded[key], value)
    elif isinstance(sharded, list) and isinstance(loaded, list) and len(sharded) == len(loaded):
        for index, value in enumerate(sharded):
            loaded[index] = apply_factory_merges(loaded[index], value)
    return loaded


class LocalNonpersistentObject:
    """Kept on this rank through ``load`` unchanged; never saved."""

    def __init__(self, obj):
        self.obj = obj

    def unwrap(self):
        return self.obj


# ---------------------------------------------------------------------------- from modules
def tp_coordinates():
    from tpfuse.parallel.state import resolve_state_or_none

    state = resolve_state_or_none()
    if state is None:
        return 1, 0, 0
    return state.tp_size, state.tp_rank, state.rank_in("dp-cp") or 0


def sharded_tensor_for(key: str, tensor: torch.Tensor, sharded_offsets: tuple = (),
                       tp=None, dp_rank=None):
    """A ShardedTensor for a (tpfuse) parameter or buffer: cut along ``partition_dim`` over the
    tp ranks when it is tensor-parallel, else replicated (written by tp rank 0); ``dp_rank``
    (data + context parallel) goes into the replica id; ``sharded_offsets`` are prepended axes
    ``(axis, offset, size)`` (the layer axis). A weight partitioned with a stride (a gated
    MLP's fc1: ``partition_stride`` 2) becomes a ``strided_factory``."""
    if tp is None:
        tp_size, tp_rank, dp_rank_default = tp_coordinates()
    else:
        tp_size, tp_rank, dp_rank_default = tp
    dp_rank = dp_rank_default if dp_rank is None else dp_rank
    prepend = len(sharded_offsets)
    offsets = list(sharded_offsets)
    data = tensor.detach()
    if getattr(tensor, "tensor_model_parallel", False) and tp_size > 1:
        axis = prepend + int(tensor.partition_dim)
        replica = (0, 0, dp_rank)
        stride = int(getattr(tensor, "partition_stride", 1))
        if stride != 1:
            return strided_factory(key, data, sharded_offsets, axis, tp_rank, tp_size, stride,
                                   replica)
        offsets.append((axis, tp_rank, tp_size))
    else:
        replica = (0, tp_rank, dp_rank)
    return ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=replica,
                                           prepend_axis_num=prepend)


def strided_pieces(key, data, sharded_offsets, axis, rank, size, stride, replica_id,
                   rank_offsets=()):
    """The ``stride`` ShardedTensors of a strided partition: the partitioned global axis is cut
    into ``size · stride`` blocks dealt round-robin, so this rank's local tensor is its blocks
    ``rank, rank + size, ...`` in order; block j of the local tensor sits at global block
    ``j · size + rank``. For a gated fc1 (stride 2 on the output rows) this is Megatron's
    ``apply_swiglu_sharded_factory``: the gate rows of every rank, then the up rows, so the
    stored tensor is the tp = 1 ``[gate; up]`` at any tp. ``rank_offsets``: further
    ``(axis, rank, size)`` cuts of the other (not prepended) axes."""
    prepend = len(sharded_offsets)
    blocks = torch.chunk(data, stride, dim=axis - prepend)
    return [ShardedTensor.from_rank_offsets(key, block.contiguous(), *sharded_offsets,
                                            *rank_offsets,
                                            (axis, j * size + rank, size * stride),
                                            replica_id=replica_id, prepend_axis_num=prepend)
            for j, block in enumerate(blocks)]


def strided_factory(key, data, sharded_offsets, axis, rank, size, stride, replica_id):
    """``strided_pieces`` as a ShardedTensorFactory (merge: the blocks concatenated back)."""
    local_axis = axis - len(sharded_offsets)

    def build(key, data, replica_id, flattened_range):
        return strided_pieces(key, data, sharded_offsets, axis, rank, size, stride, replica_id)

    def merge(blocks):
        return torch.cat(blocks, dim=local_axis)
    return ShardedTensorFactory(key, data, build, merge, replica_id)


def make_sharded_tensors_for_module(module: torch.nn.Module, prefix: str = "",
                                    sharded_offsets: tuple = ()) -> dict:
    """``{prefix + name: ShardedTensor}`` over ``module.state_dict(keep_vars=True)``."""
    return {prefix + name: sharded_tensor_for(prefix + name, tensor, sharded_offsets)
            for name, tensor in module.state_dict(keep_vars=True).items()}
