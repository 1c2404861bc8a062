"""A checkpoint read by one process without any training state (inference, conversion).

``checkpoint_folder(dir)`` → (folder, verified reader) of the newest complete checkpoint;
``read_checkpoint_head(dir)`` → rank 0's payload (what every rank file shares: the model config,
``extra``); ``load_tokenizer(dir)`` → the tokenizer the checkpoint records, or None. Local: no
collective, so any subset of ranks may read.
"""
from __future__ import annotations

import os

from . import format as ckpt


def checkpoint_folder(checkpoint_dir: str):
    """(folder, verified reader) of the newest complete checkpoint: the reader checks each rank
    file against the manifest's size and sha256 (``format.verified_reader``)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
    iteration = ckpt.latest_iteration(checkpoint_dir)
    if iteration is None:
        raise FileNotFoundError(f"{checkpoint_dir} holds no complete tpfuse checkpoint (no "
                                f"{ckpt.TRACKER})")
    folder, manifest = ckpt.read_manifest(checkpoint_dir, iteration)
    return folder, ckpt.verified_reader(manifest)


def read_checkpoint_head(checkpoint_dir: str) -> dict:
    """Rank 0's payload of the newest checkpoint (verified; what every rank file shares); of a
    torch_dist checkpoint the same entries from its common.pt."""
    from . import torch_dist_format

    dist_folder = torch_dist_format.checkpoint_dir_of(checkpoint_dir) \
        if os.path.isdir(checkpoint_dir) else None
    if dist_folder is not None:
        return torch_dist_format.read_head(dist_folder)
    folder, read = checkpoint_folder(checkpoint_dir)
    return read(os.path.join(folder, "rank_00000.pt"), mmap=True)


def load_tokenizer(checkpoint_dir: str):
    """The tokenizer the checkpoint records (``extra["tokenizer"]``), or None when it has none.

    A relative tokenizer.json path is taken relative to ``checkpoint_dir``; a JSON spec (Megatron's
    tokenizer flags) names its files by absolute paths."""
    from tpfuse.data.tokenizer import build_tokenizer

    spec = (read_checkpoint_head(checkpoint_dir).get("extra") or {}).get("tokenizer")
    if spec is None:
        return None
    if spec != "byte" and not spec.startswith(("null:", "{")) and not os.path.isabs(spec):
        spec = os.path.join(checkpoint_dir, spec)
    return build_tokenizer(spec)
