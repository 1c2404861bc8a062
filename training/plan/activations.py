"""Activation bytes a rank holds at its schedule's peak, and the schedule's bubble, for tpfuse-plan.

Per transformer layer and micro-batch (what the layer's autograd graph saves, counted as
``tp_layers/activation_memory.py`` counts it; Korthikanti et al. 2022, flash attention), with
``s`` this rank's tokens (``seq_length / cp``), ``t`` = tp, ``t' = t`` under sequence parallelism
else 1, ``e`` the activation element size (the params dtype), ``f`` the MLP width::

    norm inputs            2 · sbh/t' · 4        (LayerNorm keeps its input in fp32)
    QKV and fc1 inputs     2 · sbh/t' · e        (replicated over TP unless SP)
    q, k, v + attn output  4 · s·b·a·d/t · e   (d the head dim, ``kv_channels``: h/a by default)
    MLP inside             2·sbf/t · e  (gelu: pre-activation, fc2 input)
                           4·sbf/t · e  (swiglu: fc1 output, silu(gate), fc2 input)
    rope                   2 · s·b·a·d/t · e     (the rotated q and k)
    dropout masks          2 · sbh/t' · e        (hidden_dropout > 0)
    norm statistics        2 norms · 2 · sb/t' · 4, attention log-sum-exp b·(a/t)·s · 4
    fp32 norm weights      (norm parameters) · h · 4 when the params are 16-bit
    q/k norm statistics    norm statistics · sb · (a + g)/t · 4   (``qk_layernorm``, g the kv
                                                  heads; their inputs are views of the saved QKV)
    context copy           s·b·a·d/t · e   (LayerNorm q/k norms: the attention output is
                                            head-major, the output projection's input a copy)

Selective recompute takes out what it re-runs: ``core_attn`` the log-sum-exp and rope's rotated
q, k (with q/k norms its checkpoint keeps their outputs, sb·(a + g)·d/t · e); ``mlp`` fc1's input, the MLP inside, its dropout mask and the pre-MLP norm's input copy and
statistics (the block's checkpoint keeps its input, sbh/t' · e, instead); ``layernorm`` the norm
outputs QKV and fc1 saved (discarded once consumed, re-run in backward), the statistics and fp32
weights, each norm's checkpoint keeping its input (sbh/t' · e). RMSNorm keeps its input in the
activations' dtype and one statistic per row. Full recompute keeps each recomputed group's input
(sbh/t' · e) and, while one group runs its backward, that group's full activations once.
Grouped-query attention is counted as multi-head attention (q, k, v = 3 sbh/t: the layer
expands k and v to every head).

The chunk ends: the first stage adds the token ids it looks up (int64; over TP also the bool
mask of the ids outside the rank's rows), the learned positions' ids and the embedding's dropout
mask; the last stage the final norm (input, statistics, fp32 weights), the output layer's input
and the loss: over TP the logits shard with its padded columns, the labels and three fp32
statistics per token; at tp = 1 (the unfused loss off CUDA) the fp32 log-softmax of the real
columns and the labels. Measured against the tensors a real forward holds (each storage once,
read after the forward) the count is exact for every layout of tests/training/test_plan.py.

Multi-token prediction adds, on the chunk with the output layer, what each MTP layer keeps
(``_mtp_bytes``: the shifted ids' embedding, two input norms, the 2h-wide projection input, a
transformer layer, its own final norm, output layer input and loss).

Peak: the schedule's actions (``pipeline/``: 1F1B, interleaved, zero-bubble, as the trainer
runs them) are walked on every pipeline rank; a forward adds a micro-batch's activations of its
chunk, a backward (zero-bubble: the W pass) releases them; the peak is the largest sum. The
bubble is ``pipeline/simulate.py``'s idle share with backward = 2 × forward.
"""
from __future__ import annotations

import math

from tpfuse.models.layer_assignment import layers_for
from tpfuse.pipeline.schedules import (build_interleaved_schedule, build_no_pipelining_schedule,
                                       build_schedule)
from tpfuse.pipeline.simulate import simulate

from .memory import element_bytes
from .mla import mla_attention_bytes, mla_rope_table_bytes


def _sizes(config, micro_batch_size: int):
    s = config.seq_length // config.context_parallel_size
    tp = config.tensor_model_parallel_size
    return s, micro_batch_size, config.hidden_size, tp, tp if config.sequence_parallel else 1


def layer_activation_bytes(config, micro_batch_size: int, recompute_modules=None) -> float:
    """Bytes one transformer layer saves for backward per micro-batch on one rank (above).
    ``recompute_modules``: default the config's (selective granularity), else none."""
    s, b, h, t, t_sp = _sizes(config, micro_batch_size)
    e = element_bytes(config.params_dtype)
    if recompute_modules is None:
        recompute_modules = (config.recompute_modules or ()) \
            if config.recompute_granularity == "selective" else ()
    heads = config.num_attention_heads
    sbh = s * b * h
    sbw = s * b * heads * config.kv_channels     # q, k, v and the attention output: a·d wide
    ffn = config.ffn_hidden_size
    mlp_inside = (4 if config.activation == "swiglu" else 2) * s * b * ffn / t * e
    dropout = config.hidden_dropout > 0
    rope = config.position_embedding_type == "rope"
    layer_norm = config.normalization == "LayerNorm"
    norm_copy = sbh / t_sp * (4 if layer_norm else e)     # LayerNorm keeps an fp32 input
    norm_stats = (2 if layer_norm else 1) * s * b / t_sp * 4
    terms = {"norm inputs": 2 * norm_copy, "qkv input": sbh / t_sp * e,
             "fc1 input": sbh / t_sp * e, "attention": 4 * sbw / t * e, "mlp": mlp_inside,
             "rope": 2 * sbw / t * e if rope else 0.0,
             "attention dropout mask": sbh / t_sp * e if dropout else 0.0,
             "mlp dropout mask": sbh / t_sp * e if dropout else 0.0,
             "input norm stats": norm_stats, "pre-mlp norm stats": norm_stats,
             "lse": b * (heads // t) * s * 4,
             "fp32 norm weights": 2 * 2 * h * 4 if layer_norm and e != 4 else 0.0,
             "q/k norm stats": _qk_norm_stats(config, s, b, t),
             "context copy": sbw / t * e if _contiguous_qk_norms(config) else 0.0}
    if "core_attn" in recompute_modules:
        terms["lse"] = terms["rope"] = terms["context copy"] = 0.0
        if config.qk_layernorm and not config.multi_latent_attention:  # normed q, k: copies
            groups = config.num_query_groups or heads
            terms["q/k norm outputs"] = (heads + groups) * config.kv_channels * s * b / t * e
    if "mlp" in recompute_modules:
        for key in ("fc1 input", "mlp", "mlp dropout mask", "pre-mlp norm stats"):
            terms[key] = 0.0
        # the checkpoint keeps the block's input instead of the pre-MLP norm's copy
        terms["norm inputs"] += sbh / t_sp * e - norm_copy
        terms["fp32 norm weights"] /= 2
    if "layernorm" in recompute_modules:
        # each norm's checkpoint keeps its input in the activations' dtype (with ``mlp`` the
        # MLP block's checkpoint keeps the pre-MLP one); the outputs QKV and fc1 saved are
        # discarded after the forward and re-run in backward, with their statistics
        terms["norm inputs"] = 2 * sbh / t_sp * e
        terms["qkv input"] = terms["fc1 input"] = 0.0
        terms["input norm stats"] = terms["pre-mlp norm stats"] = 0.0
        terms["fp32 norm weights"] = 0.0
    if config.multi_latent_attention:            # q / kv latents, padded heads: plan/mla.py
        terms["attention"] = mla_attention_bytes(config, s, b, t, t_sp, e, recompute_modules)
        terms["rope"] = terms["lse"] = 0.0
    return sum(terms.values())


def _contiguous_qk_norms(config) -> bool:
    """LayerNorm q/k norms return head-major contiguous q, k, so the attention output is too and
    the output projection's (s, b, a·d) input is a copy of it (RMSNorm keeps the QKV views'
    strides and the input stays a view)."""
    return config.qk_layernorm and config.normalization == "LayerNorm" and \
        not config.multi_latent_attention


def _qk_norm_stats(config, s: int, b: int, t: int) -> float:
    """The per-head q and k norms' fp32 statistics (one per row for RMSNorm, two for
    LayerNorm) over this rank's a/t query and g/t key heads; 0 without ``qk_layernorm``."""
    if not config.qk_layernorm or config.multi_latent_attention:   # MLA's: its latent norms
        return 0.0
    heads = config.num_attention_heads
    rows = s * b * (heads + (config.num_query_groups or heads)) / t
    return (2 if config.normalization == "LayerNorm" else 1) * rows * 4


def layer_input_bytes(config, micro_batch_size: int) -> float:
    """A layer's input (s/t', b, h), what full recompute keeps per recomputed group."""
    s, b, h, t, t_sp = _sizes(config, micro_batch_size)
    if config.distribute_saved_activations and t_sp == 1:
        t_sp = t                                 # each TP rank keeps 1/tp of the input
    return s * b * h / t_sp * element_bytes(config.params_dtype)


def _chunk_layer_bytes(config, micro_batch_size: int, layers: int) -> tuple[float, float]:
    """(kept per micro-batch, transient while one recomputed group runs its backward)."""
    full = layer_activation_bytes(config, micro_batch_size)
    if config.recompute_granularity != "full" or layers == 0:
        return layers * full, 0.0
    n = config.recompute_num_layers
    kept_input = layer_input_bytes(config, micro_batch_size)
    if config.recompute_method == "uniform":
        groups = math.ceil(layers / n)
        return groups * kept_input, min(n, layers) * full
    recomputed = min(n, layers)             # "block": the first n layers of the chunk
    return recomputed * kept_input + (layers - recomputed) * full, full if recomputed else 0.0


def _embedding_bytes(config, micro_batch_size: int) -> float:
    """The first stage's embedding: the token ids it looks up (int64; over TP the shifted ids
    and the bool mask of the ids outside this rank's rows), learned positions' ids (int64) and
    the hidden dropout's mask."""
    s, b, h, t, t_sp = _sizes(config, micro_batch_size)
    total = s * b * 8 + (s * b if t > 1 else 0)
    if config.position_embedding_type == "learned_absolute":
        total += s * b * 8
    if config.hidden_dropout > 0:
        total += s * b * h / t_sp * element_bytes(config.params_dtype)
    return total


def _loss_bytes(config, micro_batch_size: int) -> float:
    """What the cross-entropy keeps of (s, b) tokens. Over TP (``tp_layers/loss.py``): the
    logits shard with its padded columns (s, b, V_padded/t) in the activations' dtype, the
    labels (int64), the global row maximum and the stacked (sum-exp, target logit) pair (fp32).
    At tp = 1 the unfused torch loss (``kernels/cross_entropy.py`` off CUDA): the fp32 log-softmax
    of the real columns, the labels and its scalar weight. (On CUDA the fused kernel keeps the
    padded logits in their dtype and two fp32 statistics per row, the tp > 1 count.)"""
    s, b, _, t, _ = _sizes(config, micro_batch_size)
    if t == 1:
        return s * b * config.vocab_size * 4 + s * b * 8 + 4
    e = element_bytes(config.params_dtype)
    return s * b * config.padded_vocab_size // t * e + s * b * 8 + 3 * s * b * 4


def _end_bytes(config, micro_batch_size: int, pre: bool, post: bool) -> float:
    s, b, h, t, t_sp = _sizes(config, micro_batch_size)
    e = element_bytes(config.params_dtype)
    total = _embedding_bytes(config, micro_batch_size) if pre else 0.0
    if post:
        layer_norm = config.normalization == "LayerNorm"
        total += s * b * h / t_sp * (4 if layer_norm else e)        # final norm input
        total += (2 if layer_norm else 1) * s * b / t_sp * 4        # its statistics
        if layer_norm and e != 4:
            total += 2 * h * 4                                      # its fp32 weight, bias
        total += s * b * h / t_sp * e                               # output layer input
        total += _loss_bytes(config, micro_batch_size)
    return total


def chunk_activation_bytes(config, micro_batch_size: int, pp_rank: int, chunk: int):
    """(bytes one micro-batch keeps in chunk ``chunk`` of ``pp_rank``, transient bytes)."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    layers = len(layers_for(config, pp_rank, None if vpp is None else chunk))
    kept, transient = _chunk_layer_bytes(config, micro_batch_size, layers)
    pre = pp_rank == 0 and chunk == 0
    post = pp_rank == pp - 1 and chunk == (vpp or 1) - 1
    mtp = _mtp_bytes(config, micro_batch_size) if post else 0.0
    return kept + _end_bytes(config, micro_batch_size, pre, post) + mtp \
        + _rope_tables(config, micro_batch_size), transient


def _mtp_bytes(config, micro_batch_size: int) -> float:
    """What each of the ``mtp_num_layers`` MTP layers keeps per micro-batch (training): the
    embedding of the shifted ids (``_embedding_bytes``), enorm's input and both norms'
    statistics, hnorm's input only as LayerNorm's fp32 copy of 16-bit activations (else it is
    h_{k−1} itself, already kept as an output layer's input), eh_proj's input (s/t', b, 2h),
    a transformer layer, then as the output end (final norm, output layer input, loss), the
    shifted loss mask (fp32), its token count and (16-bit LayerNorm) enorm's and hnorm's fp32
    weights."""
    if not config.mtp_num_layers:
        return 0.0
    s, b, h, t, t_sp = _sizes(config, micro_batch_size)
    e = element_bytes(config.params_dtype)
    layer_norm = config.normalization == "LayerNorm"
    sbh = s * b * h / t_sp
    fp32_copies = layer_norm and e != 4
    per_depth = (_embedding_bytes(config, micro_batch_size)
                 + sbh * (4 if layer_norm else e) + (sbh * 4 if fp32_copies else 0.0)
                 + 2 * (2 if layer_norm else 1) * s * b / t_sp * 4
                 + 2 * sbh * e + layer_activation_bytes(config, micro_batch_size)
                 + _end_bytes(config, micro_batch_size, False, True) + s * b * 4 + 4
                 + (2 * 2 * h * 4 if fp32_copies else 0.0))
    return config.mtp_num_layers * per_depth


def _rope_tables(config, micro_batch_size: int = 2) -> float:
    """The (cos, sin) tables the chunk computes once per forward, as q and k each keep them."""
    if config.multi_latent_attention:
        return mla_rope_table_bytes(config, micro_batch_size)
    if config.position_embedding_type != "rope":
        return 0.0
    s = config.seq_length // config.context_parallel_size
    return 4 * s * config.kv_channels * 4


def schedule_actions(config, num_microbatches: int) -> list:
    """Every pipeline rank's action list as the trainer's executor builds it."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if pp == 1:
        return [build_no_pipelining_schedule(num_microbatches)]
    kind = config.pipeline_schedule or ("interleaved" if (vpp or 1) > 1 else "1f1b")
    if kind == "interleaved":
        group = config.microbatch_group_size_per_vp_stage or pp
        return build_interleaved_schedule(pp, num_microbatches, vpp or 1, group)
    if kind == "zb-h1":
        from tpfuse.pipeline.zero_bubble import build_zb_h1_schedule

        return build_zb_h1_schedule(pp, num_microbatches)
    return build_schedule(pp, num_microbatches)


def in_flight_states(actions: list) -> set:
    """Every distinct vector of in-flight micro-batches per chunk along the action list: a
    forward adds its micro-batch, a B (zero-bubble: W) action releases it."""
    vpp = 1 + max((a.chunk for a in actions), default=0)
    counts = [0] * vpp
    releases = "W" if any(a.kind == "W" for a in actions) else "B"
    states = {tuple(counts)}
    for action in actions:
        if action.kind == "F":
            counts[action.chunk] += 1
            states.add(tuple(counts))
        elif action.kind == releases:
            counts[action.chunk] -= 1
    return states


def in_flight_peak(states, chunk_bytes: list) -> tuple[float, list]:
    """(peak of Σ_c in-flight(c) · chunk_bytes[c] over ``states``, the counts at the peak)."""
    best = max(states, key=lambda counts: sum(c * size for c, size in zip(counts, chunk_bytes)))
    return sum(c * size for c, size in zip(best, chunk_bytes)), list(best)


def _schedule_key(config, num_microbatches: int) -> tuple:
    return (config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size,
            num_microbatches, config.pipeline_schedule,
            config.microbatch_group_size_per_vp_stage)


def schedule_states(config, num_microbatches: int, cache: dict | None = None) -> list:
    """Per pipeline rank, ``in_flight_states`` of its actions (cached by schedule shape)."""
    key = ("states", *_schedule_key(config, num_microbatches))
    if cache is None or key not in cache:
        states = [in_flight_states(a) for a in schedule_actions(config, num_microbatches)]
        if cache is None:
            return states
        cache[key] = states
    return cache[key]


def activation_peaks(config, micro_batch_size: int, num_microbatches: int,
                     cache: dict | None = None) -> list:
    """Per pipeline rank: ``{"bytes", "in_flight"}`` at the schedule's peak (``cache``: a dict
    reused across configs of the same schedule shape)."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    peaks = []
    for pp_rank, states in enumerate(schedule_states(config, num_microbatches, cache)):
        sizes = [chunk_activation_bytes(config, micro_batch_size, pp_rank, c) for c in range(vpp)]
        peak, counts = in_flight_peak(states, [kept for kept, _ in sizes])
        peaks.append({"bytes": int(round(peak + max(t for _, t in sizes))),
                      "in_flight": counts})
    return peaks


def bubble_fraction(config, num_microbatches: int, cache: dict | None = None) -> float:
    """The idle share of the schedule (``pipeline/simulate.py``, backward = 2 × forward)."""
    if config.pipeline_model_parallel_size == 1:
        return 0.0
    key = ("bubble", *_schedule_key(config, num_microbatches))
    if cache is not None and key in cache:
        return cache[key]
    vpp = config.virtual_pipeline_model_parallel_size or 1
    result = simulate(schedule_actions(config, num_microbatches), num_microbatches, vpp,
                      validate=False, analyze_reorders=False)
    if cache is not None:
        cache[key] = result.bubble_fraction
    return result.bubble_fraction
