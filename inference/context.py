"""InferenceContext: the KV cache of every attention layer, for prefill + incremental decode.

Megatron-core's static inference context, small: one object passed down as
``GPTModel.forward(..., inference_context=ctx)`` → ``TransformerLayer`` → ``ParallelAttention``.

    ctx = InferenceContext(max_batch_size=b, max_sequence_length=S)
    ctx.set_left_padding(pad_lengths)                  # optional: (b,) pads before each prompt
    logits = model(prompt, inference_context=ctx)      # prefill: s = prompt length, offset 0
    ctx.increment_sequence_len_offset(prompt.shape[1])
    logits = model(next_tokens[:, None], inference_context=ctx)   # decode: s = 1, offset = s_p
    ctx.increment_sequence_len_offset(1)               # ... once per step, after all layers

Cache per attention layer (keyed by the layer module): k and v ``[b_max, g_l, S, d]`` where g_l
is the layer's *local* KV-head count: grouped-query attention stores ng ≤ nh heads and tensor
parallelism gives each rank ng/tp of them, so a rank's cache is ``2·b·S·(ng/tp)·d`` elements
per layer. A step with s new tokens writes positions ``offset .. offset+s−1`` and the layer
attends over ``0 .. offset+s−1``.

Multi-latent attention (``tp_layers/mla.py``) caches, per token, its normalised kv latent and its
rotated rope key instead: ``[b_max, 1, S, kv_lora_rank]`` and ``[b_max, 1, S, qk_pos_emb_head_dim]``,
the same on every TP rank, i.e. ``(kv_lora_rank + qk_pos_emb_head_dim) · bytes`` per token per
layer (DeepSeek-V3 in bf16: (512 + 64) · 2 = 1152 bytes, against 2 · 128 · 192 · 2 = 98 304 for its
128 heads' full keys and values), expanded to keys and values at every step.

Left padding: batched prompts of different lengths are padded on the left to one length (the last
prompt token of every sequence then sits at the same index). ``set_left_padding`` marks the pads
as document 0 and real tokens as document 1; attention only looks within a document, so real
tokens never see pads and a sequence's outputs do not depend on its padding (its positions are
counted from its first real token by the caller).
"""
from __future__ import annotations

import torch


class InferenceContext:
    def __init__(self, max_batch_size: int, max_sequence_length: int, *,
                 materialize_only_last_token_logits: bool = True):
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(f"InferenceContext: max_batch_size={max_batch_size} and "
                             f"max_sequence_length={max_sequence_length} must be >= 1")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.sequence_len_offset = 0            # tokens already in every layer's cache
        self.key_value_memory_dict: dict = {}   # attention module → (k cache, v cache)
        self.key_document_ids = None            # (b, S) int32: 0 = left pad, 1 = token

    def set_left_padding(self, pad_lengths) -> None:
        """``pad_lengths`` (b,): sequence i starts with that many padding tokens (the ids live on
        ``pad_lengths``' device when it is a tensor)."""
        pads = torch.as_tensor(pad_lengths, dtype=torch.int64).reshape(-1)
        if pads.numel() > self.max_batch_size or bool((pads < 0).any()):
            raise ValueError(f"pad_lengths {pads.tolist()} must be >= 0, at most "
                             f"max_batch_size={self.max_batch_size} of them")
        positions = torch.arange(self.max_sequence_length, device=pads.device)
        self.key_document_ids = (positions[None, :] >= pads[:, None]).to(torch.int32)

    def document_ids(self, offset: int, num_queries: int):
        """(query ids (b, s), key ids (b, offset + s)) of the step, or (None, None) unpadded."""
        ids = self.key_document_ids
        if ids is None:
            return None, None
        end = offset + num_queries
        return ids[:, offset:end], ids[:, :end]

    def update_kv_cache(self, layer, key: torch.Tensor, value: torch.Tensor):
        """Write the step's key/value ``[b, g_l, s, d]`` (the value may have its own head count
        and dim: an MLA layer's latent and rope key); return the cached
        ``[b, g_l, offset + s, d]``."""
        batch, groups, seq, dim = key.shape
        offset, end = self.sequence_len_offset, self.sequence_len_offset + seq
        if batch > self.max_batch_size or end > self.max_sequence_length:
            raise ValueError(f"InferenceContext: a step of batch {batch} ending at position {end} "
                             f"exceeds max_batch_size={self.max_batch_size} / "
                             f"max_sequence_length={self.max_sequence_length}")
        if layer not in self.key_value_memory_dict:
            if offset != 0:
                raise RuntimeError("InferenceContext: a layer's first step must be the prefill "
                                   f"(offset 0), got offset {offset}")
            shape = (self.max_batch_size, groups, self.max_sequence_length, dim)
            value_shape = (self.max_batch_size, value.shape[1], self.max_sequence_length,
                           value.shape[3])
            self.key_value_memory_dict[layer] = (key.new_empty(shape),
                                                 value.new_empty(value_shape))
        key_cache, value_cache = self.key_value_memory_dict[layer]
        key_cache[:batch, :, offset:end] = key
        value_cache[:batch, :, offset:end] = value
        return key_cache[:batch, :, :end], value_cache[:batch, :, :end]

    def increment_sequence_len_offset(self, num_tokens: int) -> None:
        """Call once per model step (after the last layer of the last stage has run)."""
        self.sequence_len_offset += num_tokens

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept for the next batch)."""
        self.sequence_len_offset = 0
        self.key_document_ids = None
