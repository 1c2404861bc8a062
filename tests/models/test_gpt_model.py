"""GPTModel against a dense single-process GPT written with plain torch ops (same master weights),
and tensor parallelism (tp=2, with and without sequence parallelism) against tp=1.

Tolerances: everything runs in fp32; the layouts differ only in summation order (split GEMMs,
all-reduces, flash vs explicit softmax), so values agree to ~1e-6 relative. We allow rtol 1e-5 /
atol 2e-6 (gradients are O(1e-3..1e-1)); a wrong slice, scale or missing reduction is O(1e-2).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tpfuse.models import (GPTModel, TransformerConfig, build_model, gpt_model_provider,
                           make_gpt_model_provider)
from tpfuse.tp_layers.init import unshard

TOL = dict(rtol=1e-5, atol=2e-6)
B, S, VOCAB = 2, 8, 61

# make_vocab_size_divisible_by=32 pads 61 -> 64 at tp=1 and tp=2 alike, so both are the same model
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=S, vocab_size=VOCAB,
            make_vocab_size_divisible_by=32, hidden_dropout=0.0, attention_dropout=0.0, seed=11)
VARIANTS = {
    "layernorm-gelu-learned-tied": {},
    "rmsnorm-swiglu-rope-untied-gqa-nobias": dict(
        hidden_size=64, num_attention_heads=4, num_query_groups=2, normalization="RMSNorm",
        activation="swiglu", ffn_hidden_size=96, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, add_bias_linear=False),
}


def make_config(variant="layernorm-gelu-learned-tied", **overrides):
    return TransformerConfig(**{**BASE, **VARIANTS[variant], **overrides})


def sample_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    labels = torch.randint(0, VOCAB, (B, S), generator=gen)
    positions = torch.arange(S).expand(B, S)
    return ids, positions, labels


# ---------------------------------------------------------------- the dense reference GPT
def _norm(x, params, prefix, config):
    weight = params[prefix + ".weight"]
    if config.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * weight
    return F.layer_norm(x, x.shape[-1:], weight, params[prefix + ".bias"],
                        config.layernorm_epsilon)


def _linear(x, params, prefix):
    y = x @ params[prefix + ".weight"].t()
    bias = params.get(prefix + ".bias")
    return y if bias is None else y + bias


def _rotate(x, positions, base):                                  # x (b, heads, s, d)
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None, :, None] * inv_freq      # (b, 1, s, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    first, second = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


def _attention(x, params, prefix, positions, config):             # x (b, s, h)
    b, s, _ = x.shape
    heads, groups = config.num_attention_heads, config.num_query_groups
    d, per_group = config.kv_channels, heads // groups
    # Megatron's grouped QKV rows: per group [q heads of the group; k; v]
    qkv = _linear(x, params, prefix + ".linear_qkv").view(b, s, groups, per_group + 2, d)
    q = qkv[:, :, :, :per_group].reshape(b, s, heads, d).transpose(1, 2)
    k = qkv[:, :, :, per_group].transpose(1, 2).repeat_interleave(per_group, 1)
    v = qkv[:, :, :, per_group + 1].transpose(1, 2).repeat_interleave(per_group, 1)
    if config.position_embedding_type == "rope":
        q, k = _rotate(q, positions, config.rotary_base), _rotate(k, positions, config.rotary_base)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, heads * d)
    return _linear(context, params, prefix + ".linear_proj")


def _mlp(x, params, prefix, config):
    hidden = _linear(x, params, prefix + ".linear_fc1")
    if config.activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)                        # master fc1 = [gate; up]
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden)
    return _linear(hidden, params, prefix + ".linear_fc2")


def dense_gpt(params, config, ids, positions, labels=None):
    """Plain-torch GPT over the master weights ``params`` (single-process names)."""
    x = params["embedding.word_embeddings.weight"][ids]           # (b, s, h)
    if config.position_embedding_type == "learned_absolute":
        x = x + params["embedding.position_embeddings.weight"][positions]
    for i in range(config.num_layers):
        p = f"layers.{i}"
        x = x + _attention(_norm(x, params, p + ".input_norm", config), params,
                           p + ".self_attention", positions, config)
        x = x + _mlp(_norm(x, params, p + ".pre_mlp_norm", config), params, p + ".mlp", config)
    x = _norm(x, params, "final_norm", config)
    output = params.get("output_layer.weight", params["embedding.word_embeddings.weight"])
    logits = x @ output.t()                                       # (b, s, V_padded)
    if labels is None:
        return logits
    real = logits[..., :config.vocab_size]                        # padded logits are masked out
    return F.cross_entropy(real.flatten(0, 1), labels.flatten(), reduction="none").view(ids.shape)


def reference_loss_and_grads(config, ids, positions, labels, loss_weights=None):
    """Dense GPT on the single-process GPTModel's weights: per-token loss and every gradient."""
    model = GPTModel(config)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    loss = dense_gpt(params, config, ids, positions, labels)
    weights = torch.ones_like(loss) / loss.numel() if loss_weights is None else loss_weights
    (loss * weights).sum().backward()
    return loss.detach(), {n: p.grad for n, p in params.items()}


# ---------------------------------------------------------------- single process
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp1_model_matches_dense_reference(variant):
    config = make_config(variant)
    ids, positions, labels = sample_batch()
    ref_loss, ref_grads = reference_loss_and_grads(config, ids, positions, labels)
    model = GPTModel(config)
    loss = model(ids, positions, labels=labels)
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    loss.mean().backward()
    torch.testing.assert_close(loss.detach(), ref_loss, **TOL)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=name)


def test_outputs_without_labels_and_without_post_process():
    config = make_config()
    ids, positions, _ = sample_batch()
    model = GPTModel(config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        logits = model(ids, positions)                            # (b, s, V_padded)
        torch.testing.assert_close(logits, dense_gpt(params, config, ids, positions), **TOL)
        stage = GPTModel(config, pre_process=True, post_process=False)
        hidden = stage(ids, positions)                            # after all layers, no norm
        assert hidden.shape == (S, B, config.hidden_size)         # sequence-first
        head = model.output_layer(model.final_norm(hidden)).transpose(0, 1)
        torch.testing.assert_close(head, logits, **TOL)
        last = GPTModel(config, pre_process=False, post_process=True)
        last.set_input_tensor([model.embedding(ids, positions)])
        torch.testing.assert_close(last(None, positions), logits, **TOL)


def test_construction_leaves_the_callers_generator_alone_and_is_seeded():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = GPTModel(make_config())
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)
    second = GPTModel(make_config())
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    other_seed = GPTModel(make_config(seed=12))
    assert not torch.equal(other_seed.layers[0].mlp.linear_fc1.weight,
                           first.layers[0].mlp.linear_fc1.weight)


@pytest.mark.parametrize("method, num", [("uniform", 2), ("block", 1)])
def test_full_recompute_reproduces_gradients_with_dropout(method, num):
    from tpfuse.tp_layers.random import model_parallel_seed

    ids, positions, labels = sample_batch()
    results = []
    for recompute in (dict(), dict(recompute_granularity="full", recompute_method=method,
                                   recompute_num_layers=num)):
        config = make_config(hidden_dropout=0.2, attention_dropout=0.2, **recompute)
        model = GPTModel(config)
        torch.manual_seed(3)                    # same dropout masks in both runs: the default
        model_parallel_seed(3)                  # generator and the tracker's streams
        model(ids, positions, labels=labels).mean().backward()
        results.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in results[0].items():
        # identical ops and masks: recompute must be bit-for-bit up to fp32 reassociation
        torch.testing.assert_close(results[1][name], grad, **TOL, msg=name)


def test_bad_inputs_raise_clear_errors():
    config = make_config()
    ids, positions, labels = sample_batch()
    model = GPTModel(config)
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, positions, attention_mask=torch.ones(B, 1, S, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="vocab_size is required"):
        GPTModel(TransformerConfig(**{**BASE, "vocab_size": None}))
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        GPTModel(make_config(context_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        GPTModel(make_config(tensor_model_parallel_size=2))
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        GPTModel(config, pre_process=False)(None, positions)


def test_build_model_and_providers_single_process():
    config = make_config()
    chunks = build_model(make_gpt_model_provider(config), config)
    assert len(chunks) == 1 and chunks[0].pre_process and chunks[0].post_process
    assert chunks[0].config is config and chunks[0].layer_indices == [0, 1]
    (chunk,) = build_model(gpt_model_provider, config)
    for a, b in zip(chunk.parameters(), chunks[0].parameters()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="needs config="):
        gpt_model_provider()


# ---------------------------------------------------------------- tensor parallel (gloo)
def _tp_body(variant, overrides, batch):
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers.random import model_parallel_seed

    state = ParallelState.initialize(tp=2)
    try:
        model_parallel_seed(7, state)
        config = make_config(variant, tensor_model_parallel_size=2, **overrides)
        model = GPTModel(config, state=state)
        ids, positions, labels = batch
        loss = model(ids, positions, labels=labels)
        loss.mean().backward()
        grads = {}
        for name, p in model.named_parameters():
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            grads[name] = (p.grad, dim, getattr(p, "partition_stride", 1))
        return loss.detach(), grads
    finally:
        state.destroy()


def assert_tp_results_match(results, ref_loss, ref_grads):
    for loss, _ in results:
        torch.testing.assert_close(loss, ref_loss, **TOL)
    names = results[0][1].keys()
    assert names == ref_grads.keys()
    for name in names:
        _, dim, stride = results[0][1][name]
        if dim is None:                       # replicated: every TP rank holds the full gradient
            for _, grads in results:
                torch.testing.assert_close(grads[name][0], ref_grads[name], **TOL, msg=name)
        else:
            full = unshard([grads[name][0] for _, grads in results], dim, stride)
            torch.testing.assert_close(full, ref_grads[name], **TOL, msg=name)


@pytest.mark.parametrize("variant, sequence_parallel", [
    ("layernorm-gelu-learned-tied", False),
    ("layernorm-gelu-learned-tied", True),
    ("rmsnorm-swiglu-rope-untied-gqa-nobias", True),
])
def test_tp2_matches_single_process(run_distributed, variant, sequence_parallel):
    batch = sample_batch()
    ref_loss, ref_grads = reference_loss_and_grads(make_config(variant), *batch)
    results = run_distributed(2, _tp_body, variant, dict(sequence_parallel=sequence_parallel),
                              batch)
    assert_tp_results_match(results, ref_loss, ref_grads)


def test_tp2_sequence_parallel_recompute_with_dropout_replays_masks(run_distributed):
    """Recompute under SP re-draws from the model-parallel stream: grads equal no-recompute."""
    batch = sample_batch()
    dropout = dict(sequence_parallel=True, hidden_dropout=0.2, attention_dropout=0.2)
    plain = run_distributed(2, _tp_body, "layernorm-gelu-learned-tied", dropout, batch)
    recomputed = run_distributed(2, _tp_body, "layernorm-gelu-learned-tied",
                                 dict(dropout, recompute_granularity="full",
                                      recompute_method="uniform", recompute_num_layers=1), batch)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(plain, recomputed):
        torch.testing.assert_close(loss_b, loss_a, **TOL)
        for name, (grad, _, _) in grads_a.items():
            torch.testing.assert_close(grads_b[name][0], grad, **TOL, msg=name)
