"""The plain-PyTorch peer of tpfuse's GPT: the same model written nanoGPT style (one module per
block, ``F.scaled_dot_product_attention``, ``torch.compile``, fused AdamW under bf16 autocast),
trained on the same batches as ``tpfuse-train`` given the same flags.

    python benchmarks/plain_gpt_peer.py --metrics-file peer.jsonl <tpfuse-train flags>
    python benchmarks/plain_gpt_peer.py --no-compile ...        # eager (the CPU dry run)
    python benchmarks/plain_gpt_peer.py --compare-with-tpfuse <flags>   # one JSON line: parameter
        # counts, FLOPs per token (the peer's own count vs tpfuse.models.flops) and the
        # per-token loss difference of the two models holding the same weights (fp32, CPU)

The flags are parsed by the trainer's own parser (``tpfuse.training.arguments.parse_args``), so
the model shape, the data (mock or indexed, same seed, same sampler order), the learning-rate
schedule, AdamW's hyper-parameters, weight decay on matrices only and the gradient clip are the
trainer's. Only one process, tp = pp = cp = 1; what differs is the model code and the step:

- model: token embedding → L × [norm → attention (one QKV Linear, rotary in fp32, SDPA causal,
  K/V repeated for GQA) → residual, norm → MLP (SwiGLU or GELU) → residual] → final norm → output
  layer over the padded vocabulary (tied to the embedding unless untied); the loss is the mean
  cross-entropy over the real vocabulary's logits of the tokens the loss mask keeps;
- step: fp32 parameters, bf16 autocast (with ``--bf16``), ``torch.optim.AdamW(fused=True)`` on
  CUDA, ``clip_grad_norm_``.

Initial weights are tpfuse's own (``--peer-init tpfuse``, the default: a single-process
``GPTModel`` of the config drawn on the CPU and copied, QKV rows reordered from the grouped layout
``[q of group g; k_g; v_g]`` to ``[q; k; v]``), so the two loss curves start from one model and
should stay within bf16 noise of each other; ``--peer-init normal`` draws N(0, σ) instead.

Every iteration writes one JSON line to ``--metrics-file`` with the trainer's field names
(``loss``, ``ms_per_iter``, ``tokens_per_s``, ``tflops_per_rank``, ``mfu`` with
``--peak-tflops``, ``peak_memory_mib`` on CUDA) and ``compiled``; FLOPs are counted by
``tpfuse.models.flops``, the formula the trainer's ``--log-throughput`` uses. Should
``torch.compile`` fail on its first call (a missing compiler, an inductor error), the peer says
so and trains eager from that same first micro-batch, so the session still gets its curve.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTDims:
    """The shape of the GPT both implementations build."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int           # real ids (the loss's softmax runs over these)
    padded_vocab_size: int    # rows of the embedding / output layer
    swiglu: bool
    rms_norm: bool
    norm_eps: float
    bias: bool
    rotary_base: float
    tied: bool
    init_std: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def dims_from_config(config) -> GPTDims:
    """GPTDims of a TransformerConfig; ValueError for what the peer does not model."""
    if config.position_embedding_type != "rope":
        raise ValueError("the plain peer models rotary positions only (--position-embedding-type "
                         f"rope), got {config.position_embedding_type!r}")
    if config.num_moe_experts:
        raise ValueError("the plain peer is a dense GPT (no --num-experts)")
    if config.activation not in ("swiglu", "gelu"):
        raise ValueError(f"the plain peer knows swiglu and gelu, got {config.activation!r}")
    return GPTDims(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size, vocab_size=config.vocab_size,
        padded_vocab_size=config.padded_vocab_size, swiglu=config.activation == "swiglu",
        rms_norm=config.normalization == "RMSNorm", norm_eps=config.layernorm_epsilon,
        bias=config.add_bias_linear, rotary_base=config.rotary_base,
        tied=not config.untie_embeddings_and_output_weights, init_std=config.init_method_std)


def make_norm(dims: GPTDims) -> nn.Module:
    if dims.rms_norm:
        return nn.RMSNorm(dims.hidden_size, eps=dims.norm_eps)
    return nn.LayerNorm(dims.hidden_size, eps=dims.norm_eps)


def rotary_tables(seq: int, head_dim: int, base: float, device):
    """cos, sin ``(1, 1, s, d)`` fp32: angle of position p and pair i = p · base^(−2i/d), the
    d/2 angles repeated twice (the rotate-half convention)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                        / head_dim)
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[None, None], angles.sin()[None, None]


def rotate(x, cos, sin):
    """x ``(b, heads, s, d)`` rotated in fp32: x·cos + [−x₂, x₁]·sin, returned in x's dtype."""
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dims: GPTDims):
        super().__init__()
        self.dims = dims
        d, heads, groups = dims.head_dim, dims.num_heads, dims.num_query_groups
        self.qkv = nn.Linear(dims.hidden_size, (heads + 2 * groups) * d, bias=dims.bias)
        self.proj = nn.Linear(heads * d, dims.hidden_size, bias=dims.bias)

    def forward(self, x, cos, sin):                                      # x (b, s, h)
        b, s, _ = x.shape
        d, heads, groups = self.dims.head_dim, self.dims.num_heads, self.dims.num_query_groups
        q, k, v = self.qkv(x).split([heads * d, groups * d, groups * d], dim=-1)
        q = q.view(b, s, heads, d).transpose(1, 2)                       # (b, heads, s, d)
        k = k.view(b, s, groups, d).transpose(1, 2)                      # (b, g, s, d)
        v = v.view(b, s, groups, d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if groups != heads:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (b, heads, s, d)
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * d))


class MLP(nn.Module):
    def __init__(self, dims: GPTDims):
        super().__init__()
        self.swiglu = dims.swiglu
        width = 2 * dims.ffn_hidden_size if dims.swiglu else dims.ffn_hidden_size
        self.fc1 = nn.Linear(dims.hidden_size, width, bias=dims.bias)    # swiglu: [gate; up]
        self.fc2 = nn.Linear(dims.ffn_hidden_size, dims.hidden_size, bias=dims.bias)

    def forward(self, x):
        x = self.fc1(x)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(x))


class Block(nn.Module):
    def __init__(self, dims: GPTDims):
        super().__init__()
        self.norm1, self.attn = make_norm(dims), Attention(dims)
        self.norm2, self.mlp = make_norm(dims), MLP(dims)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PlainGPT(nn.Module):
    def __init__(self, dims: GPTDims):
        super().__init__()
        self.dims = dims
        self.wte = nn.Embedding(dims.padded_vocab_size, dims.hidden_size)
        self.blocks = nn.ModuleList(Block(dims) for _ in range(dims.num_layers))
        self.norm_f = make_norm(dims)
        self.lm_head = nn.Linear(dims.hidden_size, dims.padded_vocab_size, bias=False)
        if dims.tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens, labels=None):
        """tokens ``(b, s)`` → logits ``(b, s, V_padded)``, or with labels the per-token loss
        ``(b, s)`` fp32 over the real vocabulary."""
        cos, sin = rotary_tables(tokens.shape[1], self.dims.head_dim, self.dims.rotary_base,
                                 tokens.device)
        x = self.wte(tokens)                                             # (b, s, h)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm_f(x))                            # (b, s, V_padded)
        if labels is None:
            return logits
        real = logits[..., :self.dims.vocab_size].float()
        return F.cross_entropy(real.flatten(0, 1), labels.flatten(),
                               reduction="none").view(labels.shape)


def init_normal(model: PlainGPT, seed: int) -> None:
    """N(0, σ) matrices and embedding, σ/√(2L) for the residual outputs, zero biases, unit norms."""
    dims, generator = model.dims, torch.Generator().manual_seed(seed)
    residual_std = dims.init_std / math.sqrt(2.0 * dims.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0 if name.endswith("weight") and "norm" in name else 0.0)
                continue
            std = residual_std if name.endswith(("proj.weight", "fc2.weight")) else dims.init_std
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def peer_state_from_tpfuse(tpfuse_state: dict, dims: GPTDims) -> dict:
    """A PlainGPT state dict holding the weights of a single-process tpfuse GPTModel's
    ``state_dict()``: names mapped, QKV rows reordered from per-group ``[q heads; k; v]`` to
    ``[all q; all k; all v]``."""
    groups, d = dims.num_query_groups, dims.head_dim
    per_group = dims.num_heads // groups

    def qkv_rows(tensor):                                    # (g·(hpg+2)·d, ...) grouped
        grouped = tensor.reshape(groups, per_group + 2, d, *tensor.shape[1:])
        return torch.cat([grouped[:, :per_group].reshape(-1, *tensor.shape[1:]),
                          grouped[:, per_group].reshape(-1, *tensor.shape[1:]),
                          grouped[:, per_group + 1].reshape(-1, *tensor.shape[1:])])

    names = {"input_norm": "norm1", "pre_mlp_norm": "norm2", "self_attention.linear_qkv":
             "attn.qkv", "self_attention.linear_proj": "attn.proj", "mlp.linear_fc1": "mlp.fc1",
             "mlp.linear_fc2": "mlp.fc2"}
    state = {"wte.weight": tpfuse_state["embedding.word_embeddings.weight"]}
    for name, tensor in tpfuse_state.items():
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            module, leaf = rest.rsplit(".", 1)
            if module not in names:
                continue                                     # no parameter (e.g. extra state)
            if module == "self_attention.linear_qkv":
                tensor = qkv_rows(tensor)
            state[f"blocks.{index}.{names[module]}.{leaf}"] = tensor
        elif name.startswith("final_norm."):
            state["norm_f." + name.split(".", 1)[1]] = tensor
    state["lm_head.weight"] = (state["wte.weight"] if dims.tied
                               else tpfuse_state["output_layer.weight"])
    return state


def tpfuse_initial_state(config) -> dict:
    """The initial weights of tpfuse's single-process GPTModel of ``config`` (fp32, CPU)."""
    from tpfuse.models import GPTModel

    single = dataclasses.replace(config, tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1, sequence_parallel=False,
                                 params_dtype=torch.float32, bf16=False)
    return {name: tensor.float() for name, tensor in GPTModel(single).state_dict().items()}


def peer_forward_flops_per_token(model: PlainGPT, seq: int) -> float:
    """The peer's own FLOP count of one token's forward, read off its modules: 2 · in · out of
    every Linear (the output layer once, tied or not) plus 2 · 2 · s · (heads · d) per attention
    (Q·Kᵀ and P·V over the full square) — the convention of ``tpfuse.models.flops``."""
    linear = sum(2 * m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, nn.Linear))
    attention = sum(2 * 2 * seq * m.proj.in_features for m in model.modules()
                    if isinstance(m, Attention))
    return float(linear + attention)


def compare_with_tpfuse(argv) -> dict:
    """Build tpfuse's single-process GPTModel of the flags and the peer with its weights, run both
    forward (eval, fp32) on one seeded batch; ``{parameters, per-token loss difference, FLOPs}``."""
    from tpfuse.models import GPTModel
    from tpfuse.models.flops import forward_flops_per_token

    _, config, _ = parse(argv)
    tpfuse_model = GPTModel(config).eval()
    dims = dims_from_config(config)
    peer = PlainGPT(dims).eval()
    peer.load_state_dict(peer_state_from_tpfuse(tpfuse_model.state_dict(), dims))
    generator = torch.Generator().manual_seed(config.seed)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=generator)
    labels = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=generator)
    with torch.no_grad():
        ours, theirs = tpfuse_model(tokens, labels=labels), peer(tokens, labels)   # (b, s)
    return {"tpfuse_parameters": sum(p.numel() for p in tpfuse_model.parameters()),
            "peer_parameters": sum(p.numel() for p in peer.parameters()),
            "max_abs_loss_difference": (ours - theirs).abs().max().item(),
            "max_abs_loss": ours.abs().max().item(),
            "tpfuse_flops_per_token": forward_flops_per_token(config),
            "peer_flops_per_token": peer_forward_flops_per_token(peer, config.seq_length)}


# ---------------------------------------------------------------------------- training


def parse(argv):
    """(peer options, trainer config, trainer settings)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--peer-init", choices=("tpfuse", "normal"), default="tpfuse")
    parser.add_argument("--no-compile", action="store_true", help="eager PyTorch")
    options, rest = parser.parse_known_args(argv)
    from tpfuse.training.arguments import parse_args

    config, settings = parse_args(rest)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        if getattr(config, name) != 1:
            raise ValueError(f"the plain peer runs one process: {name} must be 1")
    return options, config, settings


def build_optimizer(model: PlainGPT, settings, device):
    """AdamW, decoupled weight decay on matrices only (the trainer's rule), fused on CUDA."""
    from tpfuse.training.scheduler import LRScheduler
    from tpfuse.training.train_samples import lr_schedule, wsd_decay_length

    opt, sched = settings.optimizer, settings.scheduler
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=sched.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
        fused=device.type == "cuda")
    warmup, decay_end, unit = lr_schedule(settings.training, sched)
    scheduler = LRScheduler(optimizer, sched.lr, sched.min_lr, warmup, decay_end,
                            sched.lr_decay_style, unit,
                            wsd_decay_steps=wsd_decay_length(settings.training, sched),
                            wsd_decay_style=sched.lr_wsd_decay_style)
    return optimizer, scheduler


def train_batches(config, settings):
    """The trainer's training micro-batches, in its order (one process, dp = 1)."""
    from tpfuse.data.sampler import build_pretraining_data_loader
    from tpfuse.pretrain_gpt import train_valid_test_datasets_provider

    training = settings.training
    samples = training.train_iters * training.global_batch_size
    train, _, _ = train_valid_test_datasets_provider(
        [samples, 0, 0], data=settings.data, config=config, tokenizer=settings.tokenizer)
    return iter(build_pretraining_data_loader(train, 0, training.micro_batch_size, 0, 1))


def train(argv) -> list[dict]:
    """Train the peer; returns the per-iteration records (also written to --metrics-file)."""
    from tpfuse.models.flops import flops_per_iteration, utilisation

    options, config, settings = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    dims = dims_from_config(config)
    model = PlainGPT(dims)
    if options.peer_init == "tpfuse":
        model.load_state_dict(peer_state_from_tpfuse(tpfuse_initial_state(config), dims))
    else:
        init_normal(model, config.seed)
    model.to(device)
    optimizer, scheduler = build_optimizer(model, settings, device)
    step_model = model if options.no_compile else torch.compile(model)
    training = settings.training
    micro_batches = training.global_batch_size // training.micro_batch_size
    autocast_dtype = torch.bfloat16 if config.bf16 else (torch.float16 if config.fp16 else None)
    batches = train_batches(config, settings)
    flops = flops_per_iteration(config, training.global_batch_size)
    metrics = settings.logging.metrics_file
    peak_tflops = settings.observability.peak_tflops
    records = []
    if metrics:
        open(metrics, "w").close()
    def micro_step(forward, tokens, labels, mask):
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            per_token = forward(tokens, labels)                      # (b, s) fp32
        loss = (per_token * mask).sum() / mask.sum()
        (loss / micro_batches).backward()
        return loss.detach()

    for iteration in range(1, training.train_iters + 1):
        start = time.perf_counter()
        losses = []
        for micro in range(micro_batches):
            batch = next(batches)
            tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
            mask = batch["loss_mask"].to(device).float()
            try:
                losses.append(micro_step(step_model, tokens, labels, mask))
            except Exception as error:         # torch.compile broke on its first (compiling) call
                if step_model is model or (iteration, micro) != (1, 0):
                    raise
                print(f"peer: torch.compile failed ({type(error).__name__}: "
                      f"{str(error).splitlines()[0][:200]}); the peer runs eager", flush=True)
                optimizer.zero_grad(set_to_none=True)
                step_model = model
                losses.append(micro_step(step_model, tokens, labels, mask))
        if settings.optimizer.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.optimizer.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        mean_loss = torch.stack(losses).mean().item()               # synchronises the device
        elapsed = time.perf_counter() - start
        record = {"iteration": iteration, "loss": mean_loss, "ms_per_iter": 1000 * elapsed,
                  "compiled": step_model is not model,
                  "tokens_per_s": training.global_batch_size * config.seq_length / elapsed,
                  **utilisation(flops, elapsed, 1, peak_tflops)}
        if device.type == "cuda":
            record["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        records.append(record)
        print(f"peer iteration {iteration}/{training.train_iters} | lm loss {mean_loss:.6f} | "
              f"{record['ms_per_iter']:.1f} ms | {record['tokens_per_s']:.0f} tokens/s"
              + (f" | MFU {record['mfu']:.3f}" if "mfu" in record else ""), flush=True)
        if metrics:
            with open(metrics, "a") as handle:
                handle.write(json.dumps(record) + "\n")
    return records


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--compare-with-tpfuse" in argv:
        argv.remove("--compare-with-tpfuse")
        print(json.dumps(compare_with_tpfuse(argv)))
        return 0
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
