"""A HuggingFace model directory on disk: ``config.json`` plus safetensors weights, read and
written with the ``safetensors`` library (no ``transformers`` needed).

Reading takes ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (its
``weight_map`` names the files). Writing produces ``config.json`` and one ``model.safetensors``
(metadata ``{"format": "pt"}``, as ``save_pretrained`` writes) inside a directory that appears
complete or not at all (``staged_directory``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"--from-hf {hf_dir}: no such directory")
    if not os.path.exists(path):
        hint = " (it looks like a tpfuse checkpoint: use --to-hf --load)" if os.path.exists(
            os.path.join(hf_dir, "latest_checkpointed_iteration.txt")) else ""
        raise ValueError(f"{hf_dir} is not a HuggingFace model directory: no config.json{hint}")
    with open(path) as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error


def _weight_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as handle:
            weight_map = json.load(handle).get("weight_map", {})
        return sorted({os.path.join(hf_dir, name) for name in weight_map.values()})
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    others = [n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth", ".h5"))]
    raise ValueError(f"{hf_dir} holds no {SINGLE_FILE} / {INDEX_FILE}"
                     + (f" (only {others[:3]}: re-save it with safe_serialization=True)"
                        if others else ""))


def read_tensors(hf_dir: str) -> dict:
    """Every tensor of the directory's safetensors files, by name (on the CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors = {}
    for path in _weight_files(hf_dir):
        if not os.path.exists(path):
            raise ValueError(f"{INDEX_FILE} names {os.path.basename(path)}, which is missing")
        try:
            tensors.update(load_file(path))
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file: {error}") from error
    return tensors


@contextlib.contextmanager
def staged_directory(target: str):
    """Yield a fresh staging directory next to ``target``; on success it becomes ``target``.

    ``target`` must not exist or be empty (nothing is overwritten); on any error the staging
    directory is removed and ``target`` is left as it was."""
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ValueError(f"--save {target} already exists and is not empty; choose a new "
                         "directory (nothing is overwritten)")
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=parent)
    try:
        yield staging
        if os.path.isdir(target):
            os.rmdir(target)                 # the empty directory we were allowed to fill
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _unshared(tensors: dict) -> dict:
    """Contiguous tensors each owning its storage (safetensors refuses shared memory): views
    into a larger tensor, or a storage seen before, are copied."""
    seen, out = set(), {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        storage = tensor.untyped_storage()
        whole = storage.nbytes() == tensor.numel() * tensor.element_size()
        out[name] = tensor if whole and storage.data_ptr() not in seen else tensor.clone()
        seen.add(storage.data_ptr())
    return out


def write_model(directory: str, config: dict, tensors: dict) -> None:
    """config.json and model.safetensors into ``directory`` (a staging directory)."""
    from safetensors.torch import save_file

    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    save_file(_unshared(tensors), os.path.join(directory, SINGLE_FILE), metadata={"format": "pt"})
