"""TEMPORARY SHIM — plain-torch stand-ins for shared pieces that have not landed yet.

Used only by ``_deps.py`` when ``tpfuse.parallel.mappings`` / a ``tpfuse.kernels`` op cannot be
imported. To be deleted once issues 3 and 4 land; the final tp_layers calls the real pieces.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def _ws(g):
    return dist.get_world_size(g)


def _split(x, dim, g):
    return torch.chunk(x, _ws(g), dim=dim)[dist.get_rank(g)].contiguous()


def _gather(x, dim, g):
    parts = [torch.empty_like(x) for _ in range(_ws(g))]
    dist.all_gather(parts, x.contiguous(), group=g)
    return torch.cat(parts, dim=dim)


def _rs(x, g):
    parts = [p.contiguous() for p in torch.chunk(x, _ws(g), dim=0)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=g)
    return out


def _ar(x, g):
    x = x.clone()
    dist.all_reduce(x, group=g)
    return x


def _fn(fwd, bwd):
    class _F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, g):
            ctx.g = g
            return fwd(x, g)

        @staticmethod
        def backward(ctx, dy):
            return bwd(dy, ctx.g), None
    return lambda x, g: x if _ws(g) == 1 else _F.apply(x, g)


copy_to_region = _fn(lambda x, g: x.view_as(x), _ar)
reduce_from_region = _fn(_ar, lambda d, g: d)
scatter_to_region = _fn(lambda x, g: _split(x, -1, g), lambda d, g: _gather(d, -1, g))
gather_from_region = _fn(lambda x, g: _gather(x, -1, g), lambda d, g: _split(d, -1, g))
scatter_to_sequence_parallel_region = _fn(lambda x, g: _split(x, 0, g), lambda d, g: _gather(d, 0, g))
_gather_sp = _fn(lambda x, g: _gather(x, 0, g), _rs)
reduce_scatter_to_sequence_parallel_region = _fn(_rs, lambda d, g: _gather(d, 0, g))


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True):
    return _gather_sp(x, group)


def _act(y, activation):
    if activation is None:
        return y
    return {"gelu": F.gelu, "relu": F.relu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation](y)


def matmul(a, b, bias=None, activation=None, out_dtype=None, *, backend=None):
    y = a @ b
    if bias is not None:
        y = y + bias
    return _act(y, activation)


def layer_norm(x, weight, bias, eps=1e-5, *, backend=None):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rms_norm(x, weight, eps=1e-5, *, backend=None):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def flash_attention(q, k, v, causal=True, softmax_scale=None, *, backend=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)


def cross_entropy_shard_stats(logits_shard, target, vocab_start):
    lf = logits_shard.float()
    row_max = lf.max(-1).values
    sum_exp = torch.exp(lf - row_max[:, None]).sum(-1)
    local = target - vocab_start
    inside = (local >= 0) & (local < lf.shape[-1])
    tl = lf.gather(1, local.clamp(0, lf.shape[-1] - 1)[:, None])[:, 0]
    return row_max, sum_exp, torch.where(inside, tl, torch.zeros_like(tl))


def cross_entropy_shard_grad(logits_shard, target, vocab_start, global_max, global_sum_exp,
                             grad_loss, ignore_index=-100):
    lf = logits_shard.float()
    p = torch.exp(lf - global_max[:, None]) / global_sum_exp[:, None]
    local = target - vocab_start
    inside = (local >= 0) & (local < lf.shape[-1])
    onehot = torch.zeros_like(p)
    onehot[inside, local[inside]] = 1.0
    g = (p - onehot) * grad_loss[:, None]
    g[target == ignore_index] = 0
    return g.to(logits_shard.dtype)


def bias_dropout_add(x, bias, residual, p, training, seed=None, *, backend=None):
    if bias is not None:
        x = x + bias
    if training and p > 0:
        gen = torch.Generator().manual_seed(
            int(seed) if seed is not None else int(torch.randint(0, 2**31, (1,)).item()))
        keep = (torch.rand(x.shape, generator=gen) >= p).to(x.device)
        x = x * keep / (1 - p)
    return residual + x


def all_gather_matmul(x_shard, w, group, bias=None, activation=None, return_gathered=False):
    full = _gather_sp(x_shard, group)
    y = matmul(full, w.t(), bias, activation)
    return (y, full) if return_gathered else y


def matmul_reduce_scatter(x, w, group):
    return reduce_scatter_to_sequence_parallel_region(x @ w.t(), group)
