"""A dense single-process mixture of experts in plain torch, written independently of tpfuse.moe:
token by token, each routed expert's MLP applied to the token and weighted by its probability.
Used in float64 as the reference of the router, loss and layer tests.

Masters (full, single-process shapes): ``router (E, h)``, ``w1 (E, h, F1)``, ``b1 (E, F1)``,
``w2 (E, F, h)``, ``b2 (E, h)``; F1 = 2F for swiglu (``[gate | up]``); optionally the shared
expert ``shared_fc1 (F_s·g, h)``, ``shared_fc1_bias``, ``shared_fc2 (h, F_s)``,
``shared_fc2_bias`` (nn.Linear layout, g = 2 for swiglu) and its gate ``shared_gate (1, h)``
(the shared output scaled by σ(x·shared_gateᵀ)).
"""
import math

import torch
import torch.nn.functional as F


def route_token(logits_row, topk, score_function="softmax", pre_softmax=False, scaling=None):
    """[(expert, probability)] of one token, by sorting its logits."""
    order = sorted(range(len(logits_row)), key=lambda e: -float(logits_row[e].detach()))[:topk]
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits_row)
        chosen = torch.stack([scores[e] for e in order])
        chosen = chosen / chosen.sum() if topk > 1 else chosen
    elif pre_softmax:
        scores = torch.softmax(logits_row, dim=0)
        chosen = torch.stack([scores[e] for e in order])
    else:
        chosen = torch.softmax(torch.stack([logits_row[e] for e in order]), dim=0)
    if scaling:
        chosen = chosen * scaling
    return list(zip(order, chosen))


def _act(h, activation):
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")


def expert_mlp(x, m, e, activation):
    h = x @ m["w1"][e]
    if "b1" in m:
        h = h + m["b1"][e]
    y = _act(h, activation) @ m["w2"][e]
    return y + m["b2"][e] if "b2" in m else y


def shared_mlp(x, m, activation):
    h = F.linear(x, m["shared_fc1"], m.get("shared_fc1_bias"))
    y = F.linear(_act(h, activation), m["shared_fc2"], m.get("shared_fc2_bias"))
    if "shared_gate" in m:
        y = y * torch.sigmoid(x @ m["shared_gate"].t())
    return y


def balance_scores(logits, score_function):
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / scores.sum(dim=-1, keepdim=True)


def load_balancing_loss(logits, topk, cfg, batch):
    """Switch (per micro-batch) or per-sequence balance loss, from the definitions."""
    scores = balance_scores(logits, cfg["score_function"])                  # (T, E)
    tokens, experts = scores.shape
    chosen = torch.zeros(tokens, experts, dtype=torch.float64)
    for t in range(tokens):
        for e in sorted(range(experts), key=lambda e: -float(scores[t, e].detach()))[:topk]:
            chosen[t, e] = 1.0
    if cfg["balancing"] == "aux_loss":
        f = chosen.sum(0) / (tokens * topk)                                 # fraction per expert
        p = scores.sum(0) / tokens                                          # mean probability
        return cfg["aux_coeff"] * experts * (f * p).sum()
    seq = tokens // batch            # token index = s·B + b (sequence-first flattening)
    total = 0.0
    for b in range(batch):
        rows = [s * batch + b for s in range(seq)]
        f = chosen[rows].sum(0) / (seq * topk)
        p = scores[rows].mean(0)
        total = total + experts * (f * p).sum()
    return cfg["aux_coeff"] * total / batch


def z_loss(logits, coeff):
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


def reference_moe(x, m, cfg):
    """One micro-batch ``x (S, B, h)`` → ``(y (S, B, h), aux_loss + z_loss)``."""
    seq, batch, hidden = x.shape
    tokens = x.reshape(seq * batch, hidden)
    logits = tokens @ m["router"].t()
    rows = []
    for t in range(tokens.shape[0]):
        y = torch.zeros(hidden, dtype=x.dtype)
        for e, p in route_token(logits[t], cfg["topk"], cfg["score_function"],
                                cfg.get("pre_softmax", False)):
            y = y + p * expert_mlp(tokens[t], m, e, cfg["activation"])
        rows.append(y)
    out = torch.stack(rows)
    if "shared_fc1" in m:
        out = out + shared_mlp(tokens, m, cfg["activation"])
    losses = 0.0
    if cfg.get("aux_coeff"):
        losses = losses + load_balancing_loss(logits, cfg["topk"], cfg, batch)
    if cfg.get("z_coeff"):
        losses = losses + z_loss(logits, cfg["z_coeff"])
    return out.view(seq, batch, hidden), losses


def draw_masters(cfg, seed):
    """Well-scaled random float64 masters (leaves requiring grad) for ``cfg``."""
    gen = torch.Generator().manual_seed(seed)
    h, f, e = cfg["hidden"], cfg["ffn"], cfg["experts"]
    gated = 2 if cfg["activation"] == "swiglu" else 1

    def randn(*shape, fan_in):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64)
                / math.sqrt(fan_in)).requires_grad_()

    m = {"router": randn(e, h, fan_in=h), "w1": randn(e, h, gated * f, fan_in=h),
         "w2": randn(e, f, h, fan_in=f)}
    if cfg.get("bias"):
        m["b1"], m["b2"] = randn(e, gated * f, fan_in=4), randn(e, h, fan_in=4)
    if cfg.get("shared"):
        fs = cfg["shared"]
        m["shared_fc1"] = randn(gated * fs, h, fan_in=h)
        m["shared_fc2"] = randn(h, fs, fan_in=fs)
        if cfg.get("bias"):
            m["shared_fc1_bias"] = randn(gated * fs, fan_in=4)
            m["shared_fc2_bias"] = randn(h, fan_in=4)
        if cfg.get("shared_gate"):
            m["shared_gate"] = randn(1, h, fan_in=h)
    return m
