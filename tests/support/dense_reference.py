"""Dense single-process references for the tp_layers tests, written independently of tp_layers.

``master_params(module, state, seed)`` gives every parameter of a tensor-parallel module fresh
well-scaled values (the same master on every rank, each rank keeping its slice according to the
parameter's ``partition_dim`` / ``partition_stride``) and returns the full masters as leaf
tensors; the functions below compute the same block with plain torch ops from those masters:
attention head by head (``F.scaled_dot_product_attention``), rotary embeddings as complex
rotations, the norms from their definitions.
"""
import math

import torch
import torch.nn.functional as F

from support.tp_testing import assembled, assert_close_fp32, chunk_of, seeded_randn
from tpfuse.tp_layers.init import shard

S, B = 8, 2          # check_against_dense's sequence length and batch


def _full_shape(param, tp):
    shape = list(param.shape)
    if getattr(param, "partition_dim", None) is not None:
        shape[param.partition_dim] *= tp
    return shape


def master_params(module, state, seed):
    """Set random masters into ``module`` (sliced per rank); return {name: full master leaf}."""
    masters = {}
    for i, (name, param) in enumerate(module.named_parameters()):
        shape = _full_shape(param, state.tp_size)
        scale = 1.0 / math.sqrt(shape[-1]) if len(shape) == 2 else 0.5
        full = seeded_randn(seed + i, *shape, scale=scale)
        if name.endswith("norm.weight"):
            full = full + 1.0
        dim = getattr(param, "partition_dim", None)
        local = full if dim is None else shard(full, dim, state.tp_size, state.tp_rank,
                                              param.partition_stride)
        with torch.no_grad():
            param.copy_(local)
        masters[name] = full.clone().requires_grad_()
    return masters


def assembled_grads(module, state):
    """{name: full gradient} reassembled from every TP rank's shard."""
    grads = {}
    for name, param in module.named_parameters():
        dim = getattr(param, "partition_dim", None)
        grads[name] = param.grad if dim is None else assembled(param.grad, state, dim,
                                                               param.partition_stride)
    return grads


def check_against_dense(module, state, sp, dense_fn, hidden, tag, position_ids=None, seed=100):
    """Run the TP ``module`` (input and output sequence-split when ``sp``) and ``dense_fn(masters,
    x)`` on the same (s, b, hidden) input and output gradient; compare the output, dx and every
    parameter gradient (reassembled from the shards) at tp_testing's fp32 tolerance. Returns the
    reassembled gradients {name: grad}."""
    masters = master_params(module, state, seed=seed)
    x, dy = seeded_randn(1, S, B, hidden), seeded_randn(2, S, B, hidden)
    xd = x.clone().requires_grad_()
    expected = dense_fn(masters, xd)
    expected.backward(dy)
    x_in = (chunk_of(x, state, 0) if sp else x).clone().requires_grad_()
    args = (x_in,) if position_ids is None else (x_in, position_ids)
    out, bias = module(*args)
    out = out if bias is None else out + bias
    assert_close_fp32(out, chunk_of(expected.detach(), state, 0) if sp else expected.detach(),
                      f"{tag}: output")
    out.backward(chunk_of(dy, state, 0) if sp else dy)
    assert_close_fp32(x_in.grad, chunk_of(xd.grad, state, 0) if sp else xd.grad, f"{tag}: dx")
    grads = assembled_grads(module, state)
    for name, grad in grads.items():
        assert_close_fp32(grad, masters[name].grad, f"{tag}: d{name}")
    return grads


def rope_complex(x, positions, base):
    """Rotate pairs (x_i, x_{i+d/2}) of ``x [b, heads, s, d]`` by pos·base^(−2i/d), as complex."""
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)      # (d/2,)
    angle = positions.double()[:, None, :, None] * inv_freq                    # (b, 1, s, d/2)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def dense_attention(p, prefix, x, heads, groups, rope_base=None, positions=None, keep=None,
                    qk_norm=None):
    """Causal self-attention, head by head, from the fused-QKV master (Megatron's grouped layout);
    ``keep`` (bool, broadcastable to (b, 1, s, s)) replaces the causal mask when given;
    ``qk_norm`` ``(normalization, eps)``: each head's q and k normalised over d with the masters
    ``q_layernorm.*`` / ``k_layernorm.*``, before rotary."""
    s, b, h = x.shape
    d, per_group = h // heads, heads // groups
    qkv = F.linear(x, p[prefix + "linear_qkv.weight"], p.get(prefix + "linear_qkv.bias"))
    block = (per_group + 2) * d                                                # rows per group
    outputs = []
    for head in range(heads):
        g = head // per_group
        q = qkv[..., g * block + (head % per_group) * d:][..., :d]            # (s, b, d)
        k = qkv[..., g * block + per_group * d:][..., :d]
        v = qkv[..., g * block + (per_group + 1) * d:][..., :d]
        q, k, v = (t.permute(1, 0, 2)[:, None] for t in (q, k, v))            # (b, 1, s, d)
        if qk_norm is not None:
            q = dense_norm(p, prefix + "q_layernorm.", q, *qk_norm)
            k = dense_norm(p, prefix + "k_layernorm.", k, *qk_norm)
        if rope_base is not None:
            q, k = rope_complex(q, positions, rope_base), rope_complex(k, positions, rope_base)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                      is_causal=keep is None)[:, 0])
    context = torch.cat(outputs, dim=-1).permute(1, 0, 2)                      # (s, b, heads·d)
    return F.linear(context, p[prefix + "linear_proj.weight"], p.get(prefix + "linear_proj.bias"))


def dense_mlp(p, prefix, x, activation):
    hidden = F.linear(x, p[prefix + "linear_fc1.weight"], p.get(prefix + "linear_fc1.bias"))
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden)
    return F.linear(hidden, p[prefix + "linear_fc2.weight"], p.get(prefix + "linear_fc2.bias"))


def dense_norm(p, prefix, x, normalization, eps):
    weight = p[prefix + "weight"]
    if normalization == "RMSNorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return F.layer_norm(x, x.shape[-1:], weight, p[prefix + "bias"], eps)


def dense_transformer_layer(p, x, cfg, positions):
    rope = cfg["rotary_base"] if cfg.get("position_embedding_type") == "rope" else None
    groups = cfg.get("num_query_groups") or cfg["num_attention_heads"]
    eps, norm = cfg.get("layernorm_epsilon", 1e-5), cfg.get("normalization", "LayerNorm")
    y = x + dense_attention(p, "self_attention.", dense_norm(p, "input_norm.", x, norm, eps),
                            cfg["num_attention_heads"], groups, rope, positions)
    return y + dense_mlp(p, "mlp.", dense_norm(p, "pre_mlp_norm.", y, norm, eps),
                         cfg.get("activation", "gelu"))
