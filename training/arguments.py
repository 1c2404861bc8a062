"""Megatron-style command-line flags: the model's (TransformerConfig) plus the trainer's settings.

``parse_args(argv, defaults)`` returns ``(config, settings)``: ``config`` is the validated
TransformerConfig, ``settings`` the validated ``TrainerSettings`` (``training/settings.py``: one
frozen dataclass per concern, ``settings.training.micro_batch_size``, ``settings.data.split``,
...; ``settings.tokenizer`` the tokenizer built from them). Flags map to fields by dash ↔
underscore, with Megatron's names (``--micro-batch-size`` ↔ ``micro_batch_size``); the parser is
built from the fields (``settings_fields.add_group_arguments``), one argument group per settings
group, so ``--help`` lists them by concern.

Every flag defaults to Megatron-LM's default (``megatron/training/arguments.py``), so a Megatron
command line means the same here; Megatron's required settings (``--micro-batch-size``,
``--train-iters`` or ``--train-samples``, ``--lr``, the model shape) are required. Precedence,
lowest first: those defaults, the caller's ``defaults`` (Megatron's ``args_defaults``), a
``--preset`` (``training/presets.py``), the command line; a default or preset naming no flag is an
error. Deliberate differences: ``--distributed-backend`` defaults to nccl only where CUDA is
available (gloo otherwise); ``--ckpt-format`` defaults to ``tpfuse`` (the per-rank format,
so existing runs and checkpoints are unchanged; Megatron-LM's default is ``torch_dist``, chosen
with ``--ckpt-format torch_dist``), and Megatron's ``torch`` (``mp_rank_XX/model_optim_rng.pt``)
is not offered, as no tpfuse format is that one — ``--load`` reads either of the two; and the
trainer's own additions (``--preset``, ``--metrics-file``,
``--keep-last-checkpoints``, ``--peak-tflops``, ...) are listed by ``tpfuse-train --help-trainer``.

Validation happens here, on every rank before any process group exists, each error naming the
flag: the model's float flags finite, then each settings group at construction (its own fields
finite, in range, ...), the rules across groups, the tokenizer, the model config.

The tokenizer (``--tokenizer-type``) is built here, because it fixes the model's vocabulary:
``config.vocab_size`` is the tokenizer's size (EOD included), as Megatron pads
``tokenizer.vocab_size``. Mock data without ``--tokenizer-type`` uses ``NullTokenizer`` sized by
``--vocab-size``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys

from tpfuse.models.cli import add_config_arguments, config_from_args
from tpfuse.models.config import config_fields
from tpfuse.training import presets
from tpfuse.training.fsdp import check_fsdp_layout
from tpfuse.training.precision_args import check_model_precision
from tpfuse.training.sample_args import check_sample_prompt
from tpfuse.training.settings import (DEFAULT_SPLIT, GROUPS, DataSettings, TrainerSettings,
                                      comm_options_from_args, field_owners)

__all__ = ["build_parser", "parse_args", "parse_namespace", "settings_from_namespace",
           "build_tokenizer", "comm_options_from_args"]
from tpfuse.training.settings_fields import add_group_arguments, unknown_setting_error


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """``--preset`` and one argument group per settings group (``training/settings.py``)."""
    presets.add_preset_argument(parser)
    for cls in GROUPS.values():
        add_group_arguments(parser, cls)


def build_parser(prog: str = "tpfuse.pretrain_gpt") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Pretrain a GPT with tpfuse.",
                                     allow_abbrev=False)
    add_config_arguments(parser)
    add_training_arguments(parser)
    return parser


# ---------------------------------------------------------------------------- tokenizer
def build_tokenizer(data: DataSettings, vocab_size: int | None):
    """The tokenizer ``--tokenizer-type`` names (NullTokenizer of ``--vocab-size`` for mock data
    without one), built from Megatron's tokenizer flags (``data/tokenizer_options.py``)."""
    from dataclasses import asdict

    from tpfuse.data.tokenizer_options import TokenizerOptions, build_megatron_tokenizer

    kind = data.tokenizer_type or ("NullTokenizer" if data.mock_data else None)
    if kind is None:
        raise ValueError("--tokenizer-type is required with --data-path (NullTokenizer, "
                         "ByteTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, TikTokenizer "
                         "or HuggingFaceTokenizer with their files)")
    return build_megatron_tokenizer(TokenizerOptions.from_values(
        asdict(data), tokenizer_type=kind, vocab_size=vocab_size))


def model_vocab_size(data: DataSettings, given: int | None, tokenizer) -> int:
    """The model's vocabulary is the tokenizer's (Megatron: padded from tokenizer.vocab_size)."""
    if data.tokenizer_type not in (None, "NullTokenizer") and given not in (None,
                                                                            tokenizer.vocab_size):
        raise ValueError(f"--vocab-size {given} disagrees with --tokenizer-type "
                         f"{data.tokenizer_type} ({tokenizer.vocab_size} ids); omit --vocab-size "
                         f"(the tokenizer defines the vocabulary)")
    return tokenizer.vocab_size


# ---------------------------------------------------------------------------- parsing
def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _known_defaults(values: dict, source: str) -> dict:
    """``values`` (argparse dests) when every name is a flag's, else a ValueError naming the
    unknown one and where it came from."""
    known = {**field_owners(), **{f.name: "model" for f in config_fields()}, "preset": ""}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{source}: {unknown_setting_error(unknown[0], known)}")
    return values


def _check_finite(namespace) -> None:
    """Every float flag of the model is a finite number (the settings groups check their own)."""
    model = {f.name for f in config_fields()}
    for name, value in sorted(vars(namespace).items()):
        if name in model and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_flag(name)} must be a finite number, got {value}")


def _default_split(namespace) -> None:
    if namespace.split is None:
        if namespace.data_path and _is_rank_zero():
            print(f"WARNING: --split not given with --data-path; using Megatron's legacy default "
                  f"{DEFAULT_SPLIT}", flush=True)
        namespace.split = DEFAULT_SPLIT


def settings_from_namespace(namespace) -> TrainerSettings:
    """The TrainerSettings of a parsed namespace (its model flags are the config's)."""
    model = {f.name for f in config_fields()}
    values = {k: v for k, v in vars(namespace).items() if k not in model and k != "preset"}
    return TrainerSettings.from_values(values, preset=namespace.preset)


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$", re.IGNORECASE)


def join_negative_values(argv: list[str]) -> list[str]:
    """``--flag -1e-3`` → ``--flag=-1e-3``: argparse reads a value like ``-1e-3`` (an exponent)
    as an option, so a flag given a negative number in the spaced form would fail with "expected
    one argument" (and the number's own check — e.g. ``--lr must be > 0`` — never speak)."""
    joined = []
    for token in argv:
        previous = joined[-1] if joined else ""
        if _NEGATIVE_NUMBER.match(token) and previous.startswith("--") and "=" not in previous:
            joined[-1] = f"{previous}={token}"
        else:
            joined.append(token)
    return joined


def parse_namespace(argv=None, defaults: dict | None = None) -> argparse.Namespace:
    """argparse's namespace of ``argv`` over Megatron's defaults, ``defaults`` and the preset."""
    parser = build_parser()
    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    if defaults:
        parser.set_defaults(**_known_defaults(defaults, "pretrain's args_defaults"))
    preset = presets.preset_from_argv(argv)
    if preset is not None:
        parser.set_defaults(**_known_defaults(preset.flags, f"preset {preset.name}"))
    namespace = parser.parse_args(argv)
    if preset is not None:
        presets.fill_preset_data(namespace, preset)
        given = sys.argv[1:] if argv is None else argv
        for note in (presets.fit_interleaving(namespace, preset, given),
                     presets.fit_run_length(namespace, preset, given)):
            if note and _is_rank_zero():
                print(note, flush=True)
    return namespace


CHECKPOINT_SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "normalization", "layernorm_epsilon", "activation",
    "position_embedding_type", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
    "window_size", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor")


def apply_checkpoint_args(namespace) -> None:
    """``--use-checkpoint-args``: the shape fields above from ``--load``'s recorded model config.

    ``--seq-length`` stays this run's, and the vocabulary is the tokenizer's (as without the flag;
    loading refuses a different real vocabulary by name). ``max_position_embeddings``: a learned position table is
    a weight, so the checkpoint's limit is kept (and the config checks seq_length against it);
    rotary positions have no table, so the limit becomes max(checkpoint's, --seq-length) and a
    converted rotary model trains at any sequence length."""
    from tpfuse.checkpoint import megatron_lm, torch_dist_format
    from tpfuse.checkpoint.reading import read_checkpoint_head

    megatron = torch_dist_format.megatron_lm_common(namespace.load)
    try:
        saved = megatron_lm.model_config_of(megatron["args"]) if megatron is not None else \
            read_checkpoint_head(namespace.load).get("model_config")
    except FileNotFoundError as error:
        raise ValueError(f"--use-checkpoint-args: {error}") from None
    if saved is None:
        raise ValueError(f"--use-checkpoint-args: checkpoint {namespace.load} records no model "
                         "config (written by an older tpfuse); give the model flags")
    for name in CHECKPOINT_SHAPE_FIELDS:
        if name in saved and hasattr(namespace, name):
            value = saved[name]
            setattr(namespace, name, tuple(value) if name == "window_size" and value else value)
    limit = saved.get("max_position_embeddings") or saved.get("seq_length")
    if saved.get("position_embedding_type") == "rope":
        limit = max(limit, namespace.seq_length)
    namespace.max_position_embeddings = limit


def check_megatron_checkpoint(settings, config) -> None:
    """``--load`` of a checkpoint Megatron-LM's training wrote: its ``args`` give this run's
    model shape (Megatron's check_checkpoint_args; not with --finetune) and, without
    --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler / --no-load-optim, its
    lr schedule is this run's (megatron-core's OptimizerParamScheduler check); without
    --no-load-optim its optimizer state is one tpfuse reads. A ValueError naming the flag."""
    from tpfuse.checkpoint import megatron_lm, torch_dist_format

    load, scheduler = settings.checkpoint.load, settings.scheduler
    common = torch_dist_format.megatron_lm_common(load) if load else None
    if common is None or settings.checkpoint.finetune:
        return
    mismatch = megatron_lm.checkpoint_args_mismatch(common["args"], config)
    if mismatch is not None:
        flag, mine, name, saved = mismatch
        raise ValueError(f"--load {load}: {flag} {mine} does not match the checkpoint's {name} "
                         f"{saved} (Megatron's check_checkpoint_args): give {flag} {saved}, or "
                         "--use-checkpoint-args to take the model's shape from the checkpoint")
    if not settings.checkpoint.no_load_optim:
        try:
            torch_dist_format.check_megatron_optimizer(load, common)
        except ValueError as error:
            raise ValueError(f"--load {load}: {error}") from None
    saved = common.get("opt_param_scheduler")
    if not isinstance(saved, dict) or scheduler.override_opt_param_scheduler or \
            scheduler.use_checkpoint_opt_param_scheduler or settings.checkpoint.no_load_optim:
        return
    from tpfuse.training.train_samples import lr_schedule

    warmup, decay, unit = lr_schedule(settings.training, scheduler)
    try:
        state = megatron_lm.scheduler_state(saved, common["args"], unit)
    except ValueError as error:
        raise ValueError(f"--load {load}: {error}") from None
    run = {"max_lr": scheduler.lr, "min_lr": scheduler.min_lr, "warmup_steps": warmup,
           "decay_steps": decay, "decay_style": scheduler.lr_decay_style}
    differs = megatron_lm.scheduler_mismatch(state, run)
    if differs is not None:
        name, mine, saved_value = differs
        raise ValueError(f"--load {load}: the checkpoint's lr schedule has {name} {saved_value}, "
                         f"this run's flags give {mine} (megatron-core's OptimizerParamScheduler "
                         "check): pass --override-opt_param-scheduler to keep this run's "
                         "schedule, or --use-checkpoint-opt_param-scheduler to take the "
                         "checkpoint's")


def _check_fsdp_device(distributed) -> None:
    """FSDP's collectives (DTensor, functional collectives) are dispatched in C++ and are not
    routed through the host-staged gloo group that ``--device cuda`` on gloo joins, so that
    combination is refused rather than left to fail inside ``fully_shard``."""
    if distributed.device == "cuda" and distributed.distributed_backend == "gloo":
        raise ValueError("--use-torch-fsdp2 with --device cuda --distributed-backend gloo is not "
                         "supported (FSDP's collectives do not go through the host-staged gloo "
                         "group); use --distributed-backend nccl, or --device cpu")


def parse_args(argv=None, defaults: dict | None = None):
    """``(config, settings)``: the TransformerConfig and the TrainerSettings of ``argv``, both
    validated; ``settings.tokenizer`` holds the built tokenizer."""
    namespace = parse_namespace(argv, defaults)
    if getattr(namespace, "use_checkpoint_args", False) and namespace.load:
        apply_checkpoint_args(namespace)
    _check_finite(namespace)
    _default_split(namespace)
    settings = settings_from_namespace(namespace)
    check_model_precision(settings.precision, bf16=namespace.bf16)
    tokenizer = build_tokenizer(settings.data, namespace.vocab_size)
    namespace.vocab_size = model_vocab_size(settings.data, namespace.vocab_size, tokenizer)
    config = config_from_args(namespace)
    check_megatron_checkpoint(settings, config)
    if settings.data_parallel.use_torch_fsdp2:
        check_fsdp_layout(config)
        _check_fsdp_device(settings.distributed)
    check_sample_prompt(settings.sample, tokenizer, config)
    return config, dataclasses.replace(settings, tokenizer=tokenizer)
