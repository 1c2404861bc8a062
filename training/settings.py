"""The trainer's settings: one frozen dataclass per concern, collected in ``TrainerSettings``.

The model and parallel layout are ``TransformerConfig`` (``models/config.py``); everything else the
trainer reads is here, one group per concern, each field a Megatron flag by underscore → dash
(``micro_batch_size`` ↔ ``--micro-batch-size``) with Megatron's default:

=======================  ======================================================================
``training``             TrainingSettings: batch sizes, ramp-up, run length (iterations/samples)
``scheduler``            SchedulerSettings: lr, its warm-up, decay and WSD anneal
``optimizer``            OptimizerSettings: AdamW / SGD / Muon and gradient clipping
``data``                 DataSettings: data sources, split, tokenizer, document handling
``evaluation``           EvaluationSettings: how often and how much to validate
``logging``              LoggingSettings: log line, metrics file, progress bar, layout table
``checkpoint``           CheckpointSettings: save / load and the early exits (each saves first)
``observability``        ObservabilitySettings: TensorBoard, wandb, throughput, profiler
``distributed``          DistributedSettings: backend, collective timeout, TP comm options
``precision``            PrecisionSettings (``precision_args.py``): loss scaling, gradient dtype
``data_parallel``        DataParallelSettings (``precision_args.py``): DP reduction, ZeRO-1
``sample``               SampleSettings (``sample_args.py``): the end-of-training sample
``gc``                   GarbageCollectionSettings (``garbage_collection.py``): ``--manual-gc``
``timing``               TimingSettings (``timers.py``): ``--timing-log-level`` / ``-option``
=======================  ======================================================================

Every group validates itself at construction (``settings_fields.SettingsGroup``); the rules that
span groups (the run length's form against the schedule's) are ``TrainerSettings``'s. The parser
(``arguments.build_parser``) is built from these fields, so flags and fields cannot drift; the
trainer's functions receive the group they need (``ManualGC(settings.gc)``,
``Checkpointing(settings.checkpoint)``), never a namespace.
"""
from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields

from tpfuse.data.tokenizer_options import (MEGATRON_ONLY_TYPES, TIKTOKEN_PATTERNS, TOKENIZER_TYPES,
                                           check_tokenizer_type)
from tpfuse.parallel.comm_options import REDUCE_SCATTER_STRATEGIES, CommOptions

from .garbage_collection import GarbageCollectionSettings
from .precision_args import DataParallelSettings, PrecisionSettings
from .sample_args import SampleSettings
from .scheduler import DECAY_STYLES, WSD_DECAY_STYLES
from .settings_fields import SettingsGroup, setting, unknown_setting_error
from .timers import TimingSettings
from .train_samples import check_iterations_or_samples, check_wsd_arguments

DEFAULT_SPLIT = "969,30,1"      # Megatron's legacy default with --data-path
OPTIMIZER_CHOICES = ("adam", "sgd", "muon", "dist_muon")        # Megatron-LM's --optimizer
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")


@dataclass(frozen=True, kw_only=True)
class TrainingSettings(SettingsGroup):
    """Batch sizes (b, B and B's ramp-up) and the run length, in iterations or in samples."""
    TITLE = "batch and run length"

    micro_batch_size: int | None = setting(
        None, "samples per micro-batch on one data-parallel rank (required)", required=True,
        minimum=1)
    global_batch_size: int | None = setting(
        None, "samples per optimizer step over all DP ranks (default: micro × dp)", minimum=1)
    rampup_batch_size: list[int] | None = setting(
        None, "grow the global batch from START by INCREMENT over SAMPLES samples", nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"))
    train_iters: int | None = setting(
        None, "optimizer steps (this or --train-samples is required)", minimum=1)
    train_samples: int | None = setting(
        None, "train on this many samples (exclusive with --train-iters; the iteration count "
              "follows from the global batch and its ramp-up)", minimum=1)


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings(SettingsGroup):
    """The learning rate: its peak, warm-up, decay (``scheduler.py`` has the formulas), in the
    run length's unit (iterations, or samples with ``--train-samples``)."""
    TITLE = "learning-rate schedule"

    lr: float | None = setting(None, "peak learning rate (required)", required=True,
                               bounds=(0.0, True, None, False))
    min_lr: float = setting(0.0, "floor of the decayed lr", bounds=(0.0, True, None, False))
    lr_warmup_iters: int = setting(0, "linear warm-up steps", minimum=0)
    lr_decay_iters: int | None = setting(
        None, "steps over which the lr decays (default: --train-iters)", minimum=0)
    lr_decay_style: str = setting(
        "linear", "the decay after the warm-up (training/scheduler.py has the formulas)",
        choices=DECAY_STYLES)
    lr_wsd_decay_style: str = setting(
        "exponential", "with --lr-decay-style WSD: the shape of the final anneal",
        choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int | None = setting(
        None, "with --lr-decay-style WSD: iterations of the final anneal (ending at "
              "--lr-decay-iters)")
    lr_warmup_samples: int = setting(
        0, "with --train-samples: linear warm-up over this many samples", minimum=0)
    lr_decay_samples: int | None = setting(
        None, "with --train-samples: samples over which the lr decays (default: "
              "--train-samples)", minimum=0)
    lr_wsd_decay_samples: int | None = setting(
        None, "with --train-samples and --lr-decay-style WSD: samples of the final anneal",
        minimum=0)

    override_opt_param_scheduler: bool = setting(
        False, "with --load: the lr schedule (peak, floor, warm-up, decay length and style) is "
               "this run's flags', whatever the checkpoint's (Megatron's)",
        flag="--override-opt_param-scheduler")
    use_checkpoint_opt_param_scheduler: bool = setting(
        False, "with --load: the lr schedule is the checkpoint's, whatever this run's flags "
               "(Megatron's; without either flag a Megatron-LM checkpoint's must equal this "
               "run's)", flag="--use-checkpoint-opt_param-scheduler")

    def check(self) -> None:
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and "
                             "--use-checkpoint-opt_param-scheduler exclude each other")


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings(SettingsGroup):
    """The optimizer on the fp32 main parameters (AdamW, SGD or Muon; Megatron's flags and
    defaults) and the global gradient-norm clip."""
    TITLE = "optimizer"

    weight_decay: float = setting(0.01, "AdamW's decoupled weight decay",
                                  bounds=(0.0, True, None, False))
    clip_grad: float = setting(1.0, "clip the global gradient norm to this (0 disables)",
                               bounds=(0.0, True, None, False))
    adam_beta1: float = setting(0.9, "Adam's first-moment decay", bounds=(0.0, True, 1.0, False))
    adam_beta2: float = setting(0.999, "Adam's second-moment decay",
                                bounds=(0.0, True, 1.0, False))
    adam_eps: float = setting(1e-8, "Adam's denominator epsilon", bounds=(0.0, False, None, False))
    # the optimizer's kind and its own settings (training/optimizer.py has the update rules)
    optimizer: str = setting(
        "adam", "adam (AdamW), sgd (momentum SGD) or muon (Newton-Schulz orthogonalised momentum "
                "on the 2-D hidden weights, AdamW on the rest)", choices=OPTIMIZER_CHOICES)
    sgd_momentum: float = setting(0.9, "SGD's momentum factor", bounds=(0.0, True, None, False))
    muon_momentum: float = setting(0.9, "Muon's momentum (an EMA of the gradients)",
                                   bounds=(0.0, True, 1.0, False))
    muon_split_qkv: bool = setting(
        True, "orthogonalise the fused QKV weight as one matrix (default: q, k and v apart)",
        flag="--muon-no-split-qkv")
    muon_use_nesterov: bool = setting(False, "Nesterov-style momentum in Muon")
    muon_scale_mode: str = setting(
        "spectral", "Muon's update scale: spectral sqrt(max(m, n)), unit_rms_norm sqrt(m/n), "
                    "shape_scaling sqrt(max(1, m/n))", choices=MUON_SCALE_MODES)
    muon_fp32_matmul_prec: str = setting(
        "medium", "the Newton-Schulz GEMMs: medium in bf16, high in fp32 (TF32 on a GPU)",
        choices=MUON_MATMUL_PRECISIONS)
    muon_num_ns_steps: int = setting(5, "Newton-Schulz iterations (a multiple of 5: the quintic "
                                        "coefficient schedule, repeated)", minimum=1)
    muon_tp_mode: str = setting(
        "blockwise", "tensor-parallel weights: blockwise orthogonalises each TP shard, "
                     "duplicated the whole matrix (gathered; equal to one process)",
        choices=MUON_TP_MODES)
    muon_extra_scale_factor: float = setting(1.0, "a further factor on Muon's update",
                                             bounds=(0.0, False, None, False))

    def check(self) -> None:
        unsupported = {("optimizer", "dist_muon"): "the layer-wise distributed Muon; use "
                                                   "--optimizer muon (with "
                                                   "--use-distributed-optimizer to shard it)",
                       ("muon_fp32_matmul_prec", "low"): "torch has no 'low' float32 matmul "
                                                         "precision; use medium or high",
                       ("muon_tp_mode", "distributed"): "use duplicated (the same "
                                                        "orthogonalisation of the whole matrix)"}
        for (name, value), why in unsupported.items():
            if getattr(self, name) == value:
                raise ValueError(f"--{name.replace('_', '-')} {value} is not supported: {why}")
        if self.muon_num_ns_steps % 5:
            raise ValueError(f"--muon-num-ns-steps must be a multiple of 5 (the quintic "
                             f"Newton-Schulz schedule has 5 steps), got {self.muon_num_ns_steps}")


@dataclass(frozen=True, kw_only=True)
class DataSettings(SettingsGroup):
    """Where samples come from (exactly one source), how they are split and tokenized."""
    TITLE = "data and tokenizer"

    mock_data: bool = setting(False, "synthetic deterministic tokens")
    data_path: list[str] | None = setting(
        None, "indexed dataset prefix(es), Megatron's forms: P | P1 P2 ... (weighted by their "
              "sizes) | W1 P1 W2 P2 ... (e.g. 0.7 A 0.3 B), cut by --split", nargs="*")
    train_data_path: list[str] | None = setting(
        None, "the train split's own blend (same forms; exclusive with --data-path)", nargs="*")
    valid_data_path: list[str] | None = setting(
        None, "the valid split's own blend (same forms; exclusive with --data-path)", nargs="*")
    test_data_path: list[str] | None = setting(
        None, "the test split's own blend (same forms; exclusive with --data-path)", nargs="*")
    split: str | None = setting(
        None, f"train,valid,test proportions (default with --data-path: {DEFAULT_SPLIT})")
    data_cache_path: str | None = setting(
        None, "where dataset indices are cached (default: built in memory)")
    # the tokenizer: Megatron's flags (data/tokenizer_options.py builds the tokenizer they name)
    tokenizer_type: str | None = setting(
        None, "NullTokenizer (ids 0..vocab-size-1 + EOD; the default with --mock-data), "
              "ByteTokenizer (bytes + EOD, 257 ids), GPT2BPETokenizer (--vocab-file, "
              "--merge-file), SentencePieceTokenizer / GPTSentencePieceTokenizer / "
              "Llama2Tokenizer (--tokenizer-model: a SentencePiece model), TikTokenizer "
              "(--tokenizer-model: a BPE rank file), HuggingFaceTokenizer (--tokenizer-model: a "
              "local tokenizer folder or tokenizer.json)",
        choices=TOKENIZER_TYPES + MEGATRON_ONLY_TYPES)
    tokenizer_model: str | None = setting(
        None, "the tokenizer's file or folder: a SentencePiece model, a TikTokenizer rank file "
              "(Megatron's JSON or .tiktoken), a HuggingFace tokenizer folder or tokenizer.json")
    vocab_file: str | None = setting(None, "GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: str | None = setting(None, "GPT2BPETokenizer: GPT-2's merges.txt")
    tiktoken_pattern: str | None = setting(
        None, "TikTokenizer's pre-tokenizer regex, v1 or v2 (default v2)",
        choices=TIKTOKEN_PATTERNS)
    tiktoken_num_special_tokens: int = setting(
        1000, "TikTokenizer: ids 0..N-1 are special tokens, the BPE ranks follow", minimum=1)
    tokenizer_special_tokens: list[str] | None = setting(
        None, "TikTokenizer: the named special tokens (they must include <unk> <s> </s> <mask> "
              "<pad> <cls> <sep>); HuggingFaceTokenizer: tokens added to the vocabulary",
        nargs="+")
    tiktoken_special_tokens: list[str] | None = setting(
        None, "Megatron's deprecated spelling of --tokenizer-special-tokens", nargs="+")
    tokenizer_hf_use_fast: bool = setting(
        False, "HuggingFaceTokenizer: load the fast (Rust) tokenizer")
    tokenizer_hf_include_special_tokens: bool = setting(
        False, "HuggingFaceTokenizer: ids include the special tokens the tokenizer adds "
               "(e.g. BOS)")
    eod_mask_loss: bool = setting(False, "no loss on end-of-doc tokens")
    reset_position_ids: bool = setting(
        False, "positions restart at 0 after every end-of-document token")
    reset_attention_mask: bool = setting(
        False, "attend only within a document (document ids from the EOD tokens)")

    @property
    def per_split_paths(self) -> list:
        """``[train, valid, test]`` blends of ``--{split}-data-path`` (None where not given)."""
        return [self.train_data_path, self.valid_data_path, self.test_data_path]

    def check(self) -> None:
        if self.tokenizer_type is not None:
            check_tokenizer_type(self.tokenizer_type)
        sources = sum([bool(self.mock_data), bool(self.data_path),
                       any(p for p in self.per_split_paths)])
        if sources > 1:
            raise ValueError("give one of --mock-data, --data-path or --train/valid/test-data-path")
        if sources == 0:
            raise ValueError("no data: give --data-path PREFIX (see tpfuse-preprocess), "
                             "--train-data-path ..., or --mock-data")


@dataclass(frozen=True, kw_only=True)
class EvaluationSettings(SettingsGroup):
    """Validation: every evaluation reads the same first ``eval_iters`` global batches."""
    TITLE = "evaluation"

    eval_interval: int = setting(1000, "evaluate every N steps", minimum=1)
    eval_iters: int = setting(100, "validation batches per evaluation (0: no evaluation)",
                              minimum=0)
    eval_at_start: bool = setting(
        False, "also evaluate once before the first step (the curve's starting point)")


@dataclass(frozen=True, kw_only=True)
class LoggingSettings(SettingsGroup):
    """What the logging rank prints and writes."""
    TITLE = "logging"

    log_interval: int = setting(100, "print a log line every N steps", minimum=1)
    metrics_file: str | None = setting(
        None, "append one JSON object per iteration (and a loss-curve PNG beside it at the end "
              "of the run)")
    no_progress_bar: bool = setting(False, "no tqdm progress bar on the logging rank")
    no_layout_table: bool = setting(False, "do not print the rank layout at start-up")
    log_memory_plan: bool = setting(
        False, "at start-up every rank prints what it holds beside tpfuse-plan's prediction")


def _check_load_folder(load: str) -> None:
    """``--load`` must be a tpfuse checkpoint folder (or one that does not exist yet): a file, or
    a HuggingFace model folder, would otherwise be taken as empty and trained over from scratch."""
    if os.path.exists(load) and not os.path.isdir(load):
        raise ValueError(f"--load {load} is a file, not a checkpoint folder")
    if os.path.isfile(os.path.join(load, "config.json")) and not any(
            name.startswith("iter_") or name == "latest_checkpointed_iteration.txt"
            for name in os.listdir(load)):
        raise ValueError(f"--load {load} is a HuggingFace model folder, not a tpfuse checkpoint: "
                         f"convert it first (tpfuse-convert --from-hf {load} --save DIR), then "
                         "train from it with --load DIR --finetune")


# the per-rank format is not Megatron's "torch" (mp_rank_XX/model_optim_rng.pt): it has its own name
CKPT_FORMATS = ("tpfuse", "torch_dist")


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings(SettingsGroup):
    """Saving, loading, and the early exits (each of which saves first)."""
    TITLE = "checkpoints and exit"

    save: str | None = setting(None, "checkpoint directory to write")
    save_interval: int | None = setting(None, "save every N steps", minimum=1)
    load: str | None = setting(
        None, "checkpoint directory to resume from (empty or missing: start fresh with a "
              "warning, so a restarted command resumes when it can)")
    finetune: bool = setting(
        False, "with --load: take only the model's weights (any layout, e.g. a tpfuse-convert "
               "checkpoint); optimizer, scheduler, RNG and iteration start fresh (Megatron's)")
    exit_on_missing_checkpoint: bool = setting(
        False, "with --load: fail instead of starting fresh when it holds no checkpoint")
    no_load_optim: bool = setting(
        False, "with --load: the weights and the iteration only; the optimizer state and lr "
               "schedule start fresh, and so does the RNG (Megatron's, which keeps the RNG)")
    use_checkpoint_args: bool = setting(
        False, "with --load: the model's shape flags (layers, sizes, heads, norms, positions, "
               "experts ...) come from the checkpoint's recorded config, not the command line "
               "(Megatron's); --seq-length stays this run's")
    async_save: bool = setting(
        False, "write checkpoints beside training (at most one in flight, published atomically, "
               "waited for at exit)")
    ckpt_format: str = setting(
        "tpfuse", "format --save writes: tpfuse (one file per rank, reshardable by tpfuse) | "
                  "torch_dist (Megatron's torch.distributed.checkpoint layout: any layout, "
                  "megatron-core reads it); --load reads either",
        choices=CKPT_FORMATS)
    keep_last_checkpoints: int | None = setting(
        None, "after each save delete all but the newest N checkpoints (default: keep all)",
        minimum=1, metavar="N")
    exit_interval: int | None = setting(
        None, "save and exit once the iteration is a multiple of this", minimum=1)
    exit_duration_in_mins: float | None = setting(
        None, "save and exit once training has run this many minutes",
        bounds=(0.0, False, None, False))
    exit_signal_handler: bool = setting(
        False, "on SIGTERM: save at the next iteration boundary, then exit 0")

    def check(self) -> None:
        for flag, path in (("--save", self.save), ("--load", self.load)):
            if path is not None and not path.strip():
                raise ValueError(f"{flag} is an empty string: give a folder (or leave {flag} out)")
        if self.load:
            _check_load_folder(self.load)
        if self.save and os.path.exists(self.save) and not os.path.isdir(self.save):
            raise ValueError(f"--save {self.save} is a file, not a folder")
        if self.save_interval is not None and not self.save:
            raise ValueError("--save-interval needs --save DIR")
        if self.async_save and not self.save:
            raise ValueError("--async-save needs --save DIR")
        if self.use_checkpoint_args and not self.load:
            raise ValueError("--use-checkpoint-args needs --load DIR")
        if self.no_load_optim and self.finetune:
            raise ValueError("--no-load-optim and --finetune exclude each other (--finetune "
                             "already loads the weights only)")
        if self.exit_on_missing_checkpoint and not self.load:
            raise ValueError("--exit-on-missing-checkpoint needs --load DIR")


@dataclass(frozen=True, kw_only=True)
class ObservabilitySettings(SettingsGroup):
    """Metric sinks (TensorBoard, wandb), throughput in the log line, the profiler."""
    TITLE = "observability"

    tensorboard_dir: str | None = setting(
        None, "write TensorBoard scalars here (optional extra: tensorboard)")
    tensorboard_log_interval: int = setting(1, "write TensorBoard scalars every N steps",
                                            minimum=1)
    wandb_project: str = setting(
        "", "log to this Weights & Biases project (optional extra: wandb)")
    wandb_exp_name: str = setting("", "the wandb run name")
    wandb_save_dir: str = setting("", "wandb's local folder")
    log_throughput: bool = setting(
        False, "print TFLOP/s per rank (and MFU with --peak-tflops) in the log line")
    peak_tflops: float | None = setting(
        None, "peak dense TFLOP/s of one device in the training precision; MFU = achieved / "
              "this (default: MFU not reported)", bounds=(0.0, False, None, False))
    profile: bool = setting(False, "record a torch.profiler Chrome trace of steps [start, end)")
    use_pytorch_profiler: bool = setting(
        False, "accepted for Megatron compatibility: --profile always uses torch.profiler")
    profile_step_start: int = setting(10, "first profiled step", minimum=0)
    profile_step_end: int = setting(12, "the step after the last profiled one")
    profile_ranks: list[int] = setting([0], "global ranks that record a trace", nargs="+")
    profile_dir: str | None = setting(
        None, "where traces go (default: --tensorboard-dir, else ./profile)")

    def check(self) -> None:
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ValueError(f"--profile-step-end ({self.profile_step_end}) must be greater than "
                             f"--profile-step-start ({self.profile_step_start})")


@dataclass(frozen=True, kw_only=True)
class DistributedSettings(SettingsGroup):
    """The process group's backend, how long a collective may wait, and how the model's
    communication runs (``comm_options()``: the ParallelState's CommOptions)."""
    TITLE = "distributed"

    distributed_backend: str | None = setting(
        None, "default: nccl when CUDA is available (Megatron's), else gloo",
        choices=("gloo", "nccl"))
    device: str | None = setting(
        None, "where the model and its activations live: cuda (this rank's GPU; under gloo "
              "every collective is staged through host memory, so ranks may share one GPU) or "
              "cpu; default: the backend's (nccl: cuda, gloo: cpu)", choices=("cpu", "cuda"))
    distributed_timeout_minutes: float = setting(
        10.0, "a collective waiting longer than this fails the job",
        bounds=(0.0, False, None, False))
    reduce_scatter_strategy: str = setting(
        "auto", "how reduce-scatters run (tensor/sequence parallel, MoE, the distributed "
                "optimizer's buckets, FSDP on gloo): native reduce_scatter_tensor, or "
                "all_reduce then keep this rank's block; auto: all_reduce on gloo (about twice "
                "as fast as its reduce-scatter), native on nccl",
        choices=REDUCE_SCATTER_STRATEGIES)
    fused_comm_min_flops: float | None = setting(
        None, "per-rank GEMM FLOPs from which sequence-parallel linears run the ring-overlapped "
              "comm+GEMM pipeline (0: always, inf: never; default: per device, 4e9 on CPU, 1e11 "
              "on CUDA)", allow_inf=True)
    symm_mem_all_gather_matmul: bool = setting(
        False, "on CUDA, the all-gather+GEMM forward through symmetric memory (every rank of the "
               "TP group on this node)")

    def check(self) -> None:
        comm_options_from_args(self)

    def comm_options(self) -> CommOptions:
        return comm_options_from_args(self)


def comm_options_from_args(values) -> CommOptions:
    """The three communication flags as the ParallelState's ``comm_options``; ``values``: the
    DistributedSettings, or a parsed namespace holding the same fields."""
    flops = values.fused_comm_min_flops
    if flops is not None and not flops >= 0:
        raise ValueError(f"--fused-comm-min-flops must be >= 0 (FLOPs), got {flops}")
    return CommOptions(reduce_scatter=values.reduce_scatter_strategy, fused_min_flops=flops,
                       symm_mem=values.symm_mem_all_gather_matmul)


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """Every trainer setting, by group (see the module docstring); ``preset`` is the
    ``--preset`` the flags started from, ``tokenizer`` the tokenizer ``parse_args`` built (not a
    flag; None when the settings are made by hand)."""

    training: TrainingSettings
    scheduler: SchedulerSettings
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    data: DataSettings
    evaluation: EvaluationSettings = field(default_factory=EvaluationSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    observability: ObservabilitySettings = field(default_factory=ObservabilitySettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    data_parallel: DataParallelSettings = field(default_factory=DataParallelSettings)
    sample: SampleSettings = field(default_factory=SampleSettings)
    gc: GarbageCollectionSettings = field(default_factory=GarbageCollectionSettings)
    timing: TimingSettings = field(default_factory=TimingSettings)
    preset: str | None = None
    tokenizer: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"TrainerSettings.{name} must be {cls.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        check_iterations_or_samples(self.training, self.scheduler)
        check_wsd_arguments(self.training, self.scheduler)

    @classmethod
    def from_values(cls, values: dict, preset: str | None = None, tokenizer=None):
        """Settings from ``{field name: value}`` (argparse's dests); a name no group has is a
        ValueError naming the closest flag. Fields not given take their defaults."""
        owner = field_owners()
        unknown = sorted(set(values) - set(owner))
        if unknown:
            raise ValueError(unknown_setting_error(unknown[0], owner))
        by_group = {name: {} for name in GROUPS}
        for name, value in values.items():
            by_group[owner[name]][name] = value
        groups = {name: GROUPS[name](**given) for name, given in by_group.items()}
        return cls(**groups, preset=preset, tokenizer=tokenizer)

    def groups(self) -> dict:
        """``{group name: group}`` in the order of the table above."""
        return {name: getattr(self, name) for name in GROUPS}

    def values(self) -> dict:
        """Every flag's value by field name (the groups flattened, e.g. for a wandb config)."""
        flat = {"preset": self.preset}
        for group in self.groups().values():
            flat.update((f.name, getattr(group, f.name)) for f in fields(group))
        return flat


# group name -> class, in field order (the annotations are strings: resolved here)
GROUPS = {name: cls for name, cls in typing.get_type_hints(TrainerSettings).items()
          if isinstance(cls, type) and issubclass(cls, SettingsGroup)}


def field_owners() -> dict:
    """``{field name: group name}`` over every group (each field name belongs to one group)."""
    owners = {}
    for group_name, cls in GROUPS.items():
        for f in fields(cls):
            if f.name in owners:
                raise TypeError(f"settings field {f.name!r} is in both {owners[f.name]} and "
                                f"{group_name}")
            owners[f.name] = group_name
    return owners

