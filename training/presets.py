"""Named presets: one complete training job under one name (``--preset NAME``).

Every trainer flag defaults to Megatron-LM's default; a preset replaces those defaults with its
own values, and flags given on the command line override the preset::

    tpfuse-train                                    # no arguments: --preset stdlib-demo
    tpfuse-train --preset stdlib-demo --train-iters 20 --nproc-per-node 2 \\
                 --tensor-model-parallel-size 1 --no-sequence-parallel

A preset acts on argparse's namespace, before the settings are built and validated from it
(``arguments.parse_args``); its flag names must be settings or TransformerConfig fields. A preset's
pipeline interleaving yields to a command line whose layout has no room for it (see
``fit_interleaving``); sequence parallelism at tp = 1 is switched off by the config, as Megatron
does.

``stdlib-demo`` (the README's main job): a small GPT (8 layers, hidden 128) trained on the Python
standard library's own ``*.py`` files with the byte tokenizer, on 8 processes laid out as tp=2
(sequence parallel) × pp=2 (2 virtual stages each) × dp=2. Its corpus is tokenized once into
``<cache>/stdlib_byte.{bin,idx}`` (cache: ``--data-cache-path``, else ``$TPFUSE_CACHE``, else
``~/.cache/tpfuse``), under a file lock so concurrent ranks or jobs build it once.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import sysconfig
from dataclasses import dataclass, field

CORPUS_NAME = "stdlib_byte"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    flags: dict = field(default_factory=dict)   # argparse dest (a settings/config field) -> value
    nproc_per_node: int = 1                      # the launcher's process count
    stdlib_corpus: bool = False                  # train on the standard library unless data given


STDLIB_DEMO = Preset(
    name="stdlib-demo",
    description="8-layer GPT (hidden 128) on the Python standard library's sources, byte "
                "tokenizer, tp2 (SP) x pp2 (vpp2) x dp2 on 8 processes",
    flags={
        "num_layers": 8, "hidden_size": 128, "num_attention_heads": 8, "seq_length": 128,
        "max_position_embeddings": 128, "tokenizer_type": "ByteTokenizer",
        "position_embedding_type": "rope",    # learns faster than learned positions here
        "make_vocab_size_divisible_by": 64,   # 257 ids pad to 384 at tp=2 (128 would give 512)
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "num_layers_per_virtual_pipeline_stage": 2, "sequence_parallel": True,
        # 240 steps of 16 samples: the tokens of 120 steps of 32 in the same time (2 micro-batches
        # per replica cost no more on 2 oversubscribed cores), twice the updates: validation loss
        # 1.84 instead of 2.50 (a 10-step warm-up stalls it near 2.4)
        "micro_batch_size": 4, "global_batch_size": 16, "train_iters": 240,
        "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 20, "lr_decay_style": "cosine",
        "adam_beta2": 0.95, "split": "969,30,1",
        "eval_interval": 40, "eval_iters": 4, "eval_at_start": True, "log_interval": 20,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        # ends with a sample of the model, drawn (seeded): greedy decoding of a model this small
        # repeats its likeliest byte, a space
        "sample_prompt": "    def __init__(self", "sample_max_new_tokens": 96,
        "sample_temperature": 0.8, "sample_top_k": 10, "sample_seed": 1234,
    },
    nproc_per_node=8,
    stdlib_corpus=True,
)
PRESETS = {preset.name: preset for preset in (STDLIB_DEMO,)}
DEFAULT_PRESET = STDLIB_DEMO.name   # what a command with no arguments runs


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="start from a named job's settings; other flags override them "
                             f"({'; '.join(f'{p.name}: {p.description}' for p in PRESETS.values())})")


def preset_from_argv(argv) -> Preset | None:
    """The preset ``--preset NAME`` in ``argv`` names (None without one)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_preset_argument(parser)
    known, _ = parser.parse_known_args(argv)
    return None if known.preset is None else PRESETS[known.preset]


VPP_FLAG = "--num-layers-per-virtual-pipeline-stage"


def fit_interleaving(namespace, preset: Preset, argv: list[str]) -> str | None:
    """Drop the preset's pipeline interleaving where the command line's layout leaves no room
    for it; returns the note saying so (None when nothing changed).

    A preset's ``num_layers_per_virtual_pipeline_stage`` belongs to its own pipeline layout. When
    the command line does not set it but changes the layout so that it no longer fits
    (``--pipeline-model-parallel-size 1``, layers per stage not a multiple of it, or its own
    ``--num-virtual-stages-per-pipeline-rank`` / uneven first-last stages), the job runs without
    the preset's interleaving instead of failing on a setting the user never gave. Given on the
    command line, the flag is the user's and is validated as such.
    """
    value = preset.flags.get("num_layers_per_virtual_pipeline_stage")
    if value is None or any(a.split("=", 1)[0] == VPP_FLAG for a in argv):
        return None
    pp, layers = namespace.pipeline_model_parallel_size, namespace.num_layers
    own_split = (namespace.virtual_pipeline_model_parallel_size is not None
                 or namespace.decoder_first_pipeline_num_layers is not None
                 or namespace.decoder_last_pipeline_num_layers is not None)
    if pp > 1 and layers % pp == 0 and (layers // pp) % value == 0 and not own_split:
        return None
    namespace.num_layers_per_virtual_pipeline_stage = None
    return (f"preset {preset.name}: its {VPP_FLAG} {value} does not fit "
            f"--pipeline-model-parallel-size {pp} with --num-layers {layers}"
            f"{' and the given virtual/uneven stages' if own_split else ''}; not interleaving")


SAMPLE_FORM_FLAGS = ("--train-samples", "--lr-warmup-samples", "--lr-decay-samples",
                     "--lr-wsd-decay-samples")
ITERATION_FORM_DEFAULTS = {"train_iters": None, "lr_warmup_iters": 0, "lr_decay_iters": None,
                           "lr_wsd_decay_iters": None}


def fit_run_length(namespace, preset: Preset, argv: list[str]) -> str | None:
    """A command line that makes the run sample-based (``--train-samples`` ...) replaces the
    preset's iteration-based length and schedule (``train_iters``, ``lr_warmup_iters``,
    ``lr_decay_iters`` return to Megatron's defaults) instead of clashing with them; returns the
    note saying so (None when nothing changed). Iteration flags given on the command line stay
    (and clash, as the user's own)."""
    given = {a.split("=", 1)[0] for a in argv}
    if not given & set(SAMPLE_FORM_FLAGS):
        return None
    dropped = [name for name, default in ITERATION_FORM_DEFAULTS.items()
               if preset.flags.get(name, default) != default
               and "--" + name.replace("_", "-") not in given]
    for name in dropped:
        setattr(namespace, name, ITERATION_FORM_DEFAULTS[name])
    if not dropped:
        return None
    return (f"preset {preset.name}: sample-based run, so its "
            f"{', '.join('--' + n.replace('_', '-') for n in dropped)} are not used")


def default_cache_dir(data_cache_path: str | None = None) -> str:
    return (data_cache_path or os.environ.get("TPFUSE_CACHE")
            or os.path.join(os.path.expanduser("~"), ".cache", "tpfuse"))


def stdlib_source_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def names_data(namespace) -> bool:
    return bool(namespace.mock_data or namespace.data_path or namespace.train_data_path
                or namespace.valid_data_path or namespace.test_data_path)


def ensure_stdlib_corpus(cache_dir: str, announce: bool = True) -> str:
    """The byte-tokenized standard library at ``<cache_dir>/stdlib_byte``; built once (locked)."""
    prefix = os.path.join(cache_dir, CORPUS_NAME)
    if _corpus_exists(prefix):
        return prefix
    os.makedirs(cache_dir, exist_ok=True)
    with open(prefix + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # another process may be building it right now
        if not _corpus_exists(prefix):
            _build_corpus(prefix, announce)
    return prefix


def _corpus_exists(prefix: str) -> bool:
    return os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")


def _build_corpus(prefix: str, announce: bool) -> None:
    from tpfuse.data.preprocess import main as preprocess

    if announce:
        print(f"> preparing the stdlib-demo corpus: the standard library's *.py files under "
              f"{stdlib_source_dir()} -> {prefix}.bin/.idx (byte tokenizer)", flush=True)
    staging = f"{prefix}.staging{os.getpid()}"
    code = preprocess(["--input", stdlib_source_dir(), "--output-prefix", staging, "--tokenizer",
                       "byte", "--pattern", "*.py", "--append-eod", "--quiet"])
    if code:
        raise RuntimeError(f"tokenizing the standard library into {staging} failed ({code})")
    os.replace(staging + ".bin", prefix + ".bin")   # the .idx last: its presence means complete
    os.replace(staging + ".idx", prefix + ".idx")


def fill_preset_data(namespace, preset: Preset) -> None:
    """A preset's data when the flags name none (the stdlib corpus, built if missing)."""
    if not preset.stdlib_corpus or names_data(namespace):
        return
    cache = default_cache_dir(namespace.data_cache_path)
    namespace.data_path = [ensure_stdlib_corpus(cache, announce=os.environ.get("RANK", "0") == "0")]
    namespace.data_cache_path = cache


def launcher_plan(trainer_argv: list[str], nproc_per_node: int | None):
    """What ``tpfuse-train`` runs: ``(trainer argv, processes, preset or None)``.

    No trainer flags at all select the default preset; a preset's corpus is prepared here once,
    before the ranks start.
    """
    argv = list(trainer_argv) or ["--preset", DEFAULT_PRESET]
    preset = preset_from_argv(argv)
    nproc = nproc_per_node or (preset.nproc_per_node if preset else 1)
    if preset is not None and preset.stdlib_corpus and not _argv_names_data(argv):
        ensure_stdlib_corpus(default_cache_dir(_flag_value(argv, "--data-cache-path")))
    return argv, nproc, preset


def _argv_names_data(argv: list[str]) -> bool:
    flags = ("--mock-data", "--data-path", "--train-data-path", "--valid-data-path",
             "--test-data-path")
    return any(a.split("=", 1)[0] in flags for a in argv)


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, item in enumerate(argv):
        if item == flag and i + 1 < len(argv):
            return argv[i + 1]
        if item.startswith(flag + "="):
            return item.split("=", 1)[1]
    return None
