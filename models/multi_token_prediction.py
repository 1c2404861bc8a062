"""Multi-token prediction (DeepSeek-V3's MTP; Megatron-core's ``MultiTokenPredictionBlock``).

``--mtp-num-layers D`` adds D sequential MTP layers after the decoder, on the chunk that holds the
output layer (the last pipeline stage, its last virtual chunk). With ``h_0`` the decoder's output
after the final norm (what the output layer reads), ids ``t``, positions ``p``, labels ``y`` and
loss mask ``m`` of a micro-batch, and ``roll`` the shift one step left along the sequence with the
vacated last entry 0 (Megatron's ``roll_tensor``; under context parallelism the shift of the whole
sequence, each cp rank's chunks taking the next chunks' first tokens from their holders:
``parallel.context_sequence``), for k = 1..D::

    t_k, p_k, y_k, m_k = roll(t_{k-1}), roll(p_{k-1}), roll(y_{k-1}), roll(m_{k-1})
    e_k   = embedding(t_k, p_k)                        the main model's (shared) embedding
    x_k   = eh_proj([enorm(e_k); hnorm(h_{k-1})])      2h → h, embedding first (Megatron's order)
    h_k   = final_layernorm_k(transformer_layer_k(x_k))    the main rotary tables / documents
    loss_k = Σ m_k · CE(output_layer(h_k), y_k) / max(Σ m_k, 1)      the lm loss's token mean

    L_mtp = mtp_loss_scaling_factor / D · Σ_k loss_k

The sums in ``loss_k`` run over the whole sequence: under context parallelism each cp rank
back-propagates cp · (its Σ m_k · CE) / (Σ over the cp group of Σ m_k), and records the whole
sequence's loss_k, as the lm loss (``masked_sequence_mean``; Megatron's ranks use their own
token counts, which differ by the masked global last tokens). The hidden states are never rolled.

The MTP loss is not part of the returned per-token lm loss: each ``loss_k`` rides on ``h_0``
(``attach_mtp_loss``, Megatron's ``MTPLossAutoScaler``) and receives, in h_0's backward, the
gradient ``factor / D · backward_scale``, where ``backward_scale`` is the main loss's (1/m for m
micro-batches, set by the pipeline executor, times the loss scaler's scale): the step's gradient
is that of mean_micro-batches(lm loss + L_mtp). ``loss_k`` is recorded at that moment too, summed
over the step's micro-batches (``MTPLossTracker``; ``training/mtp_logging.py`` reports
``mtp_k loss`` = its mean over micro-batches and data-parallel replicas).

Only a training forward with labels runs the MTP layers: evaluation (the validation loss is the
lm loss alone, as Megatron reports it) and generation skip them.

Layer k's transformer layer is global layer ``num_layers + k`` (Megatron's layer number of the MTP
transformer layer): it draws under that layer's seed (``seed + LAYER_SEED_OFFSET + num_layers + k
− 1``) and its eh_proj under ``seed + MTP_PROJECTION_SEED_OFFSET + k − 1`` (``models/gpt.py``), so
any layout holds the same MTP weights, and the main model's weights are those of the same config
without MTP. Its dropout sites are those of that layer number (the MTP embedding's: the layer's
free site 0).
"""
from __future__ import annotations

import torch
from torch import nn

from tpfuse.parallel.context_sequence import masked_sequence_mean, roll_left_over_context
from tpfuse.parallel.mappings import gather_from_region, scatter_to_sequence_parallel_region
from tpfuse.tp_layers import ColumnParallelLinear, Norm
from tpfuse.tp_layers.init import draw_master_weight, normal_init
from tpfuse.tp_layers.random import EMBEDDING_SITE, dropout_site


def mtp_layer_number(config, depth: int) -> int:
    """The global layer number (from 1) of MTP layer ``depth`` (from 0): num_layers + depth + 1."""
    return config.num_layers + depth + 1


class MTPLossTracker:
    """The backward scale of the MTP losses (``loss_scale``, 1/m, × ``grad_scale``, the loss
    scaler's) and, for logging, each depth's loss summed over the step's micro-batches."""

    def __init__(self):
        self.loss_scale, self.grad_scale = 1.0, 1.0
        self.values: dict[int, torch.Tensor] = {}

    def set_loss_scale(self, scale: float) -> None:
        self.loss_scale = float(scale)

    def set_grad_scale(self, scale: float) -> None:
        self.grad_scale = float(scale)

    @property
    def backward_scale(self) -> float:
        return self.loss_scale * self.grad_scale

    def record(self, depth: int, value: torch.Tensor) -> None:
        value = value.detach().float().reshape(())
        self.values[depth] = self.values[depth] + value if depth in self.values else value

    def clear(self) -> None:
        self.values = {}


class _AttachMTPLoss(torch.autograd.Function):
    """forward: x; backward: dx, and d loss = weight · tracker.backward_scale (value recorded)."""

    @staticmethod
    def forward(ctx, x, loss, tracker, depth, weight, value):
        ctx.tracker, ctx.depth, ctx.weight = tracker, depth, weight
        ctx.value = loss.detach() if value is None else value.detach()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        ctx.tracker.record(ctx.depth, ctx.value)
        scale = ctx.weight * ctx.tracker.backward_scale
        grad = torch.full((), scale, dtype=torch.float32, device=dx.device)
        return dx, grad, None, None, None, None


def attach_mtp_loss(x, loss, tracker: MTPLossTracker, depth: int, weight: float, value=None):
    """``x`` unchanged; in its backward ``weight · loss`` is differentiated (times the tracker's
    backward scale) and ``value`` (default: ``loss``) recorded as depth ``depth``'s."""
    return _AttachMTPLoss.apply(x, loss, tracker, depth, weight, value)


class MultiTokenPredictionLayer(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj (column-parallel 2h → h, no bias), a transformer
    layer, final_layernorm. ``transformer_layer``: the TransformerLayer, built by the model
    after eh_proj's draw."""

    def __init__(self, config, depth: int, build_transformer_layer, state=None):
        super().__init__()
        c = config
        self.depth, self.sequence_parallel = depth, c.sequence_parallel
        norm = dict(normalization=c.normalization, eps=c.layernorm_epsilon,
                    sequence_parallel=c.sequence_parallel, params_dtype=c.params_dtype,
                    state=state)
        self.enorm = Norm(c.hidden_size, **norm)
        self.hnorm = Norm(c.hidden_size, **norm)
        master = draw_master_weight(c.hidden_size, 2 * c.hidden_size,
                                    normal_init(c.init_method_std))
        self.eh_proj = ColumnParallelLinear(
            2 * c.hidden_size, c.hidden_size, bias=False, gather_output=False,
            sequence_parallel=c.sequence_parallel, params_dtype=c.params_dtype,
            master_weight=master, state=state)
        self.transformer_layer = build_transformer_layer()
        self.final_layernorm = Norm(c.hidden_size, **norm)

    def forward(self, hidden, decoder_input, position_ids, rotary_pos_emb=None,
                document_ids=None, dropout_coordinates=None):
        """(s[/tp], b, h) hidden of depth k−1 and embedding of the tokens k ahead → depth k's."""
        x = torch.cat((self.enorm(decoder_input), self.hnorm(hidden)), dim=-1)  # (s[/tp], b, 2h)
        x = self.eh_proj(x)                                                     # (s, b, h/tp)
        group = self.eh_proj.tp.group
        x = gather_from_region(x, group)                                        # (s, b, h)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, group)                   # (s/tp, b, h)
        x = self.transformer_layer(x, position_ids, rotary_pos_emb=rotary_pos_emb,
                                   document_ids=document_ids,
                                   dropout_coordinates=dropout_coordinates)
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(nn.Module):
    """The D MTP layers and their loss tracker (see the module docstring)."""

    def __init__(self, config, build_layer, state=None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(build_layer(depth) for depth in range(config.mtp_num_layers))
        self.losses = MTPLossTracker()
        self.cp_group, self.cp_size, self.cp_rank = (
            (state.cp_group, state.cp_size, state.cp_rank) if state is not None and
            state.cp_size > 1 else (None, 1, 0))

    def roll(self, x: torch.Tensor) -> torch.Tensor:
        """``roll_left`` of the whole sequence, this cp rank's chunks of it (a collective over
        the cp group when cp > 1)."""
        return roll_left_over_context(x, self.cp_group, self.cp_size, self.cp_rank)

    def forward(self, hidden, input_ids, position_ids, labels, loss_mask, embed, token_losses,
                rotary_pos_emb=None, document_ids=None, dropout_coordinates=None):
        """``hidden`` (h_0, (s[/tp], b, h)) with every depth's loss attached.

        ``embed(ids, positions, site)``: the main embedding, (b, s) → (s[/tp], b, h), dropout at
        ``site``; ``token_losses(h, labels)``: the output layer's per-token loss (b, s) fp32;
        input_ids, position_ids, labels, loss_mask: (b, s); the transformer layers see the
        unshifted positions (the main rotary tables), the embedding the shifted ones."""
        weight = self.config.mtp_loss_scaling_factor / len(self.layers)
        mask = loss_mask.float()
        current, shifted_positions = hidden, position_ids
        for depth, layer in enumerate(self.layers):
            input_ids, shifted_positions = self.roll(input_ids), self.roll(shifted_positions)
            labels, mask = self.roll(labels), self.roll(mask)
            site = dropout_site(mtp_layer_number(self.config, depth), EMBEDDING_SITE)
            decoder_input = embed(input_ids, shifted_positions, site)
            current = layer(current, decoder_input, position_ids,
                            rotary_pos_emb=rotary_pos_emb, document_ids=document_ids,
                            dropout_coordinates=dropout_coordinates)
            loss, value = masked_sequence_mean(token_losses(current, labels), mask,
                                               self.cp_group, self.cp_size)
            hidden = attach_mtp_loss(hidden, loss, self.losses, depth, weight, value)
        return hidden
