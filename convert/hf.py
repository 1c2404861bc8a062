"""HuggingFace ↔ tpfuse checkpoints: ``import_hf`` (``tpfuse-convert --from-hf``) and
``export_hf`` (``tpfuse-convert --to-hf``).

    HF dir ─config.json→ architecture (model_type: gpt2 | llama | mistral | mixtral | qwen2 |
           qwen2_moe | qwen3 | qwen3_moe | deepseek_v3) → TransformerConfig values
           ─safetensors→ tensors ─architecture→ single-process tpfuse tensors ─pad vocab rows→
           ─tpfuse_io.write_checkpoint→ rank files of the chosen tp × pp layout
    tpfuse ─read_checkpoint (any layout)→ single-process tensors ─trim the padded vocab rows→
           ─architecture chosen from the config→ HF tensors + config.json ─safetensors→ HF dir

Only values move: transposes, the fused-QKV re-layout, zero padding rows added on import and the
same rows dropped on export, so export(import(x)) gives every tensor of x back bit for bit.
Both directions write into a staging directory renamed into place at the end: an error leaves
nothing behind. A ``tokenizer.json`` travels along (and becomes the checkpoint's tokenizer); the
HF config's bos / eos ids are kept in the checkpoint's ``extra`` and written back on export.
"""
from __future__ import annotations

import os
import shutil
import sys

import torch

from tpfuse.models.config import DTYPES, TransformerConfig

from . import deepseek_v3, gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from .common import pad_vocab, trim_vocab
from .hf_io import file_inside, read_config, read_tensors, staged_directory, write_model
from .tpfuse_io import TIED_OUTPUT, WORD, read_checkpoint, write_checkpoint

ARCHITECTURES = {gpt2.MODEL_TYPE: gpt2, llama.MODEL_TYPE: llama, mistral.MODEL_TYPE: mistral,
                 mixtral.MODEL_TYPE: mixtral, qwen2.MODEL_TYPE: qwen2,
                 qwen2_moe.MODEL_TYPE: qwen2_moe, qwen3.MODEL_TYPE: qwen3,
                 qwen3_moe.MODEL_TYPE: qwen3_moe, deepseek_v3.MODEL_TYPE: deepseek_v3}
TOKENIZER_FILE = "tokenizer.json"
PRECISION_FLAGS = {torch.bfloat16: {"bf16": True}, torch.float16: {"fp16": True}}


def architecture_of(hf: dict, where: str):
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: unknown architecture model_type={model_type!r} "
                         f"(architectures={hf.get('architectures')}); tpfuse converts "
                         f"{sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def _common_dtype(tensors: dict, where: str) -> torch.dtype:
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES.values():
        raise ValueError(f"{where}: weights in {sorted(map(str, dtypes))}; give --params-dtype")
    return dtypes.pop()


def import_hf(hf_dir: str, save_dir: str, *, tensor_model_parallel_size: int = 1,
              pipeline_model_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128,
              params_dtype: torch.dtype | None = None) -> TransformerConfig:
    """Write ``save_dir``: a tpfuse checkpoint of the HF model in ``hf_dir`` at tp × pp."""
    hf = read_config(hf_dir)
    architecture = architecture_of(hf, hf_dir)
    values = architecture.config_from_hf(hf)
    tensors = read_tensors(hf_dir)
    dtype = params_dtype or _common_dtype(tensors, hf_dir)
    if values.get("num_moe_experts") is not None and tensor_model_parallel_size > 1:
        values = dict(values, sequence_parallel=True)     # MoE under TP trains with SP
    config = TransformerConfig(**values, tensor_model_parallel_size=tensor_model_parallel_size,
                               pipeline_model_parallel_size=pipeline_model_parallel_size,
                               make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                               params_dtype=dtype, **PRECISION_FLAGS.get(dtype, {}))
    params = {name: t.to(dtype) for name, t in
              architecture.tensors_from_hf(tensors, config, hf_dir).items()}
    for name in (WORD, TIED_OUTPUT):
        if name in params:
            params[name] = pad_vocab(params[name], config.padded_vocab_size)
    tokenizer = os.path.join(hf_dir, TOKENIZER_FILE)
    has_tokenizer = os.path.lexists(tokenizer)
    if has_tokenizer:
        tokenizer = file_inside(hf_dir, TOKENIZER_FILE, "tokenizer")
    extra = {"tokenizer": TOKENIZER_FILE if has_tokenizer else None,
             "bos_id": hf.get("bos_token_id"), "eos_id": hf.get("eos_token_id"),
             "converted_from": f"{hf['model_type']}:{os.path.abspath(hf_dir)}"}
    write_checkpoint(save_dir, config, params, extra,
                     files={TOKENIZER_FILE: tokenizer} if has_tokenizer else None)
    return config


def architecture_for(config):
    """The HF architecture module that can hold ``config``; ValueError saying why none can."""
    reasons = {name: module.mismatches(config) for name, module in ARCHITECTURES.items()}
    for name, problems in reasons.items():
        if not problems:
            return ARCHITECTURES[name]
    detail = "; ".join(f"{name}: {', '.join(problems)}" for name, problems in reasons.items())
    raise ValueError(f"this model has no HuggingFace counterpart tpfuse can write ({detail})")


def _tokenizer_file(load_dir: str, extra: dict) -> str | None:
    """The checkpoint's tokenizer.json when it lies inside ``load_dir`` (a regular file named
    relative to it); a tokenizer recorded elsewhere (an absolute path, ``..``, a symlink out) is
    not copied — the export never copies a file the user did not name — and a note says so."""
    spec = extra.get("tokenizer")
    if not spec or spec == "byte" or spec.startswith(("null:", "{")):
        return None          # built in, or Megatron's tokenizer flags (files the user named)
    try:
        return file_inside(load_dir, spec, "the checkpoint's tokenizer")
    except FileNotFoundError:
        return None
    except ValueError as error:
        print(f"> note: {error}; not copied into the export (copy the tokenizer.json you mean "
              "yourself)", file=sys.stderr, flush=True)
        return None


def _eos_id(extra: dict, load_dir: str, vocab_size: int, tokenizer_file: str | None):
    """The checkpoint's eos id, else its tokenizer's EOD (a tokenizer file only when it lies
    inside ``load_dir``: ``tokenizer_file``; Megatron's tokenizer flags, a JSON spec, rebuilt from
    the files they name, None when those are gone)."""
    if extra.get("eos_id") is not None:
        return extra["eos_id"]
    from tpfuse.checkpoint.reading import load_tokenizer
    from tpfuse.data.tokenizer import build_tokenizer

    spec = extra.get("tokenizer")
    if spec and spec.startswith("{"):
        try:
            tokenizer = load_tokenizer(load_dir)
        except (OSError, ValueError) as error:
            print(f"> note: the checkpoint's tokenizer could not be rebuilt ({error}); "
                  "eos_token_id is left unset", flush=True)
            return None
    elif spec and spec != "byte" and not spec.startswith("null:"):
        if tokenizer_file is None:
            return None
        tokenizer = build_tokenizer(tokenizer_file)
    else:
        tokenizer = load_tokenizer(load_dir)
    return tokenizer.eod if tokenizer is not None and tokenizer.eod < vocab_size else None


def export_hf(load_dir: str, save_dir: str) -> dict:
    """Write ``save_dir``: the tpfuse checkpoint ``load_dir`` (any layout) as a HF model."""
    config, params, extra = read_checkpoint(load_dir)
    architecture = architecture_for(config)
    for name in (WORD, TIED_OUTPUT):
        if name in params:
            params[name] = trim_vocab(params[name], config.vocab_size)
    tensors = architecture.tensors_to_hf(params, config)
    tokenizer = _tokenizer_file(load_dir, extra)
    eos = _eos_id(extra, load_dir, config.vocab_size, tokenizer)
    hf = architecture.config_to_hf(config, eos)
    hf["bos_token_id"] = extra.get("bos_id", eos)
    hf["torch_dtype"] = next(name for name, d in DTYPES.items() if d == config.params_dtype)
    with staged_directory(save_dir) as staging:
        write_model(staging, hf, tensors)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, os.path.join(staging, TOKENIZER_FILE))
    return hf
