"""megatron-core 0.16's ``models.gpt.gpt_model.GPTModel`` over tpfuse's native GPT engine
(``tpfuse.models.GPTModel``).

``GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length, pre_process=True,
post_process=True, fp16_lm_cross_entropy=False, parallel_output=True,
share_embeddings_and_output_weights=False, position_embedding_type='learned_absolute',
rotary_percent=1.0, rotary_base=10000, ...)``: the spec is checked against what tpfuse's layer
computes (``transformer_layer.check_layer_spec``; its q / k norm slots against
``config.qk_layernorm``: ``transformer.attention.qk_norm_slots_checked``), the config is translated
(``transformer/_native.py``) and the native model chunk of this pipeline stage is built; its
parts are registered under Megatron's names::

    embedding.word_embeddings / embedding.position_embeddings        (first stage)
    decoder.layers.<i>.{input_layernorm, self_attention.linear_qkv, self_attention.linear_proj,
                        [self_attention.q_layernorm, self_attention.k_layernorm,]
                        pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2}
    decoder.final_layernorm, output_layer                             (last stage)

``forward(input_ids, position_ids, attention_mask, decoder_input=None, labels=None, ...)``:
the per-token loss ``(b, s)`` fp32 with labels, else the logits ``(b, s, V/tp)`` (all of V with
``parallel_output=False`` or ``runtime_gather_output=True``); a later stage's input comes from
``set_input_tensor`` and it returns its hidden states ``(s[/tp], b, h)``. The attention is
causal; ``attention_mask`` may be None or the causal mask (what Megatron's GPT datasets give).

``sharded_state_dict(prefix='')``: Megatron's torch_dist keys — layers stacked on a leading
axis of ``num_layers`` under ``decoder.layers.<name>`` (global layer numbers, so any pp / vpp
split reads the same tensor), the norms under the TE spec's names from the spec's
``sharded_state_dict_keys_map`` (``...linear_qkv.layer_norm_weight``), tensor-parallel weights
cut along their partition dim, a tied output layer stored as (a non-written replica of)
``embedding.word_embeddings.weight``, and the linear layers' empty ``_extra_state`` objects
Megatron's local spec saves (so a checkpoint goes both ways between tpfuse and megatron-core).
"""
from __future__ import annotations

import torch

from tpfuse.checkpoint.dist.gpt_layout import (  # noqa: F401 (the layout's names, re-exported)
    EXTRA_STATE, LAYERS_PREFIX, LINEARS_WITH_EXTRA_STATE, WORD_EMBEDDING_KEY,
    gpt_sharded_state_dict)
from tpfuse.models.gpt import GPTModel as _NativeGPT

from ...enums import ModelType
from ...tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from ...transformer._native import native_config
from ...transformer.attention import qk_norm_slots_checked
from ...transformer.module import MegatronModule
from ...transformer.transformer_block import TransformerBlock
from ...transformer.transformer_layer import check_causal_mask, check_layer_spec, reject



def _refuse_options(**options) -> None:
    for name, (value, default) in options.items():
        if value != default:
            raise ValueError(f"GPTModel({name}={value!r}) is not implemented by tpfuse; leave it "
                             f"at {default!r}")


def _running_vp_stage(vp_stage):
    """``vp_stage``, or under a virtual pipeline the chunk set by parallel_state's
    ``set_virtual_pipeline_model_parallel_rank`` (Megatron's older providers build chunk i
    after setting the virtual rank to i; megatron-core 0.16 asserts a vp_stage instead)."""
    if vp_stage is not None:
        return vp_stage
    from ... import parallel_state

    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
        return None
    return parallel_state.get_virtual_pipeline_model_parallel_rank()


class LanguageModule(MegatronModule):
    """Megatron's base of language models (``models.common.language_module``)."""


class GPTModel(LanguageModule):
    def __init__(self, config, transformer_layer_spec, vocab_size: int,
                 max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: str = "learned_absolute", rotary_percent: float = 1.0,
                 rotary_base: int = 10000, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0,
                 scatter_embedding_sequence_parallel: bool = True,
                 seq_len_interpolation_factor=None, mtp_block_spec=None, pg_collection=None,
                 vp_stage=None):
        super().__init__(config=config, pg_collection=pg_collection)
        _refuse_options(fp16_lm_cross_entropy=(fp16_lm_cross_entropy, False),
                        rotary_percent=(rotary_percent, 1.0), rope_scaling=(rope_scaling, False),
                        scatter_embedding_sequence_parallel=(scatter_embedding_sequence_parallel,
                                                             True),
                        seq_len_interpolation_factor=(seq_len_interpolation_factor, None),
                        mtp_block_spec=(mtp_block_spec, None))
        self._spec_info = check_layer_spec(
            qk_norm_slots_checked(transformer_layer_spec, config), config)
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        vp_stage = _running_vp_stage(vp_stage)
        self.parallel_output, self.vp_stage = parallel_output, vp_stage
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type, self.rotary_base = position_embedding_type, rotary_base
        self.fp16_lm_cross_entropy, self.rotary_percent = fp16_lm_cross_entropy, rotary_percent
        self.model_type = ModelType.encoder_or_decoder
        self.max_position_embeddings = max_sequence_length
        native = _NativeGPT(native_config(
            config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
            position_embedding_type=position_embedding_type, rotary_base=rotary_base,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights),
            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        object.__setattr__(self, "native", native)     # the engine; its parts registered below
        if pre_process:
            self.embedding = native.embedding
        self.decoder = TransformerBlock.view_of(config, native)
        if post_process:
            self.output_layer = native.output_layer

    # ------------------------------------------------------------------ module plumbing
    def train(self, mode: bool = True):
        super().train(mode)
        self.native.train(mode)
        return self

    def set_input_tensor(self, input_tensor) -> None:
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError("input_tensor should only be length 1 for gpt")
        self.native.set_input_tensor(input_tensor[0])

    def shared_embedding_or_output_weight(self):
        return self.native.shared_embedding_or_output_weight()

    def set_aux_loss_scale(self, scale: float) -> None:
        self.native.set_aux_loss_scale(scale)

    def set_aux_loss_grad_scale(self, scale: float) -> None:
        self.native.set_aux_loss_grad_scale(scale)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, *, inference_params=None, loss_mask=None,
                padding_mask=None):
        check_causal_mask(attention_mask)
        reject(decoder_input=decoder_input, inference_context=inference_context,
               packed_seq_params=packed_seq_params, extra_block_kwargs=extra_block_kwargs,
               inference_params=inference_params, padding_mask=padding_mask)
        # loss_mask is read by Megatron's multi-token prediction only (not built here)
        output = self.native(input_ids, position_ids, labels=labels)
        if not self.post_process or labels is not None:
            return output                            # hidden (s[/tp], b, h) / loss (b, s)
        gather = (not self.parallel_output if runtime_gather_output is None
                  else runtime_gather_output)
        if gather:
            output = gather_from_tensor_model_parallel_region(output)     # (b, s, V)
        return output                                                     # (b, s, V/tp)

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        if sharded_offsets:
            raise ValueError("GPTModel.sharded_state_dict takes no sharded_offsets (the layer "
                             "axis is added inside)")
        if (metadata or {}).get("singleton_local_shards"):
            raise ValueError("sharded_state_dict(metadata={'singleton_local_shards': True}) is "
                             "not supported by tpfuse (it writes Megatron's default layout)")
        # the native chunk's state under this module's (Megatron's) names: checkpoint/dist
        return gpt_sharded_state_dict(self.native, self._spec_info["keys_map"], prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's load_state_dict, without Megatron's ``*._extra_state`` entries (the linear
        layers' extra state: None for the local spec, Transformer Engine's FP8 metadata for
        its spec; tpfuse's layers keep none)."""
        weights = {k: v for k, v in state_dict.items() if not k.endswith(EXTRA_STATE)}
        return super().load_state_dict(weights, strict=strict, assign=assign)
