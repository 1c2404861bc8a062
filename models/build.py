"""Model providers and ``build_model``: this rank's GPT model chunks.

``build_model(provider, config, state)`` calls a provider once per virtual stage and passes
``config=`` and ``state=`` to a provider that accepts them (Megatron's newer providers take
``config``), so a provider needs no global to know the model. ``make_gpt_model_provider(config)``
returns a provider closed over an explicit config. ``gpt_model_provider(pre_process,
post_process, vp_stage=None, state=None, config=None)`` has Megatron's signature and needs the
``config`` that ``build_model`` passes.
"""
from __future__ import annotations

import inspect

from .gpt import GPTModel, check_layout_matches, resolve_state

def gpt_model_provider(pre_process=True, post_process=True, vp_stage=None, state=None,
                       config=None):
    """Megatron's model_provider signature: a GPTModel of ``config``, which ``build_model``
    passes (there is no global config to fall back on)."""
    if config is None:
        raise RuntimeError("gpt_model_provider needs config=: build_model(gpt_model_provider, "
                           "config) passes it, or use make_gpt_model_provider(config)")
    return GPTModel(config, pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage, state=state)


def make_gpt_model_provider(config):
    """A model_provider closed over ``config`` (no global state)."""
    def provider(pre_process=True, post_process=True, vp_stage=None, state=None):
        return GPTModel(config, pre_process=pre_process, post_process=post_process,
                        vp_stage=vp_stage, state=state)
    return provider


def _accepts(provider, name: str) -> bool:
    """Does ``provider`` take the keyword ``name`` (by name or through ``**kwargs``)?"""
    try:
        params = inspect.signature(provider).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == name and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD
               for p in params)


def build_model(model_provider, config, state=None):
    """This rank's model chunks, one per virtual stage (Megatron's build_model).

    Chunk c of pipeline rank r gets ``pre_process = (r == 0 and c == 0)`` and
    ``post_process = (r == pp-1 and c == vpp-1)``; ``vp_stage = c`` when vpp is configured.
    """
    resolved = resolve_state(state)
    check_layout_matches(config, resolved)
    pp_rank, pp = (resolved.pp_rank if resolved else 0), config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for c in range(vpp or 1):
        pre, post = pp_rank == 0 and c == 0, pp_rank == pp - 1 and c == (vpp or 1) - 1
        kwargs = dict(pre_process=pre, post_process=post, vp_stage=None if vpp is None else c)
        if state is not None and _accepts(model_provider, "state"):
            kwargs["state"] = state
        if _accepts(model_provider, "config"):
            kwargs["config"] = config
        if vpp is not None:
            resolved.vpp_rank = c        # as Megatron, for providers that read the current chunk
        chunk = model_provider(**kwargs)
        chunk.pre_process, chunk.post_process = pre, post
        chunks.append(chunk)
    if vpp is not None:
        resolved.vpp_rank = 0
    return chunks
