"""TransformerConfig: one dataclass for the model shape, the parallel layout, precision and recompute.

Every field carries metadata ``{"help", "category"}`` and, where Megatron's command-line flag is not
the field name with dashes, ``"flag"`` (Megatron's name; ``models/cli.py`` turns fields into flags).
``validate()`` runs at construction and raises ``ValueError`` naming the offending fields.

Derived values (Megatron's argument post-processing), filled in ``__post_init__`` when left ``None``:
``ffn_hidden_size`` (4·h; swiglu: int(4·h·2/3 / 64)·64 as Megatron), ``num_query_groups`` (= heads),
``max_position_embeddings`` (= seq_length), ``virtual_pipeline_model_parallel_size`` (from
``num_layers_per_virtual_pipeline_stage``; a size of 1 is normalised to ``None``), ``params_dtype``
(bf16 → bfloat16, fp16 → float16, else float32). ``padded_vocab_size`` is a property.

``microbatch_group_size_per_vp_stage`` stays ``None`` for "= pp" (the executor's default), so it
never goes stale. ``dataclasses.replace`` keeps the other derived values: pass them explicitly (or
``None``) when changing what they derive from.

``sequence_parallel`` with ``tensor_model_parallel_size == 1`` is switched off with a warning, as
Megatron does (sequence parallelism is a no-op without a TP group).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import torch

from tpfuse.parallel.checks import (is_int, is_real, parse_int_pair, require_choice,
                                    require_non_negative_or_none, require_positive,
                                    require_positive_or_none)
from tpfuse.parallel.context_split import (CP_COMM_TYPE_ALIASES, CP_COMM_TYPES,
                                           check_context_parallel_heads, check_sequence_split)

from .layer_assignment import stage_layer_counts
from .mla_config import validate_mla
from .moe_config import parse_moe_layer_freq, validate_moe
from .recompute_config import validate_recompute

CATEGORIES = ("model", "parallelism", "moe", "precision", "recompute")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1")
DERIVED = ("num_query_groups", "ffn_hidden_size", "max_position_embeddings",
           "virtual_pipeline_model_parallel_size", "params_dtype", "recompute_modules",
           "moe_ffn_hidden_size")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _f(category, help, default=dataclasses.MISSING, **extra):
    """A dataclass field with its category, one-line doc and optional flag metadata."""
    metadata = {"category": category, "help": help, **extra}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class TransformerConfig:
    # ---- model shape -------------------------------------------------------------------------
    num_layers: int = _f("model", "number of transformer layers (all pipeline stages together)")
    hidden_size: int = _f("model", "transformer hidden size h")
    num_attention_heads: int = _f("model", "number of attention heads")
    num_query_groups: int | None = _f(
        "model", "key/value head groups for grouped-query attention (default: = heads)", None)
    ffn_hidden_size: int | None = _f(
        "model", "MLP hidden size (default 4h; swiglu: int(8h/3 / 64)*64 as Megatron)", None)
    vocab_size: int | None = _f("model", "tokenizer vocabulary size before padding", None)
    make_vocab_size_divisible_by: int = _f(
        "model", "pad the vocabulary to a multiple of this times tensor_model_parallel_size", 128)
    seq_length: int = _f("model", "sequence length s of a sample")
    max_position_embeddings: int | None = _f(
        "model", "number of learned positions (default: = seq_length)", None)
    normalization: str = _f("model", "norm layer: LayerNorm | RMSNorm", "LayerNorm")
    layernorm_epsilon: float = _f("model", "epsilon of the norm layers", 1e-5, flag="--norm-epsilon")
    activation: str = _f("model", "MLP activation: gelu | gelu_tanh (GPT-2's tanh approximation) "
                         "| swiglu", "gelu", aliases={"--swiglu": "swiglu",
                                                      "--openai-gelu": "gelu_tanh"})
    position_embedding_type: str = _f(
        "model", "position embedding: learned_absolute | rope", "learned_absolute")
    rotary_base: int = _f("model", "base of the rotary embedding frequencies", 10000)
    use_rope_scaling: bool = _f("model", "Llama 3.x rotary frequency scaling (HF rope_type "
                                "'llama3' with its original context 8192, factors 1 / 4)", False)
    rope_scaling_factor: float = _f("model", "the factor of --use-rope-scaling", 8.0)
    window_size: tuple[int, int] | None = _f(
        "model", "sliding-window attention (Megatron/TE's L,R: a query sees the L keys before it "
        "and itself; R must be 0 as attention is causal; L=-1: no window; HF/Mistral "
        "sliding_window = L+1)", None)
    add_bias_linear: bool = _f("model", "biases in the linear layers", True,
                               negative_flag="--disable-bias-linear")
    add_qkv_bias: bool = _f("model", "a bias in the QKV projection also without "
                            "add_bias_linear (Qwen2's layout)", False)
    qk_layernorm: bool = _f("model", "normalise every query and key head over the head dim before "
                            "rotary (the model's normalization; Qwen3's q_norm / k_norm)", False)
    # multi-latent attention (DeepSeek-V2/V3 MLA; models/mla_config.py): Megatron-LM's flags
    multi_latent_attention: bool = _f(
        "model", "multi-latent attention: low-rank compressed K/V (and Q) with a decoupled rope "
        "part (the q / kv latent norms under --qk-layernorm)", False)
    q_lora_rank: int | None = _f("model", "MLA: rank of the query's low-rank compression "
                                 "(None: no q compression)", None)
    kv_lora_rank: int = _f("model", "MLA: rank of the key/value latent", 32)
    qk_head_dim: int = _f("model", "MLA: q/k head dim without position (the q/k head dim is "
                          "qk_head_dim + qk_pos_emb_head_dim)", 128)
    qk_pos_emb_head_dim: int = _f("model", "MLA: head dim of the decoupled rope part of q/k", 64)
    v_head_dim: int = _f("model", "MLA: value head dim", 128)
    rope_type: str | None = _f("model", "MLA rotary: rope | yarn (default: yarn with "
                               "--multi-latent-attention; other attention takes rope only)", None)
    rotary_scaling_factor: float = _f("model", "MLA YaRN: rotary scaling factor", 1.0)
    mscale: float = _f("model", "MLA YaRN: mscale of the rope tables' concentration", 1.0)
    mscale_all_dim: float = _f("model", "MLA YaRN: mscale_all_dim (also the softmax scale "
                               "g(factor, mscale_all_dim)^2 / sqrt(q/k head dim))", 0.0)
    original_max_position_embeddings: int = _f(
        "model", "MLA YaRN: the original context of the model being extended", 4096)
    beta_fast: float = _f("model", "MLA YaRN: beta_fast of the frequency ramp", 32.0)
    beta_slow: float = _f("model", "MLA YaRN: beta_slow of the frequency ramp", 1.0)
    untie_embeddings_and_output_weights: bool = _f(
        "model", "separate output-layer weight (default: tied to the word embedding)", False)
    hidden_dropout: float = _f("model", "dropout after embeddings, attention and MLP", 0.1)
    attention_dropout: float = _f("model", "dropout on the attention probabilities", 0.1)
    init_method_std: float = _f("model", "std of the normal weight initialisation", 0.02)
    embedding_init_method_std: float | None = _f(
        "model", "std of the normal initialisation of the word and learned position embeddings "
        "(default: = init_method_std)", None)
    seed: int = _f("model", "seed of the layout-independent weight initialisation and dropout", 1234)

    # ---- parallelism -------------------------------------------------------------------------
    tensor_model_parallel_size: int = _f("parallelism", "tensor-parallel group size tp", 1)
    pipeline_model_parallel_size: int = _f("parallelism", "pipeline stages pp", 1)
    virtual_pipeline_model_parallel_size: int | None = _f(
        "parallelism", "model chunks per pipeline rank vpp (interleaved schedule)", None,
        flag="--num-virtual-stages-per-pipeline-rank")
    num_layers_per_virtual_pipeline_stage: int | None = _f(
        "parallelism", "layers per model chunk (derives vpp = num_layers/pp / this)", None)
    microbatch_group_size_per_vp_stage: int | None = _f(
        "parallelism", "interleaved schedule: micro-batches per chunk group (None: = pp)", None,
        flag="--microbatch-group-size-per-virtual-stage")
    pipeline_schedule: str | None = _f(
        "parallelism", "1f1b | interleaved | zb-h1 (zero bubble, weight gradients deferred); "
        "default: interleaved when vpp > 1, else 1f1b", None)
    p2p_recv_ahead: int | None = _f(
        "parallelism", "pipeline receives posted ahead of need, past this rank's pending sends "
        "(gloo only: on NCCL they would block those sends); None: 4 on gloo, 0 on NCCL", None)
    context_parallel_size: int = _f("parallelism", "context-parallel group size cp", 1)
    cp_comm_type: str = _f(
        "parallelism", "context-parallel attention: p2p (ring, K/V blocks overlapped with the "
        "kernel) | all_gather (K/V gathered once; 'allgather' accepted) | a2a (Ulysses, heads <-> "
        "sequence; heads per tp rank divisible by cp)", "p2p")
    expert_model_parallel_size: int = _f("parallelism", "expert-parallel group size ep", 1)
    expert_tensor_parallel_size: int | None = _f(
        "parallelism", "tensor-parallel size inside experts (default: = tp)", None)
    sequence_parallel: bool = _f(
        "parallelism", "shard norm/dropout activations over the sequence in the TP group", False)
    decoder_first_pipeline_num_layers: int | None = _f(
        "parallelism", "layers on the first pipeline stage (uneven split)", None)
    decoder_last_pipeline_num_layers: int | None = _f(
        "parallelism", "layers on the last pipeline stage (uneven split)", None)

    # ---- mixture of experts (Megatron-core's names; see moe_config.py) ------------------------
    num_moe_experts: int | None = _f(
        "moe", "routed experts per MoE layer (None: dense MLPs only)", None, flag="--num-experts")
    moe_ffn_hidden_size: int | None = _f(
        "moe", "hidden size of each routed expert (default: ffn_hidden_size)", None)
    moe_layer_freq: int | list[int] = _f(
        "moe", "MoE at every N-th layer (int), or one 0/1 per layer, e.g. '([0]+[1]*3)*2'", 1)
    moe_router_topk: int = _f("moe", "experts each token is routed to (k)", 2)
    moe_router_score_function: str = _f("moe", "router scores: softmax | sigmoid", "softmax")
    moe_router_pre_softmax: bool = _f(
        "moe", "softmax over all experts before top-k (default: softmax of the top-k logits)",
        False)
    moe_router_topk_scaling_factor: float | None = _f(
        "moe", "multiply the top-k routing probabilities by this", None)
    moe_router_num_groups: int | None = _f(
        "moe", "expert groups for group-limited routing (device/node-limited)", None)
    moe_router_group_topk: int | None = _f(
        "moe", "groups each token may use (group-limited routing)", None)
    moe_router_dtype: str | None = _f(
        "moe", "router logits/probabilities dtype: fp32 | fp64 (default: params dtype)", None)
    moe_router_load_balancing_type: str = _f(
        "moe", "load-balancing loss: aux_loss | seq_aux_loss | none", "aux_loss")
    moe_aux_loss_coeff: float = _f("moe", "coefficient of the load-balancing loss", 0.0)
    moe_z_loss_coeff: float | None = _f("moe", "coefficient of the router z-loss", None)
    moe_expert_capacity_factor: float | None = _f(
        "moe", "expert capacity = factor × tokens·k / experts; excess tokens dropped "
               "(None: dropless)", None)
    moe_pad_expert_input_to_capacity: bool = _f(
        "moe", "pad every expert's input to its capacity (alltoall dispatcher)", False)
    moe_token_drop_policy: str = _f(
        "moe", "over capacity drop the lowest-probability tokens (probs) or the last (position)",
        "probs")
    moe_shared_expert_intermediate_size: int | None = _f(
        "moe", "hidden size of the shared expert MLP every token also goes through", None)
    moe_shared_expert_gate: bool = _f(
        "moe", "scale the shared expert's output by sigmoid(x w_g) (one gate weight (1, h))",
        False)
    moe_token_dispatcher_type: str = _f(
        "moe", "token dispatch across expert-parallel ranks: allgather | alltoall", "allgather")
    moe_grouped_gemm: bool = _f(
        "moe", "all local experts' GEMMs in one grouped GEMM (else a loop over experts)", False)
    moe_router_enable_expert_bias: bool = _f(
        "moe", "aux-loss-free balancing: a per-expert bias added to the sigmoid scores for the "
        "top-k choice only (not the gating weights), updated after every step", False)
    moe_router_bias_update_rate: float = _f(
        "moe", "expert bias step: bias += rate * sign(mean load - load) per global batch", 1e-3)
    moe_shared_expert_overlap: bool = _f(
        "moe", "run the shared expert while the alltoall dispatcher's all-to-all is in flight",
        False)

    # ---- precision ---------------------------------------------------------------------------
    params_dtype: torch.dtype | None = _f(
        "precision", "parameter dtype: float32 | bfloat16 | float16 (default from bf16/fp16)", None)
    bf16: bool = _f("precision", "bfloat16 parameters and activations", False)
    fp16: bool = _f("precision", "float16 parameters and activations", False)

    # ---- recompute ---------------------------------------------------------------------------
    recompute_granularity: str | None = _f(
        "recompute", "activation recompute: full (whole layers) | selective (recompute_modules)",
        None, aliases={"--recompute-activations": "selective"})
    recompute_method: str | None = _f(
        "recompute", "full recompute: uniform (groups of N layers) | block (first N layers)", None)
    recompute_num_layers: int | None = _f(
        "recompute", "layers per recompute group (uniform) or recomputed per chunk (block)", None)
    recompute_modules: list[str] | None = _f(
        "recompute", "selective recompute: core_attn (default) | layernorm | mlp, several allowed",
        None)
    distribute_saved_activations: bool = _f(
        "recompute", "full recompute under TP without SP: keep each recomputed input 1/tp per "
        "rank", False)

    def __post_init__(self):
        self._derive_defaults()
        self.validate()

    # ---- derived values ----------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int | None:
        """Megatron's padding: vocab rounded up to make_vocab_size_divisible_by × tp."""
        if self.vocab_size is None:
            return None
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def _derive_defaults(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            if self.activation == "swiglu":
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.moe_ffn_hidden_size is None and self.num_moe_experts is not None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        self.moe_layer_freq = parse_moe_layer_freq(self.moe_layer_freq)
        if self.params_dtype is None:
            self.params_dtype = (torch.bfloat16 if self.bf16 else
                                 torch.float16 if self.fp16 else torch.float32)
        elif isinstance(self.params_dtype, str):
            self.params_dtype = _parse_dtype("params_dtype", self.params_dtype)
        if self.recompute_granularity == "selective" and self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]          # Megatron's default
        if self.tensor_model_parallel_size == 1 and self.sequence_parallel:
            warnings.warn("sequence_parallel=True with tensor_model_parallel_size=1: disabled, "
                          "as Megatron does (no TP group to shard over)")
            self.sequence_parallel = False
        self._derive_virtual_pipeline_size()
        self._normalize_window_and_comm_type()

    def _normalize_window_and_comm_type(self):
        """``window_size`` as a tuple of two ints ("L,R", a list from JSON, or L alone = (L, 0)),
        None for L = -1; Megatron's ``allgather`` spelling as ``all_gather``."""
        self.cp_comm_type = CP_COMM_TYPE_ALIASES.get(self.cp_comm_type, self.cp_comm_type)
        window = self.window_size
        if window is None:
            return
        if isinstance(window, str):
            window = parse_int_pair("window_size", window)
        if is_int(window):
            window = (window, 0)
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(is_int(v) for v in window)):
            raise ValueError(f"window_size={self.window_size!r} must be two ints L,R")
        self.window_size = None if tuple(window) in ((-1, 0), (-1, -1)) else tuple(window)

    def _derive_virtual_pipeline_size(self):
        per_chunk = self.num_layers_per_virtual_pipeline_stage
        if per_chunk is not None:
            require_positive(self, "num_layers_per_virtual_pipeline_stage", "num_layers",
                              "pipeline_model_parallel_size")
            if self._has_uneven_split():
                raise ValueError(
                    "num_layers_per_virtual_pipeline_stage cannot be combined with "
                    "decoder_first/last_pipeline_num_layers; set "
                    "virtual_pipeline_model_parallel_size (--num-virtual-stages-per-pipeline-rank)")
            pp = self.pipeline_model_parallel_size
            if self.num_layers % pp or (self.num_layers // pp) % per_chunk:
                raise ValueError(
                    f"num_layers={self.num_layers} / pipeline_model_parallel_size={pp} is not a "
                    f"multiple of num_layers_per_virtual_pipeline_stage={per_chunk}")
            derived = self.num_layers // pp // per_chunk
            given = self.virtual_pipeline_model_parallel_size
            if given is not None and given != derived:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size={given} disagrees with "
                    f"num_layers_per_virtual_pipeline_stage={per_chunk} (which gives {derived})")
            self.virtual_pipeline_model_parallel_size = derived
        if self.virtual_pipeline_model_parallel_size == 1:
            self.virtual_pipeline_model_parallel_size = None

    def _has_uneven_split(self) -> bool:
        return (self.decoder_first_pipeline_num_layers is not None
                or self.decoder_last_pipeline_num_layers is not None)

    # ---- validation --------------------------------------------------------------------------
    def validate(self):
        """Raise ValueError naming the fields of the first invalid setting found."""
        require_positive(self, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                          "num_query_groups", "ffn_hidden_size", "max_position_embeddings",
                          "make_vocab_size_divisible_by",
                          "tensor_model_parallel_size", "pipeline_model_parallel_size",
                          "context_parallel_size", "expert_model_parallel_size")
        require_positive_or_none(self, "vocab_size", "expert_tensor_parallel_size",
                                  "microbatch_group_size_per_vp_stage",
                                  "virtual_pipeline_model_parallel_size", "recompute_num_layers")
        require_non_negative_or_none(self, "p2p_recv_ahead")
        base = self.rotary_base       # HF's rope_theta may be fractional
        if not is_real(base) or not math.isfinite(base) or base <= 0:
            raise ValueError(f"rotary_base={base!r} must be a positive finite number")
        require_choice(self, "normalization", NORMALIZATIONS)
        require_choice(self, "activation", ACTIVATIONS)
        require_choice(self, "position_embedding_type", POSITION_EMBEDDINGS)
        self._validate_shape()
        self._validate_tensor_parallel()
        self._validate_context_parallel()
        self._validate_pipeline()
        self._validate_precision()
        validate_recompute(self)
        validate_moe(self)
        validate_mla(self)

    def _validate_shape(self):
        h, heads, groups = self.hidden_size, self.num_attention_heads, self.num_query_groups
        if h % heads:
            raise ValueError(f"hidden_size={h} is not divisible by num_attention_heads={heads}")
        if heads % groups:
            raise ValueError(
                f"num_attention_heads={heads} is not divisible by num_query_groups={groups}")
        if (self.position_embedding_type == "learned_absolute"
                and self.seq_length > self.max_position_embeddings):
            raise ValueError(f"seq_length={self.seq_length} exceeds max_position_embeddings="
                             f"{self.max_position_embeddings} (learned_absolute positions)")
        if self.position_embedding_type == "rope" and self.kv_channels % 2:
            raise ValueError(f"rope needs an even head dim: hidden_size={h} / "
                             f"num_attention_heads={heads} = {self.kv_channels}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        for name in ("init_method_std", "layernorm_epsilon"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name}={getattr(self, name)} must be a finite number > 0")
        if self.embedding_init_method_std is not None and not (
                0 < self.embedding_init_method_std < float("inf")):
            raise ValueError(f"embedding_init_method_std={self.embedding_init_method_std} must be "
                             "a finite number > 0 (or None: init_method_std)")

    def _validate_tensor_parallel(self):
        tp = self.tensor_model_parallel_size
        for name in ("num_attention_heads", "num_query_groups", "hidden_size", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by "
                                 f"tensor_model_parallel_size={tp}")
        if self.sequence_parallel and self.seq_length % tp:
            raise ValueError(f"seq_length={self.seq_length} is not divisible by "
                             f"tensor_model_parallel_size={tp} (sequence_parallel=True)")

    def _validate_context_parallel(self):
        """Sequence split, comm type, heads for a2a, the window's form
        (parallel/context_split.py)."""
        require_choice(self, "cp_comm_type", CP_COMM_TYPES)
        cp, tp = self.context_parallel_size, self.tensor_model_parallel_size
        check_sequence_split(self.seq_length, cp, tp, self.sequence_parallel)
        if cp > 1:
            check_context_parallel_heads(self.cp_comm_type, self.num_attention_heads // tp,
                                         self.num_query_groups // tp, cp)
        if self.use_rope_scaling and (self.position_embedding_type != "rope"
                                      or not self.rope_scaling_factor > 0):
            raise ValueError(f"use_rope_scaling=True needs position_embedding_type='rope' (got "
                             f"{self.position_embedding_type!r}) and rope_scaling_factor > 0 "
                             f"(got {self.rope_scaling_factor})")
        if self.window_size is not None:
            left, right = self.window_size
            if left < 0 or right != 0:
                raise ValueError(f"window_size={self.window_size}: expected (L, 0) with L >= 0 "
                                 "keys before the query (attention is causal: R = 0), or L = -1 "
                                 "for no window")

    @property
    def attention_window(self) -> int | None:
        """flash_attention's ``window_size`` W = L + 1 (positions a query sees, its own too)."""
        return None if self.window_size is None else self.window_size[0] + 1

    def _validate_pipeline(self):
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if vpp is not None and pp == 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size={vpp} needs "
                             f"pipeline_model_parallel_size > 1 (got {pp})")
        if self._has_uneven_split() and pp == 1:
            raise ValueError("decoder_first/last_pipeline_num_layers need "
                             "pipeline_model_parallel_size > 1 (got 1)")
        group = self.microbatch_group_size_per_vp_stage
        if group is not None and group < pp:
            raise ValueError(f"microbatch_group_size_per_vp_stage={group} must be >= "
                             f"pipeline_model_parallel_size={pp} (Megatron's interleaving)")
        stage_layer_counts(self.num_layers, pp, vpp or 1, self.decoder_first_pipeline_num_layers,
                           self.decoder_last_pipeline_num_layers)
        self._validate_pipeline_schedule(pp, vpp)

    def _validate_pipeline_schedule(self, pp, vpp):
        schedule = self.pipeline_schedule
        if schedule is None:
            return
        require_choice(self, "pipeline_schedule", PIPELINE_SCHEDULES)
        if pp == 1:
            raise ValueError(f"pipeline_schedule={schedule!r} needs pipeline_model_parallel_size "
                             "> 1 (got 1)")
        if schedule != "interleaved" and vpp is not None:
            raise ValueError(f"pipeline_schedule={schedule!r} runs one model chunk per rank, but "
                             f"virtual_pipeline_model_parallel_size={vpp}")

    def _validate_precision(self):
        if self.bf16 and self.fp16:
            raise ValueError("bf16=True and fp16=True are mutually exclusive")
        if self.params_dtype not in DTYPES.values():
            raise ValueError(f"params_dtype={self.params_dtype} must be one of {sorted(DTYPES)}")
        expected = {"bf16": torch.bfloat16, "fp16": torch.float16}
        for flag, dtype in expected.items():
            if getattr(self, flag) and self.params_dtype != dtype:
                raise ValueError(f"{flag}=True but params_dtype={self.params_dtype}")


def _parse_dtype(name, text):
    if text not in DTYPES:
        raise ValueError(f"{name}={text!r} must be one of {sorted(DTYPES)}")
    return DTYPES[text]


def config_fields():
    """The dataclass fields in declaration order (the CLI and --list walk these)."""
    return dataclasses.fields(TransformerConfig)
