"""megatron-core 0.16's ``dist_checkpointing.save`` / ``load`` (the ``torch_dist`` layout, see
``torch_dist.py``).

``save(sharded_state_dict, checkpoint_dir)`` (collective): the ShardedTensors' main replicas
and the ShardedObjects go into the torch.distributed.checkpoint files, every other entry
(rank 0's) into ``common.pt``, then ``metadata.json``; a ShardedTensorFactory is saved as the
sub-state-dict it builds (and merged back by its ``merge_fn`` at load). Before anything is
written, every rank checks (on the gathered pieces of all ranks) that each key's main replicas
tile its global tensor exactly once and agree on its global shape; a violation is a
CheckpointingException naming the key, raised on every rank.

``load(sharded_state_dict, checkpoint_dir)`` (collective) returns the same nesting with every
ShardedTensor replaced by this rank's loaded piece (``local_shape``, the requested dtype),
every ShardedObject by its object, every LocalNonpersistentObject unwrapped, merged over the
saved common entries: what ``model.load_state_dict`` takes.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from . import torch_dist
from .core import (CheckpointingConfig, CheckpointingException, maybe_load_config,
                   save_config)
from .mapping import (LocalNonpersistentObject, ShardedObject, ShardedTensor, apply_factories,
                      apply_factory_merges, is_main_replica)
from .safe_loading import common_safe_globals

COMMON_STATE_FNAME = "common.pt"
_SUPPORTED_STRATEGIES = (None, ("torch_dist", 1), "torch_dist")


# ------------------------------------------------------------------------------ nesting
def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _leaves(value, path + (index,))
    else:
        yield path, tree


def _rebuild(tree, leaf_fn):
    """The same nesting with each leaf mapped (leaf_fn returning _DROP removes it; a container
    whose entries were all removed is removed too, an empty one is kept)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            mapped = _rebuild(value, leaf_fn)
            if mapped is not _DROP:
                out[key] = mapped
        return _DROP if tree and not out else out
    if isinstance(tree, list):
        out = [m for m in (_rebuild(v, leaf_fn) for v in tree) if m is not _DROP]
        return _DROP if tree and not out else out
    return leaf_fn(tree)


_DROP = object()


def _rebuild_top(tree, leaf_fn):
    """``_rebuild`` of a whole state dict (an empty dict when everything was removed)."""
    out = _rebuild(tree, leaf_fn)
    return {} if out is _DROP else out


_SHARDED = (ShardedTensor, ShardedObject, LocalNonpersistentObject)


def _merge(base, update):
    if isinstance(base, dict) and isinstance(update, dict):
        for key, value in update.items():
            base[key] = _merge(base[key], value) if key in base else value
        return base
    return update


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _check_strategy(name, value):
    if value not in _SUPPORTED_STRATEGIES:
        raise ValueError(f"{name}={value!r} is not supported by tpfuse: it writes and reads "
                         "Megatron's torch_dist layout only (leave it None)")


# ------------------------------------------------------------------------------ validation
def _all_pieces(tensors):
    mine = [(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.chunk_sizes(),
             is_main_replica(sh.replica_id)) for sh in tensors]
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [piece for pieces in gathered for piece in pieces]


def validate_sharding_integrity(tensors) -> None:
    """Every key's main replicas tile its global tensor exactly once (see module docstring)."""
    shapes, volumes, offsets = {}, {}, {}
    for key, shape, offset, sizes, main in _all_pieces(tensors):
        if shapes.setdefault(key, shape) != shape:
            raise CheckpointingException(f"tensor {key!r}: ranks disagree on its global shape "
                                         f"({shapes[key]} vs {shape})")
        if not main:
            continue
        if (key, offset) in offsets:
            raise CheckpointingException(f"tensor {key!r}: the piece at {offset} has two main "
                                         "replicas (replica_id 0 on two ranks)")
        offsets[(key, offset)] = True
        volume = 1
        for s in sizes:
            volume *= s
        volumes[key] = volumes.get(key, 0) + volume
    for key, shape in shapes.items():
        total = 1
        for s in shape:
            total *= s
        if volumes.get(key, 0) != total:
            raise CheckpointingException(
                f"tensor {key!r}: its main replicas hold {volumes.get(key, 0)} of the {total} "
                f"elements of global shape {shape}")


# ------------------------------------------------------------------------------ save / load
def save(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity=True, async_sharded_save=False,
         preprocess_common_before_consistancy_check=None, content_metadata=None):
    """Write ``sharded_state_dict`` to ``checkpoint_dir`` (an existing directory); None."""
    _check_strategy("sharded_strategy", sharded_strategy)
    if common_strategy is not None:
        raise ValueError("common_strategy is not supported: common entries go to common.pt")
    for name, value in (("async_sharded_save", async_sharded_save),
                        ("preprocess_common_before_consistancy_check",
                         preprocess_common_before_consistancy_check),
                        ("content_metadata", content_metadata)):
        if value:
            raise ValueError(f"{name} is not supported by tpfuse's dist_checkpointing")
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointingException(f"checkpoint directory {checkpoint_dir} does not exist")
    prepared = prepare_save(sharded_state_dict, validate_access_integrity)
    write_prepared(*prepared, str(checkpoint_dir))
    _barrier()


def prepare_save(sharded_state_dict, validate_access_integrity: bool = True) -> tuple:
    """(rank 0's common entries, main-replica ShardedTensors, main-replica ShardedObjects) of a
    sharded state dict, factories built; with ``validate_access_integrity`` the tiling check of
    the module docstring (a collective over the world)."""
    sharded_state_dict = apply_factories(sharded_state_dict)
    leaves = [leaf for _, leaf in _leaves(sharded_state_dict)]
    tensors = [leaf for leaf in leaves if isinstance(leaf, ShardedTensor)]
    objects = [leaf for leaf in leaves if isinstance(leaf, ShardedObject)]
    if validate_access_integrity:
        validate_sharding_integrity(tensors)
    common = _rebuild_top(sharded_state_dict, lambda leaf: _DROP if isinstance(leaf, _SHARDED)
                          else leaf)
    return (common, [sh for sh in tensors if is_main_replica(sh.replica_id)],
            [sh for sh in objects if is_main_replica(sh.replica_id)])


def write_prepared(common, tensors, objects, checkpoint_dir: str, process_group=None) -> None:
    """Write what ``prepare_save`` gave: ``common.pt`` (rank 0), the torch.distributed.checkpoint
    files (a collective over ``process_group``, default the world), ``metadata.json`` (rank 0)."""
    if _rank() == 0:
        torch.save(common, os.path.join(checkpoint_dir, COMMON_STATE_FNAME))
    torch_dist.save_sharded(tensors, objects, checkpoint_dir, process_group)
    if _rank() == 0:
        save_config(CheckpointingConfig("torch_dist", 1), checkpoint_dir)


def load_common_state_dict(checkpoint_dir):
    """common.pt, read with ``weights_only=True`` (``common_safe_globals``: no other code runs)."""
    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    if not os.path.exists(path):
        return {}
    with torch.serialization.safe_globals(common_safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def load(sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
         validate_access_integrity=True, strict="assume_ok_unexpected"):
    """This rank's pieces of ``sharded_state_dict`` read from ``checkpoint_dir`` (see the
    module docstring)."""
    _check_strategy("sharded_strategy", sharded_strategy)
    if common_strategy is not None:
        raise ValueError("common_strategy is not supported: common entries come from common.pt")
    if getattr(strict, "value", strict) not in ("assume_ok_unexpected",):
        raise ValueError(f"strict={strict!r} is not supported by tpfuse (a missing tensor is "
                         "always an error naming it; unexpected checkpoint keys are ignored)")
    config = maybe_load_config(str(checkpoint_dir))
    if config is None:
        raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint (no "
                                     "metadata.json)")
    if config.sharded_backend != "torch_dist":
        raise CheckpointingException(f"{checkpoint_dir} was written with the "
                                     f"{config.sharded_backend!r} backend; tpfuse reads torch_dist")
    with_factories, sharded_state_dict = sharded_state_dict, apply_factories(sharded_state_dict)
    leaves = [leaf for _, leaf in _leaves(sharded_state_dict)]
    tensors = [leaf for leaf in leaves if isinstance(leaf, ShardedTensor)]
    objects = [leaf for leaf in leaves if isinstance(leaf, ShardedObject)]
    loaded, loaded_objects = torch_dist.load_sharded(tensors, objects, str(checkpoint_dir))

    def value_of(leaf):
        if isinstance(leaf, ShardedTensor):
            return loaded[id(leaf)].to(leaf.dtype)
        if isinstance(leaf, ShardedObject):
            return loaded_objects[leaf.unique_key]
        if isinstance(leaf, LocalNonpersistentObject):
            return leaf.unwrap()
        return _DROP
    values = apply_factory_merges(_rebuild_top(sharded_state_dict, value_of), with_factories)
    return _merge(load_common_state_dict(str(checkpoint_dir)), values)


def load_tensors_metadata(checkpoint_dir, sharded_strategy=None):
    """``{key: ShardedTensor without data}`` of the whole global tensors in the checkpoint."""
    _check_strategy("sharded_strategy", sharded_strategy)
    metadata = torch_dist.read_metadata(str(checkpoint_dir))
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "chunks"):
            shape = tuple(entry.size)
            out[key] = ShardedTensor(key, None, entry.properties.dtype, shape, shape,
                                     (0,) * len(shape), None)
    return out
