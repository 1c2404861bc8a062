"""megatron-core 0.16's ``transformer.transformer_block``: ``TransformerBlock`` — this pipeline
stage's layers (tpfuse's layer assignment: ``layers_for``) and, on the last stage, the final
norm (``final_layernorm``).

Built on its own it holds the layers of a tpfuse GPTModel stage without embedding and output
layer; inside the compat GPTModel it is the view of that model's layers under Megatron's names
(``decoder.layers.<i>...``, ``decoder.final_layernorm``). ``forward(hidden_states,
attention_mask, ...)`` → hidden states ``(s[/tp], b, h)``; on a later stage the input comes
from ``set_input_tensor``, as in Megatron.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Union

import torch

from tpfuse.tp_layers import Norm

from .module import MegatronModule
from .spec_utils import ModuleSpec
from .transformer_layer import TransformerLayer, adopt_layer, check_causal_mask, reject


@dataclass
class TransformerBlockSubmodules:
    layer_specs: List[ModuleSpec] = field(default_factory=list)
    layer_norm: Union[ModuleSpec, type] = None


def _layer_view(config, native_layer, layer_number):
    view = TransformerLayer.__new__(TransformerLayer)
    MegatronModule.__init__(view, config=config)
    view.layer_number = layer_number
    adopt_layer(view, native_layer)
    return view


class TransformerBlock(MegatronModule):
    def __init__(self, config, spec, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None, vp_stage=None):
        super().__init__(config=config, pg_collection=pg_collection)
        from tpfuse.models.gpt import GPTModel as NativeGPT

        from ._native import native_config, parallel_sizes
        from .attention import qk_norm_slots_checked
        from .transformer_layer import check_layer_spec

        check_layer_spec(qk_norm_slots_checked(spec, config), config)
        sizes = parallel_sizes(config)
        tp = sizes["tensor_model_parallel_size"]
        shortest = 2 * tp * sizes["context_parallel_size"]        # no embedding is built
        native = NativeGPT(native_config(config, vocab_size=tp, max_sequence_length=shortest),
                           pre_process=False, post_process=False, vp_stage=vp_stage)
        final = None
        if post_process and post_layer_norm:
            final = Norm(config.hidden_size, normalization=config.normalization,
                         eps=config.layernorm_epsilon, sequence_parallel=config.sequence_parallel,
                         params_dtype=config.params_dtype)
        self._adopt(native, final)
        self.pre_process, self.post_process = pre_process, post_process

    @classmethod
    def view_of(cls, config, native_gpt):
        """The block of a native tpfuse GPTModel chunk (its layers and final norm)."""
        block = cls.__new__(cls)
        MegatronModule.__init__(block, config=config)
        block._adopt(native_gpt, getattr(native_gpt, "final_norm", None))
        block.pre_process, block.post_process = native_gpt.pre_process, native_gpt.post_process
        return block

    def _adopt(self, native, final_norm):
        object.__setattr__(self, "_native", native)
        self.layers = torch.nn.ModuleList(
            _layer_view(self.config, layer, index + 1)
            for layer, index in zip(native.layers, native.layer_indices))
        self.final_layernorm = final_norm
        self.input_tensor = None

    @property
    def num_layers_per_pipeline_rank(self) -> int:
        return len(self.layers)

    def train(self, mode: bool = True):
        super().train(mode)
        self._native.train(mode)
        return self

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                attention_bias=None, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None, **kwargs):
        check_causal_mask(attention_mask)
        reject(context=context, context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
               rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
               attention_bias=attention_bias, inference_context=inference_context,
               packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
               inference_params=inference_params)
        if not self.pre_process:
            hidden_states = self.input_tensor
        for layer in self._native.layers:
            hidden_states = layer(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
