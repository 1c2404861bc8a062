"""A short sample from a model right after training (the trainer's ``--sample-prompt``).

The trained chunks may use sequence parallelism, dropout or recompute, none of which a decode
step can take, so the sample runs on inference copies: the same layout and layer split with
those settings off, their weights copied from the trained chunks (same shapes, same names). Only
the data-parallel rank 0 replica (cp rank 0) generates — it is a complete model-parallel group —
the other replicas wait for nothing and return None. With expert parallelism (ep > 1) the experts
of one replica live on several data-parallel ranks, and an MoE layer's dispatch is a collective
over the etp × ep group: then every rank generates (every replica feeds the same prompt, so the
dispatch sees the same tokens from every member) and every rank returns the sample.
"""
from __future__ import annotations

import torch

from tpfuse.models.build import build_model, make_gpt_model_provider
from tpfuse.models.cli import config_to_dict
from tpfuse.models.gpt import GPTModel

from .generate import generate
from .loading import INFERENCE_SETTINGS, config_without_sequence_parallel, materialize

LAYOUT_SETTINGS = ("num_layers_per_virtual_pipeline_stage", "microbatch_group_size_per_vp_stage",
                   "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")


def inference_copies(model_chunks, state):
    """Eval-mode chunks of the same layout with inference settings, holding the same weights."""
    trained = model_chunks[0].config
    settings = {k: v for k, v in INFERENCE_SETTINGS.items() if k not in LAYOUT_SETTINGS}
    config = config_without_sequence_parallel(config_to_dict(trained), **settings)
    device = next(model_chunks[0].parameters()).device
    with torch.device("meta"):
        copies = build_model(make_gpt_model_provider(config), config, state)
    for copy, chunk in zip(copies, model_chunks):
        materialize(copy, device).load_state_dict(chunk.state_dict())
        copy.eval()
    return copies


def every_rank_samples(state) -> bool:
    """True without groups, and where experts span data-parallel ranks (ep > 1): see above."""
    return state is None or state.ep_size > 1


def training_sample(model_chunks, tokenizer, prompt: str, max_new_tokens: int, state,
                    **decoding) -> str | None:
    """``prompt`` + its continuation (text) on the dp-rank-0 replica (every rank with ep > 1),
    None elsewhere.

    ``decoding``: ``generate``'s keywords (``greedy=True``, or ``temperature`` / ``top_k`` /
    ``top_p`` / ``seed``; default greedy). The continuation stops at the tokenizer's
    end-of-document id and is cut to the positions a learned-position model has left after the
    prompt."""
    if not all(isinstance(chunk, GPTModel) for chunk in model_chunks):
        raise ValueError("a training sample needs GPTModel chunks (the model provider built "
                         f"{type(model_chunks[0]).__name__})")
    if not every_rank_samples(state) and (state.dp_rank != 0 or (state.rank_in("cp") or 0) != 0):
        return None
    config = model_chunks[0].config
    prompt_ids = tokenizer.tokenize(prompt)
    if config.position_embedding_type == "learned_absolute":
        max_new_tokens = min(max_new_tokens, config.max_position_embeddings - len(prompt_ids))
    copies = inference_copies(model_chunks, state)
    (tokens,) = generate(copies, [prompt_ids], max(max_new_tokens, 0),
                         eos_id=tokenizer.eod if tokenizer.eod < config.vocab_size else None,
                         state=state, **(decoding or {"greedy": True}))
    return prompt + tokenizer.detokenize(tokens)
