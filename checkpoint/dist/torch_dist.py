"""Megatron's ``torch_dist`` checkpoint layout written and read with torch.distributed.checkpoint.

Files in the checkpoint directory (as megatron-core 0.16 writes them)::

    metadata.json      {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                        "common_backend": "torch", "common_backend_version": 1}
    .metadata          torch.distributed.checkpoint's index: every global tensor by key (its
                       global size, dtype and the chunks it was written in), every object
    __<rank>_<i>.distcp the chunks' bytes
    common.pt          the entries that are neither ShardedTensor nor ShardedObject (rank 0)

A ShardedTensor is stored under its ``key`` as the chunk ``global_offset`` +
``(1,)·prepend_axis_num + local_shape`` of the global tensor (main replicas only); a
ShardedObject as the pickled one-element list ``[data]`` (Megatron's form) under its
``unique_key``. tpfuse adds, in the index's
``planner_data``, a CRC-32 of every chunk it wrote; a chunk whose bytes no longer match is
refused at load with the tensor's key (checkpoints written elsewhere carry none: not checked).

Loading reads, for every requested piece, the stored chunks it overlaps (each whole, once per
rank), checks their CRC, and copies the overlaps: so a tensor saved in one tp × pp layout loads
into another. Every check (a key the checkpoint lacks, another global shape, a piece the stored
chunks do not cover, a corrupted chunk) raises a CheckpointingException naming the key — on
every rank, agreed before the next collective, even when only one rank reads the bad chunk.
"""
from __future__ import annotations

import io
import zlib
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (BytesIOWriteData, LoadItemType, LoadPlan,
                                                  ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)

from .core import CheckpointingException
from .safe_loading import object_safe_globals

CRC_KEY = "tpfuse_chunk_crc32"


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _chunk_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() \
        if tensor.numel() else b""


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(_chunk_bytes(tensor))


def _chunk_id(key: str, offsets) -> str:
    return f"{key}@{'.'.join(map(str, offsets))}"


# ----------------------------------------------------------------------------------- save
class _SavePlanner(DefaultSavePlanner):
    """Writes the given chunks (``{(key, offsets): (tensor, global_size)}``) and objects."""

    def __init__(self, chunks: dict, objects: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.objects = chunks, objects

    def create_local_plan(self) -> SavePlan:
        items, crcs = [], {}
        for (key, offsets), (tensor, size) in self.chunks.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk,
                                            properties=TensorProperties.create_from_tensor(tensor),
                                            size=torch.Size(size))))
            crcs[_chunk_id(key, offsets)] = _crc(tensor)
        for key, value in self.objects.items():
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO,
                                   bytes_io_data=BytesIOWriteData(nbytes=0)))
        self.plan = SavePlan(items, planner_data={CRC_KEY: crcs})
        return self.plan

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(
            [SavePlan(p.items, planner_data=None) for p in all_plans])
        crcs = {}
        for plan in all_plans:
            crcs.update(plan.planner_data[CRC_KEY])
        metadata.planner_data = {CRC_KEY: crcs}
        self.metadata = metadata
        return plans, metadata

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self.objects[write_item.index.fqn]], buffer)   # Megatron: a list
            buffer.seek(0)
            return buffer
        key = (write_item.index.fqn, tuple(write_item.index.offset))
        return self.chunks[key][0]


def save_sharded(tensors: list, objects: list, checkpoint_dir: str, process_group=None) -> None:
    """Collective (over ``process_group``, default the world): write the main replicas of
    ``tensors`` (ShardedTensor) and ``objects``."""
    chunks = {}
    for sh in tensors:
        key = (sh.key, tuple(sh.global_offset))
        chunks[key] = (sh.data.detach().reshape(sh.chunk_sizes()).contiguous(), sh.global_shape)
    by_key = {sh.unique_key: sh.data for sh in objects}
    dcp_save({}, storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1),
             planner=_SavePlanner(chunks, by_key), process_group=process_group,
             no_dist=not _distributed())


# ----------------------------------------------------------------------------------- load
@dataclass
class _Stored:
    """One stored chunk this rank reads whole."""
    key: str
    offsets: tuple
    sizes: tuple
    buffer: torch.Tensor


def _overlap(a_off, a_size, b_off, b_size):
    """Per axis (start, length) of the intersection of two boxes, None when empty."""
    box = []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        box.append((lo, hi - lo))
    return box


def _narrow(tensor, offsets, box):
    for axis, ((start, length), origin) in enumerate(zip(box, offsets)):
        tensor = tensor.narrow(axis, start - origin, length)
    return tensor


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self, stored: list, objects: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.stored, self.objects, self.loaded_objects = stored, objects, {}
        self._by_id = {(s.key, s.offsets): s for s in stored}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for s in self.stored:
            index = MetadataIndex(s.key, torch.Size(s.offsets))
            zeros = torch.Size([0] * len(s.offsets))
            items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=zeros,
                                  storage_index=index, storage_offsets=zeros,
                                  lengths=torch.Size(s.sizes)))
        for key in self.objects:
            index = MetadataIndex(key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=(0,),
                                  storage_index=index, storage_offsets=(0,), lengths=(0,)))
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem):
        return self._by_id[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))].buffer

    def commit_tensor(self, read_item, tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value) -> None:
        with torch.serialization.safe_globals(object_safe_globals()):
            stored = torch.load(value, weights_only=True)
        if not (isinstance(stored, list) and len(stored) == 1):
            raise CheckpointingException(f"object {read_item.dest_index.fqn!r}: expected "
                                         "Megatron's one-element list, got "
                                         f"{type(stored).__name__}")
        self.loaded_objects[read_item.dest_index.fqn] = stored[0]


def read_metadata(checkpoint_dir: str):
    return FileSystemReader(checkpoint_dir).read_metadata()


def _check_request(sh, metadata) -> TensorStorageMetadata:
    entry = metadata.state_dict_metadata.get(sh.key)
    if entry is None:
        raise CheckpointingException(f"tensor {sh.key!r} is not in the checkpoint")
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointingException(f"{sh.key!r} is stored as an object, not a tensor")
    if tuple(entry.size) != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
        raise CheckpointingException(
            f"tensor {sh.key!r}: the checkpoint's global shape {tuple(entry.size)} != the "
            f"model's {tuple(sh.global_shape)}")
    return entry


def _plan_reads(tensors, metadata):
    """The stored chunks to read whole, and per request its (stored chunk, box) overlaps."""
    stored, overlaps = {}, []
    for sh in tensors:
        entry = _check_request(sh, metadata)
        sizes, covered, pieces = sh.chunk_sizes(), 0, []
        for chunk in entry.chunks:
            box = _overlap(sh.global_offset, sizes, chunk.offsets, chunk.sizes)
            if box is None:
                continue
            ident = (sh.key, tuple(chunk.offsets))
            if ident not in stored:
                stored[ident] = _Stored(sh.key, tuple(chunk.offsets), tuple(chunk.sizes),
                                        torch.empty(tuple(chunk.sizes),
                                                    dtype=entry.properties.dtype))
            pieces.append((stored[ident], box))
            volume = 1
            for _, length in box:
                volume *= length
            covered += volume
        wanted = 1
        for s in sizes:
            wanted *= s
        if covered != wanted:
            raise CheckpointingException(
                f"tensor {sh.key!r}: the checkpoint's chunks cover {covered} of the {wanted} "
                f"elements of this rank's piece at {tuple(sh.global_offset)}")
        overlaps.append((sh, pieces))
    return list(stored.values()), overlaps


def _verify(stored: list, metadata) -> None:
    crcs = (metadata.planner_data or {}).get(CRC_KEY) if isinstance(metadata.planner_data,
                                                                    dict) else None
    if not crcs:
        return
    for s in stored:
        expected = crcs.get(_chunk_id(s.key, s.offsets))
        if expected is not None and _crc(s.buffer) != expected:
            raise CheckpointingException(
                f"tensor {s.key!r}: the stored chunk at {s.offsets} is corrupted (its CRC-32 "
                "differs from the one recorded at save)")


def _agree(error: Exception | None) -> None:
    """Every rank raises when any rank found a problem (before the next collective), with the
    first rank's message: a bad chunk seen only by its readers still stops everyone."""
    if _distributed():
        found = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, None if error is None else str(error))
        first = next((m for m in found if m is not None), None)
        if first is not None and error is None:
            raise CheckpointingException(f"another rank refused the checkpoint: {first}")
    if error is not None:
        raise error


def _attempt(fn, *args):
    try:
        return fn(*args), None
    except CheckpointingException as error:
        return None, error


def load_sharded(tensors: list, objects: list, checkpoint_dir: str):
    """``({id(sh): loaded tensor}, {unique_key: object})`` for this rank's requests."""
    metadata = read_metadata(checkpoint_dir)
    planned, error = _attempt(_plan, tensors, objects, metadata)
    _agree(error)
    stored, overlaps = planned
    planner = _LoadPlanner(stored, {sh.unique_key: sh for sh in objects})
    try:
        dcp_load({}, storage_reader=FileSystemReader(checkpoint_dir), planner=planner,
                 no_dist=not _distributed())
    except (Exception, CheckpointException) as error:   # DCP's is a BaseException
        keys = sorted({s.key for s in stored} | {sh.key for sh in objects})
        raise CheckpointingException(
            f"reading the checkpoint's chunks of {keys[:4]}{'...' if len(keys) > 4 else ''} "
            f"failed: {type(error).__name__}: {error}") from error
    _, error = _attempt(_verify, stored, metadata)
    _agree(error)
    loaded = {}
    for sh, pieces in overlaps:
        out = torch.empty(sh.chunk_sizes(), dtype=sh.dtype)
        for s, box in pieces:
            _narrow(out, sh.global_offset, box).copy_(_narrow(s.buffer, s.offsets, box))
        loaded[id(sh)] = out.reshape(sh.local_shape)
    return loaded, planner.loaded_objects


def _plan(tensors, objects, metadata):
    for sh in objects:
        entry = metadata.state_dict_metadata.get(sh.unique_key)
        if not isinstance(entry, BytesStorageMetadata):
            raise CheckpointingException(f"object {sh.unique_key!r} is not in the checkpoint")
    return _plan_reads(tensors, metadata)
