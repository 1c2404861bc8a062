"""GPTModel: one pipeline model chunk of a GPT, built from the tensor-parallel layers.

    pre_process:   ids (b, s) ─GPTEmbedding→ (s[/tp], b, h)          (else: set_input_tensor)
    every chunk:   layers_for(config, pp_rank, vp_stage) TransformerLayers (full recompute optional)
    post_process:  final norm → output layer (column-parallel over the padded vocab; under SP its
                   fused all-gather restores the full sequence) → logits (s, b, V/tp)
                   → vocab_parallel_cross_entropy → per-token loss (b, s) fp32
    masks:         causal; ``forward(..., document_ids=(b, s))`` keeps attention inside packed
                   documents; ``config.window_size`` adds a sliding window
    context par.:  with cp > 1 every input ``(b, s)`` is this cp rank's ``s/cp`` tokens (chunks
                   r and 2·cp−1−r, ``training.context_parallel.get_batch_on_this_cp_rank``);
                   default positions are their global ones; attention is context-parallel
    inference:     ``forward(..., inference_context=ctx)`` runs the layers on the new tokens only,
                   attention reading/extending ctx's KV cache (see tpfuse.inference); positions
                   default to ctx.sequence_len_offset + 0..s−1; logits of the last token only
                   when ctx.materialize_only_last_token_logits; under SP a step's s must be a
                   multiple of tp (generate runs the other steps with SP off)

Layout-independent initialisation: every global layer i is built inside
``torch.random.fork_rng`` with ``torch.manual_seed(config.seed + LAYER_SEED_OFFSET + i)``, and the
word embedding, position embedding and (untied) output layer each under their own offset. The TP
layers draw full master weights and keep their slice, so any TP/PP/VPP layout holds exactly the
slices of the single-process model, and the caller's generator is left untouched.

Padded vocabulary: the vocabulary masters draw the real ``vocab_size`` rows and append zero rows up
to ``padded_vocab_size`` (which grows with tp); the loss masks the padded logits out of the
softmax. So the model, its loss and its gradients do not depend on the padding: the same seed
gives the same loss at every tp (Megatron draws the padded rows and lets them into the softmax).

Tied output weights (Megatron's default): on a chunk holding both ends the output layer uses the
embedding's Parameter itself. With pp > 1 the last stage holds its own copy, drawn from the same
master (so both start equal; Megatron zeroes it and all-reduces instead) and marked
``shared = shared_embedding = True``; after backward ``allreduce_embedding_grads`` sums the two
gradients over the embedding group so both copies take the same optimizer step.

MoE: with ``num_moe_experts`` set, the layers ``moe_layer_pattern(config)`` marks use an
``MoELayer`` as their MLP block (built where the ParallelMLP would be: the draw order stays per
layer). The chunk's MoE layers share one ``RouterLossTracker`` (``.router_losses``, × cp like
the trainer's main loss): the pipeline executor sets its backward scale via
``set_aux_loss_scale(1/m)``, a loss scaler via ``set_aux_loss_grad_scale(scale)``; the trainer
reads and clears the logged losses.

Multi-token prediction (``mtp_num_layers``): the chunk with the output layer also holds the MTP
block (``multi_token_prediction.py``), which in a training forward with labels attaches the MTP
losses to the final norm's output; the per-token loss returned stays the lm loss. ``forward``'s
``loss_mask`` (b, s) weighs the MTP losses' tokens (None: all). Without the embedding (pp > 1) that
chunk holds ``mtp_embedding``, whose word weight is the tied output layer's Parameter or, untied, a
``shared_embedding`` copy summed with the first stage's like the tied weight.

MLA (``multi_latent_attention``): every layer's attention is a ``tp_layers.mla.MultiLatentAttention``
(``mla_config.mla_builder``), and the forward's rotary tables are its decoupled rope part's.

Model providers and ``build_model`` (one chunk per virtual stage): ``models/build.py``.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from tpfuse.moe.aux_losses import RouterLossTracker
from tpfuse.moe.layer import MoELayer
from tpfuse.parallel.context_split import local_token_index
from tpfuse.tp_layers import (ColumnParallelLinear, Norm, TransformerLayer,
                              vocab_parallel_cross_entropy)
from tpfuse.tp_layers.random import DropoutCoordinates
from tpfuse.tp_layers.rope import default_position_ids, rotary_cos_sin

from .embedding import GPTEmbedding, draw_position_master, draw_vocab_master, draw_word_master
from .layer_assignment import layers_for
from .mla_config import MLA_RECOMPUTE_MODULES, mla_builder, mla_rotary
from .moe_config import is_moe_layer, moe_layer_pattern
from .multi_token_prediction import MultiTokenPredictionBlock, MultiTokenPredictionLayer
from .recompute import run_layers

WORD_EMBEDDING_SEED_OFFSET = 1
POSITION_EMBEDDING_SEED_OFFSET = 2
OUTPUT_LAYER_SEED_OFFSET = 3
MTP_PROJECTION_SEED_OFFSET = 50  # MTP layer k's eh_proj (k < 50) draws under seed + 50 + k
LAYER_SEED_OFFSET = 100          # global layer i draws under seed + 100 + i


@contextlib.contextmanager
def seeded(seed):
    """Draw from a generator seeded with ``seed``; the caller's CPU generator is restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def resolve_state(state=None):
    """``state``, else the default ParallelState; None only in a plain single process."""
    from tpfuse.parallel.state import resolve_state_or_none

    return resolve_state_or_none(state)


def check_layout_matches(config, state):
    """ValueError when the config's parallel sizes disagree with the process groups."""
    if state is None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size"):
            if getattr(config, name) not in (1, None):
                raise ValueError(f"{name}={getattr(config, name)} needs an initialised "
                                 "ParallelState (none is set and torch.distributed is not running)")
        return
    pairs = (("tensor_model_parallel_size", state.tp_size),
             ("pipeline_model_parallel_size", state.pp_size),
             ("context_parallel_size", state.cp_size),
             ("virtual_pipeline_model_parallel_size", state.vpp_size),
             ("expert_model_parallel_size", state.ep_size))
    for name, actual in pairs:
        if getattr(config, name) != actual:
            raise ValueError(f"config {name}={getattr(config, name)} but the ParallelState has "
                             f"{actual}")
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if etp != state.etp_size:
        raise ValueError(f"config expert_tensor_parallel_size={etp} but the ParallelState has "
                         f"{state.etp_size}")


def check_supported(config):
    if config.vocab_size is None:
        raise ValueError("vocab_size is required to build a GPTModel (--vocab-size)")


class GPTModel(nn.Module):
    def __init__(self, config, pre_process=True, post_process=True, vp_stage=None, state=None):
        super().__init__()
        check_supported(config)
        state = resolve_state(state)
        check_layout_matches(config, state)
        if config.virtual_pipeline_model_parallel_size is not None and vp_stage is None:
            raise ValueError("vp_stage is required with virtual_pipeline_model_parallel_size="
                             f"{config.virtual_pipeline_model_parallel_size}")
        self.config, self.state, self.vp_stage = config, state, vp_stage
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.layer_indices = layers_for(config, state.pp_rank if state else 0, vp_stage)
        self.input_tensor = None
        self.dropout_first_sample, self.dropout_forwards = 0, 0
        self.router_losses = RouterLossTracker(state.cp_size if state is not None else 1)

        word_master = None
        self.mtp = self.mtp_embedding = None
        if pre_process or (post_process and (self.share_embeddings_and_output_weights
                                             or config.mtp_num_layers)):
            with seeded(config.seed + WORD_EMBEDDING_SEED_OFFSET):
                word_master = draw_word_master(config)
        self.embedding = self._build_embedding(word_master) if pre_process else None
        self.layers = nn.ModuleList(self._build_layer(i) for i in self.layer_indices)
        if post_process:
            self._build_output(word_master)
        if post_process and config.mtp_num_layers:
            self._build_mtp(word_master)

    # ---------------------------------------------------------------- construction
    def _build_embedding(self, word_master):
        with seeded(self.config.seed + POSITION_EMBEDDING_SEED_OFFSET):
            position_master = draw_position_master(self.config)
        embedding = GPTEmbedding(self.config, word_master, position_master, self.state)
        embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        return embedding

    def _build_layer(self, index):
        c = self.config
        mlp_builder = None
        if is_moe_layer(c, index):        # an MTP layer: the last decoder layer's kind
            def mlp_builder():
                return MoELayer(c, index, self.router_losses, self.state)
        modules = (tuple(c.recompute_modules) if c.recompute_granularity == "selective"
                   else ())
        attention_builder = mla_builder(c, index, modules, self.state)
        with seeded(c.seed + LAYER_SEED_OFFSET + index):
            return TransformerLayer(
                c.hidden_size, c.num_attention_heads, c.ffn_hidden_size,
                num_query_groups=c.num_query_groups, normalization=c.normalization,
                layernorm_epsilon=c.layernorm_epsilon, activation=c.activation,
                add_bias_linear=c.add_bias_linear, hidden_dropout=c.hidden_dropout,
                attention_dropout=c.attention_dropout,
                position_embedding_type=c.position_embedding_type, rotary_base=c.rotary_base,
                sequence_parallel=c.sequence_parallel, init_method_std=c.init_method_std,
                # Megatron's scaled init of the residual-branch output projections
                output_layer_init_std=c.init_method_std / math.sqrt(2.0 * c.num_layers),
                params_dtype=c.params_dtype,
                recompute_modules=tuple(m for m in modules if m not in MLA_RECOMPUTE_MODULES),
                state=self.state, window_size=c.attention_window, cp_comm_type=c.cp_comm_type,
                mlp_builder=mlp_builder, layer_number=index + 1, add_qkv_bias=c.add_qkv_bias,
                qk_layernorm=c.qk_layernorm, kv_channels=c.kv_channels,
                self_attention_builder=attention_builder)

    def _build_output(self, word_master):
        c = self.config
        self.final_norm = Norm(c.hidden_size, normalization=c.normalization,
                               eps=c.layernorm_epsilon, sequence_parallel=c.sequence_parallel,
                               params_dtype=c.params_dtype, state=self.state)
        master = word_master
        if not self.share_embeddings_and_output_weights:
            with seeded(c.seed + OUTPUT_LAYER_SEED_OFFSET):
                master = draw_vocab_master(c)
        self.output_layer = ColumnParallelLinear(
            c.hidden_size, c.padded_vocab_size, bias=False, gather_output=False,
            sequence_parallel=c.sequence_parallel, params_dtype=c.params_dtype,
            master_weight=master, state=self.state)
        if self.share_embeddings_and_output_weights and self.pre_process:
            self.output_layer.weight = self.embedding.word_embeddings.weight   # one Parameter
        elif self.share_embeddings_and_output_weights:
            self.output_layer.weight.shared = True
            self.output_layer.weight.shared_embedding = True
        self.output_layer.weight.is_embedding_or_output_parameter = True

    def _build_mtp(self, word_master):
        """The MTP block (layer k: global layer num_layers + k) and, on a chunk without the
        embedding, the embedding it reads: the tied output layer's Parameter itself, or (untied)
        a copy of the word embedding drawn from the same master, marked ``shared`` /
        ``shared_embedding`` and summed with the first stage's by ``allreduce_embedding_grads``
        (Megatron's copy on the MTP stage). Only rope models get here with pp > 1 (no learned
        positions to keep in sync: ``mtp_config``)."""
        c = self.config

        def build_layer(depth):
            with seeded(c.seed + MTP_PROJECTION_SEED_OFFSET + depth):
                return MultiTokenPredictionLayer(
                    c, depth, lambda: self._build_layer(c.num_layers + depth), self.state)

        self.mtp = MultiTokenPredictionBlock(c, build_layer, self.state)
        if self.pre_process:
            return
        self.mtp_embedding = GPTEmbedding(c, word_master, None, self.state)
        if self.share_embeddings_and_output_weights:
            self.mtp_embedding.word_embeddings.weight = self.output_layer.weight  # one Parameter
            return
        weight = self.mtp_embedding.word_embeddings.weight
        weight.shared = weight.shared_embedding = True
        weight.is_embedding_or_output_parameter = True

    # ---------------------------------------------------------------- pipeline hooks
    def set_input_tensor(self, input_tensor):
        """The activation received from the previous stage (a tensor, or a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def set_aux_loss_scale(self, scale: float) -> None:
        """The gradient the router losses receive in backward: the main loss's scale (1/m)."""
        self.router_losses.set_loss_scale(scale)
        if self.mtp is not None:
            self.mtp.losses.set_loss_scale(scale)

    def set_aux_loss_grad_scale(self, scale: float) -> None:
        """The loss scaler's factor, applied to the router losses' gradient too."""
        self.router_losses.set_grad_scale(scale)
        if self.mtp is not None:
            self.mtp.losses.set_grad_scale(scale)

    def set_dropout_sample_offset(self, consumed_samples: int) -> None:
        """The global index of the first sample of the step about to run (the trainer's consumed
        samples): the k-th training forward of the step then holds samples
        ``consumed + (k·dp + dp_rank)·b + [0, b)``, the data sampler's order."""
        self.dropout_first_sample, self.dropout_forwards = consumed_samples, 0

    def dropout_coordinates(self, batch: int, local_tokens: int, device):
        """This micro-batch's ``DropoutCoordinates`` (training with dropout), else None; counts
        the forward. Positions: this cp rank's tokens' global ones (``local_token_index``)."""
        c = self.config
        if not (self.training and (c.hidden_dropout > 0 or c.attention_dropout > 0)):
            return None
        dp_rank, dp_size = (self.state.dp_rank, self.state.dp_size) if self.state else (0, 1)
        cp, cp_rank = (self.state.cp_size, self.state.cp_rank) if self.state else (1, 0)
        step = self.dropout_forwards * dp_size + dp_rank
        self.dropout_forwards += 1
        return DropoutCoordinates(
            c.seed, self.dropout_first_sample + step * batch,
            local_token_index(local_tokens * cp, cp, cp_rank, device))

    def shared_embedding_or_output_weight(self):
        """The tied word-embedding weight this chunk holds (None when it holds neither end); on
        a last stage with MTP the embedding copy the MTP layers read (tied: the output layer's)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.mtp_embedding is not None:
            return self.mtp_embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def global_parameter_names(self):
        """Local parameter name → the single-process model's name (layers.j → layers.<global>)."""
        names = {}
        for name, _ in self.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":
                parts[1] = str(self.layer_indices[int(parts[1])])
            if parts[0] == "mtp_embedding":          # the last stage's copy (untied, pp > 1)
                parts[0] = "embedding"
            names[name] = ".".join(parts)
        return names

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None,
                inference_context=None, document_ids=None, loss_mask=None):
        if attention_mask is not None:
            raise ValueError("attention_mask: GPTModel takes no dense mask (its attention is "
                             "causal, within document_ids (b, s) for packed documents); pass None")
        if document_ids is not None and inference_context is not None:
            raise ValueError("document_ids with inference_context: the KV cache keeps its own "
                             "document ids (InferenceContext.set_left_padding)")
        has_input = input_ids is not None or self.input_tensor is not None
        if position_ids is None and inference_context is None and has_input \
                and self.state is not None and self.state.cp_size > 1:
            position_ids = self._context_parallel_positions(input_ids)
        if inference_context is not None and self.config.sequence_parallel:
            self._check_sequence_split(input_ids)
        coordinates = None
        if inference_context is None and has_input:
            coordinates = self.dropout_coordinates(*self._local_batch_tokens(input_ids))
        if self.pre_process:
            if position_ids is None:
                offset = inference_context.sequence_len_offset if inference_context else 0
                position_ids = offset + default_position_ids(*input_ids.shape, input_ids.device)
            hidden = self.embedding(input_ids, position_ids, coordinates)  # (s[/tp], b, h)
        elif self.input_tensor is None:
            raise RuntimeError("GPTModel chunk without pre_process: call set_input_tensor(...) "
                               "before forward")
        else:
            hidden = self.input_tensor                                # (s[/tp], b, h)
        rotary = self._rotary_tables(hidden, position_ids)            # once for all layers
        if inference_context is None:
            hidden = run_layers(self.layers, hidden, position_ids, self.config, self.training,
                                rotary_pos_emb=rotary, document_ids=document_ids,
                                dropout_coordinates=coordinates)
        else:
            for layer in self.layers:                                 # KV cache: no recompute
                hidden = layer(hidden, position_ids, inference_context=inference_context,
                               rotary_pos_emb=rotary)
        if not self.post_process:
            return hidden
        if inference_context is not None and inference_context.materialize_only_last_token_logits:
            # (1, b, h); under SP each rank's last row, which the output layer gathers to
            # (tp, b, h): its last row is the step's last token
            hidden = hidden[-1:]
        hidden = self.final_norm(hidden)
        if self._runs_mtp(labels, inference_context):
            hidden = self._attach_mtp_losses(hidden, input_ids, position_ids, labels, loss_mask,
                                             rotary, document_ids, coordinates)
        logits = self.output_layer(hidden)                            # (s, b, V/tp)
        if labels is None:
            return logits.transpose(0, 1).contiguous()                # (b, s, V/tp)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                            vocab_size=self.config.vocab_size,
                                            state=self.state)         # (s, b) fp32
        return loss.transpose(0, 1).contiguous()                      # (b, s)

    def _runs_mtp(self, labels, inference_context) -> bool:
        """MTP runs in a training forward with labels (never in evaluation or generation)."""
        return (self.mtp is not None and self.training and labels is not None
                and inference_context is None and torch.is_grad_enabled())

    def _attach_mtp_losses(self, hidden, input_ids, position_ids, labels, loss_mask, rotary,
                           document_ids, coordinates):
        """h_0 (the final norm's output) with the MTP losses attached (multi_token_prediction)."""
        if input_ids is None:
            raise ValueError(f"mtp_num_layers={self.config.mtp_num_layers}: the chunk with the "
                             "output layer needs the input_ids too (the MTP layers embed the "
                             "tokens ahead): pass the tokens on the last pipeline stage")
        if position_ids is None:
            position_ids = default_position_ids(*input_ids.shape, input_ids.device)
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float32)
        embedding = self.embedding if self.pre_process else self.mtp_embedding

        def embed(ids, positions, site):
            return embedding(ids, positions, coordinates, dropout_site=site)

        def token_losses(h, targets):
            loss = vocab_parallel_cross_entropy(self.output_layer(h), targets.t().contiguous(),
                                                vocab_size=self.config.vocab_size,
                                                state=self.state)                # (s, b)
            return loss.t()                                                       # (b, s)

        return self.mtp(hidden, input_ids, position_ids, labels, loss_mask.to(hidden.device),
                        embed, token_losses, rotary_pos_emb=rotary, document_ids=document_ids,
                        dropout_coordinates=coordinates)

    def _check_sequence_split(self, input_ids):
        """An inference step under SP must split its s tokens over tp (ValueError otherwise)."""
        tp = self.state.tp_size if self.state is not None else 1
        if input_ids is not None and tp > 1 and input_ids.shape[1] % tp:
            raise ValueError(f"inference step of {input_ids.shape[1]} tokens with "
                             f"sequence_parallel=True: tp={tp} must divide it (tpfuse.inference"
                             ".generate runs such steps with sequence parallelism off)")

    def _rotary_tables(self, hidden, position_ids):
        """The rope ``(cos, sin)`` tables ``(b, 1, s, d)`` of this forward over the full sequence
        (None without rope, or without layers)."""
        c = self.config
        mla = c.multi_latent_attention
        if (c.position_embedding_type != "rope" and not mla) or not (len(self.layers)
                                                                  or self.mtp is not None):
            return None
        if position_ids is None:
            tp = c.tensor_model_parallel_size if c.sequence_parallel else 1
            position_ids = default_position_ids(hidden.shape[1], hidden.shape[0] * tp,
                                                hidden.device)
        if mla:                          # MLA: YaRN / rope tables of the decoupled rope part
            return mla_rotary(c).cos_sin(position_ids, c.qk_pos_emb_head_dim)
        return rotary_cos_sin(position_ids, c.kv_channels, c.rotary_base,
                              c.rope_scaling_factor if c.use_rope_scaling else None)

    def _local_batch_tokens(self, input_ids):
        """(b, this cp rank's s/cp tokens, device) of the forward's input."""
        if input_ids is not None:
            return (*input_ids.shape, input_ids.device)
        # a later pipeline stage called without ids: (s/cp[/tp], b, h) received
        tp = self.state.tp_size if self.state is not None and self.config.sequence_parallel else 1
        return (self.input_tensor.shape[1], self.input_tensor.shape[0] * tp,
                self.input_tensor.device)

    def _context_parallel_positions(self, input_ids):
        """``(b, s/cp)`` global positions of this cp rank's two chunks (the default positions)."""
        batch, local, device = self._local_batch_tokens(input_ids)
        cp = self.state.cp_size
        return local_token_index(local * cp, cp, self.state.cp_rank, device).expand(batch, local)


def tied_embedding_weight(model_chunks, state=None):
    """The word-embedding weight this rank sums with the other pipeline end (first ↔ last stage,
    the embedding group); None with pp = 1, untied weights, or outside the embedding group."""
    state = resolve_state(state)
    chunks = [getattr(chunk, "module", chunk) for chunk in model_chunks]
    if state is None or state.pp_size == 1 or not chunks:
        return None
    config = chunks[0].config
    if config.untie_embeddings_and_output_weights and not config.mtp_num_layers:
        return None     # (untied with MTP: the last stage's MTP embedding copy is summed)
    if not state.is_rank_in_embedding_group(ignore_virtual=True):
        return None
    chunk = chunks[0] if state.is_pipeline_first_stage() else chunks[-1]
    weight = chunk.shared_embedding_or_output_weight()
    if weight is None:
        raise RuntimeError("the embedding-group chunk holds no tied weight (was it built with "
                           "the right pre/post_process flags?)")
    return weight


def allreduce_embedding_grads(model_chunks, state=None):
    """Sum the tied word-embedding gradient of the first and last stage (embedding group).

    Call after backward (and the data-parallel gradient reduction), before the optimizer step.
    A no-op with pp = 1, untied weights, or on ranks outside the embedding group.
    """
    weight = tied_embedding_weight(model_chunks, state)
    if weight is None:
        return
    state = resolve_state(state)
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad
    # a sharded (FSDP) gradient: both ends hold the same rows of it, the local shards are summed
    dist.all_reduce(getattr(grad, "_local_tensor", grad), group=state.embedding_group)
