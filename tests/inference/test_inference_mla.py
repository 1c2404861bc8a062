"""Generation with multi-latent attention: the KV cache holds each token's normalised kv latent
and rotated rope key only, and cached prefill + decode steps give the logits of the full
(training-path) forward — single process, with left padding, and at tp 2 + SP (the prefill split
over TP, decode steps with SP off, as ``generate`` runs them).

Tolerance: as tests/inference/test_inference.py — the cached path expands the cached latents
and attends over them, the full forward runs the training path: the same fp32 function through
other GEMM shapes, ~1e-7 relative per operation over two layers of width <= 32, far below 1e-5;
a latent cached at the wrong position, a rope key rotated twice or a missed mask moves logits
by 1e-2 or more.
"""
import pytest
import torch
import torch.distributed as dist

from tpfuse.inference import InferenceContext, generate
from tpfuse.inference.sequence_parallel import sequence_parallel_disabled
from tpfuse.models import GPTModel, TransformerConfig

KV_RANK, ROPE_DIM = 12, 4
STEPS = ((0, 4), (4, 5), (5, 6), (6, 8), (8, 9))
SHAPES = {
    "q-lora-yarn": dict(q_lora_rank=8, rotary_scaling_factor=4.0, mscale_all_dim=1.0,
                        original_max_position_embeddings=4),
    "no-q-lora-rope": dict(rope_type="rope"),
}


def _config(**overrides):
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24,
                  vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0, seed=3,
                  multi_latent_attention=True, kv_lora_rank=KV_RANK, qk_head_dim=4,
                  qk_pos_emb_head_dim=ROPE_DIM, v_head_dim=6, qk_layernorm=True,
                  normalization="RMSNorm", position_embedding_type="rope")
    return TransformerConfig(**{**values, **overrides})


def _cached_logits(model, ids, context, steps=STEPS, step_context=None):
    pieces = []
    with torch.no_grad():
        for start, end in steps:
            with step_context(end - start) if step_context else torch.no_grad():
                pieces.append(model(ids[:, start:end], inference_context=context))
            context.increment_sequence_len_offset(end - start)
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cached_decode_equals_full_forward_and_caches_only_latents(shape):
    model = GPTModel(_config(**SHAPES[shape])).eval()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
    context = InferenceContext(2, 9, materialize_only_last_token_logits=False)
    torch.testing.assert_close(_cached_logits(model, ids, context), full, rtol=1e-5, atol=1e-5)
    caches = list(context.key_value_memory_dict.values())
    assert len(caches) == 2
    for latent, rope_key in caches:                    # (kv_lora_rank + d_pe) values per token
        assert latent.shape == (2, 1, 9, KV_RANK) and rope_key.shape == (2, 1, 9, ROPE_DIM)


def test_left_padding_does_not_change_a_sequence():
    model = GPTModel(_config(**SHAPES["q-lora-yarn"])).eval()
    short, long = [5, 6, 7], [1, 2, 3, 4, 8, 9]
    with torch.no_grad():
        alone = model(torch.tensor([short]))[0, -1]
        context = InferenceContext(2, 8)
        context.set_left_padding([3, 0])
        batch = torch.tensor([[0, 0, 0] + short, long])
        positions = torch.tensor([[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
        padded = model(batch, positions, inference_context=context)[0, -1]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_generate_with_cache_equals_recomputation():
    model = GPTModel(_config(**SHAPES["q-lora-yarn"])).eval()
    prompts = [[10, 20, 30, 40, 50], [7], [99, 3, 42]]
    cached = generate(model, prompts, 5, greedy=True)
    assert cached == generate(model, prompts, 5, greedy=True, use_cache=False)


def _tp2_sequence_parallel_cache(ids, full):
    """At tp 2 + SP: prefill of 4 tokens split over TP, odd steps with SP off; vocab shards
    gathered and compared with the single-process full forward of the same (layout-independent)
    weights."""
    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(tp=2)
    try:
        config = _config(**SHAPES["q-lora-yarn"], tensor_model_parallel_size=2,
                         sequence_parallel=True)
        model = GPTModel(config, state=state).eval()
        context = InferenceContext(2, 9, materialize_only_last_token_logits=False)

        def step_context(num_tokens):
            return (torch.no_grad() if num_tokens % 2 == 0
                    else sequence_parallel_disabled([model]))
        shard = _cached_logits(model, ids, context, step_context=step_context)   # (b, s, V/tp)
        parts = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard.contiguous(), group=state.tp_group)
        logits = torch.cat(parts, dim=-1)[..., :full.shape[-1]]
        torch.testing.assert_close(logits, full[..., :logits.shape[-1]], rtol=1e-5, atol=1e-5)
        return True
    finally:
        state.destroy()


def test_tp2_sequence_parallel_cache_equals_single_process(run_distributed):
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = GPTModel(_config(**SHAPES["q-lora-yarn"])).eval()(ids)
    assert run_distributed(2, _tp2_sequence_parallel_cache, ids, full) == [True, True]
