"""A HuggingFace model directory on disk: ``config.json`` plus safetensors weights, read and
written with the ``safetensors`` library (no ``transformers`` needed).

Reading takes ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (its
``weight_map`` names the files). Only regular files inside the given directory are read
(``file_inside``): a name that is absolute or holds ``..``, or a symlink leading out of the
directory, is refused by name — so a hostile model directory cannot make the converter read (and
copy into its output) a file the user did not name. Every tensor is named once across the files
and finite (NaN / inf weights are refused with their name); the config's numeric fields are
checked by name (``check_config_fields``). Writing produces ``config.json`` and one ``model.safetensors``
(metadata ``{"format": "pt"}``, as ``save_pretrained`` writes) inside a directory that appears
complete or not at all (``staged_directory``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile

from tpfuse.parallel.checks import is_int, is_real

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


CONFIG_FILE = "config.json"
# numeric config.json fields: (suffix or name, must be an integer, must be > 0)
_INTEGER_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                   "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
                   "n_embd", "n_head", "n_layer", "n_positions", "n_inner", "n_ctx")
_REAL_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "initializer_range")
_PROBABILITY_FIELDS = ("attention_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")


def file_inside(folder: str, name, what: str) -> str:
    """``folder/name`` when ``name`` is a relative path without ``..`` naming a regular file whose
    real path (symlinks followed) lies inside ``folder``'s; ValueError naming ``what`` otherwise.
    FileNotFoundError when there is no such file."""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else None
    if not parts or not name or os.path.isabs(name) or ".." in parts:
        raise ValueError(f"{what} {name!r} is not a file name inside {folder} (absolute paths and "
                         "'..' are refused)")
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{what} {path} is missing")
    real_folder, real = os.path.realpath(folder), os.path.realpath(path)
    if os.path.commonpath([real_folder, real]) != real_folder:
        raise ValueError(f"{what} {path} is a symlink leading out of {folder} (to {real}); "
                         "refusing to read it (give a directory of real files, e.g. "
                         "`huggingface-cli download --local-dir`)")
    if not os.path.isfile(real):
        raise ValueError(f"{what} {path} is not a regular file; refusing to read it")
    return path


def check_config_fields(hf: dict, path: str) -> None:
    """ValueError naming the first numeric field of ``hf`` of the wrong kind: a size that is not
    a positive integer, an epsilon / base / std that is not a positive finite number, a dropout
    outside [0, 1)."""
    def bad(key, need):
        raise ValueError(f"{path}: field {key!r} = {hf[key]!r} must be {need}")

    for key in _INTEGER_FIELDS:
        value = hf.get(key)
        if value is not None and (not is_int(value) or value <= 0):
            bad(key, "a positive integer")
    for key in _REAL_FIELDS:
        value = hf.get(key)
        if value is not None and (not is_real(value) or not math.isfinite(value) or value <= 0):
            bad(key, "a positive finite number")
    for key in _PROBABILITY_FIELDS:
        value = hf.get(key)
        if value is not None and (not is_real(value) or not 0 <= value < 1):
            bad(key, "a number in [0, 1)")
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            bad(key, "an object or null")


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"--from-hf {hf_dir}: no such directory")
    if not os.path.lexists(path):
        hint = " (it looks like a tpfuse checkpoint: use --to-hf --load)" if os.path.exists(
            os.path.join(hf_dir, "latest_checkpointed_iteration.txt")) else ""
        raise ValueError(f"{hf_dir} is not a HuggingFace model directory: no config.json{hint}")
    with open(file_inside(hf_dir, CONFIG_FILE, "config file")) as handle:
        try:
            config = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    check_config_fields(config, path)
    return config


def _weight_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.lexists(index):
        with open(file_inside(hf_dir, INDEX_FILE, "weight index")) as handle:
            try:
                weight_map = json.load(handle).get("weight_map", {})
            except (json.JSONDecodeError, AttributeError) as error:
                raise ValueError(f"{index} is not a JSON object with a weight_map: "
                                 f"{error}") from error
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map is not an object")
        return sorted({file_inside(hf_dir, name, f"{INDEX_FILE} entry")
                       for name in weight_map.values()})
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.lexists(single):
        return [file_inside(hf_dir, SINGLE_FILE, "weight file")]
    others = [n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth", ".h5"))]
    raise ValueError(f"{hf_dir} holds no {SINGLE_FILE} / {INDEX_FILE}"
                     + (f" (only {others[:3]}: re-save it with safe_serialization=True)"
                        if others else ""))


def read_tensors(hf_dir: str) -> dict:
    """Every tensor of the directory's safetensors files, by name (on the CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors, source = {}, {}
    for path in _weight_files(hf_dir):
        try:
            loaded = load_file(path)
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file: {error}") from error
        for name, tensor in loaded.items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both {source[name]} and {path}; "
                                 "a tensor must be named once")
            if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
                raise ValueError(f"{path}: tensor {name!r} holds non-finite values (NaN/inf)")
            tensors[name], source[name] = tensor, path
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
