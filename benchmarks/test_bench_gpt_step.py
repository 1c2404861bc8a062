"""One rank, one thread: a tpfuse GPT training step vs the same GPT written plainly (nanoGPT style).

Both sides train the same model from the same weights on the same batches: GPT-2 shape (learned
positions, LayerNorm, exact gelu, biases, tied embedding / output layer, no dropout), 6 layers,
hidden 256, 8 heads, sequence 256, micro-batch 4, vocabulary 256.

- ``tpfuse``: what ``pretrain`` runs on one rank: ``GPTModel`` (built by ``build_model``), the
  trainer's gradient buffers and ``MixedPrecisionOptimizer`` (``build_buffers_and_optimizer``
  from the trainer's own flags: AdamW, clip 1.0), the no-pipelining schedule, the gradient sync
  and the optimizer step.
- ``plain``: a plain ``nn.Module`` GPT (fused QKV laid out per head, ``F.scaled_dot_product_attention``,
  ``F.cross_entropy``), ``torch.optim.AdamW`` with PyTorch's default implementation (on CPU the
  per-tensor loop; nanoGPT asks for the fused one on CUDA only) and ``clip_grad_norm_(1.0)``.
- ``plain-fused``: the same loop with ``torch.optim.AdamW(fused=True)``, the implementation the
  tpfuse optimizer uses: tpfuse / plain-fused is the cost of the library around the same math.

The step functions alternate inside one process, each batch in one of the three cyclic orders in
turn (tpfuse, plain, plain-fused; plain, plain-fused, tpfuse; ...: ``step_timing.py``). One process: a gloo world of
one, ``torch.set_num_threads(1)``, glibc malloc keeping freed memory as ``pretrain`` sets it on CPU:
``training/host_memory.py``), after warm-up steps; the per-step losses of both must agree
(rel 1e-4 after 21 AdamW steps: same fp32 math in another op order). The summary prints the
median step times, wall clock and the worker thread's CPU time (less sensitive to other jobs on a
shared machine), tpfuse / plain (< 1: tpfuse faster; target ≤ 1.00) and tpfuse / plain-fused.

    python3 -m pytest benchmarks/test_bench_gpt_step.py --benchmark-enable -q -s \
        --benchmark-columns=median,iqr,rounds -p no:cacheprovider
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tpfuse.parallel.launch import WorkerPool

from step_timing import median_step_times, time_rotating_steps

LAYERS, HIDDEN, HEADS, SEQ, MICRO, VOCAB = 6, 256, 8, 256, 4, 256
WARMUP, TIMED = 3, 18                 # 6 timed batches in each of the 3 orders
_RESULTS: dict = {}
FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads",
         str(HEADS), "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
         # mock data's NullTokenizer adds an end-of-document id: 255 + 1 = VOCAB rows, no padding
         "--vocab-size", str(VOCAB - 1), "--make-vocab-size-divisible-by", "128",
         "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--micro-batch-size",
         str(MICRO), "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--clip-grad", "1.0",
         "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.95"]


# ------------------------------------------------------------------ the plain GPT

class PlainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)     # per head: [q_i; k_i; v_i] rows
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.c_fc, self.mlp_proj = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):                                # (b, s, h)
        b, s, _ = x.shape
        qkv = self.c_attn(self.ln_1(x)).view(b, s, HEADS, 3, HIDDEN // HEADS)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))   # (b, heads, s, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, s, HIDDEN))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, ids, labels):                      # (b, s) each
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))

    @torch.no_grad()
    def load_from(self, gpt):
        """Copy a tpfuse GPTModel's weights (one rank, tp 1)."""
        self.wte.weight.copy_(gpt.embedding.word_embeddings.weight)
        self.wpe.weight.copy_(gpt.embedding.position_embeddings.weight)
        for block, layer in zip(self.blocks, gpt.layers):
            pairs = [(block.ln_1, layer.input_norm), (block.ln_2, layer.pre_mlp_norm),
                     (block.c_attn, layer.self_attention.linear_qkv),
                     (block.c_proj, layer.self_attention.linear_proj),
                     (block.c_fc, layer.mlp.linear_fc1), (block.mlp_proj, layer.mlp.linear_fc2)]
            for mine, theirs in pairs:
                mine.weight.copy_(theirs.weight)
                mine.bias.copy_(theirs.bias)
        self.ln_f.weight.copy_(gpt.final_norm.weight)
        self.ln_f.bias.copy_(gpt.final_norm.bias)


# ------------------------------------------------------------------ the job (one rank)

def _batches(count):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen),
             torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)) for _ in range(count)]


def _loss_func(output):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def _tpfuse_forward_step(data_iterator, model):
    ids, labels = next(data_iterator)
    return model(ids, labels=labels), _loss_func


def _tpfuse_trainer():
    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.pipeline import get_forward_backward_func
    from tpfuse.training.arguments import parse_args
    from tpfuse.training.train_step import build_buffers_and_optimizer

    config, args = parse_args(FLAGS)
    state = ParallelState.initialize()
    model = build_model(make_gpt_model_provider(config), config, state=state)
    buffers, optimizer = build_buffers_and_optimizer(
        model, config, state, optimizer=args.optimizer, precision=args.precision,
        data_parallel=args.data_parallel, lr=args.scheduler.lr)
    forward_backward = get_forward_backward_func(state)

    def step(batch):
        buffers.zero_grad_buffer()
        buffers.begin_step(1)
        losses = forward_backward(_tpfuse_forward_step, iter([batch]), model, 1, SEQ, MICRO)
        buffers.finish_grad_sync()
        optimizer.step()
        return losses[0]["lm loss"].item()

    return state, model[0], step


def _plain_trainer(gpt, fused=None):
    model = PlainGPT()
    model.load_from(gpt)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    return step


def _job():
    from tpfuse.training.host_memory import keep_freed_host_memory

    torch.set_num_threads(1)
    keep_freed_host_memory()          # as pretrain does on CPU; the plain loop runs under it too
    state, gpt, tpfuse_step = _tpfuse_trainer()
    try:
        steps = {"tpfuse": tpfuse_step, "plain": _plain_trainer(gpt),
                 "plain-fused": _plain_trainer(gpt, fused=True)}
        return time_rotating_steps(steps, _batches(WARMUP + TIMED), WARMUP)
    finally:
        state.destroy()


@pytest.fixture(scope="module")
def result():
    with WorkerPool(1) as pool:
        return pool.run(_job, timeout_s=1200)[0]


def test_gpt_training_step_tpfuse_vs_plain(benchmark, result):
    benchmark.group = "GPT training step, one rank, one thread"
    losses = result["losses"]
    assert losses["tpfuse"] == pytest.approx(losses["plain"], rel=1e-4)
    assert losses["plain-fused"] == pytest.approx(losses["plain"], rel=1e-4)
    assert losses["tpfuse"][-1] < losses["tpfuse"][0] and all(map(math.isfinite, losses["plain"]))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nGPT {LAYERS} layers h{HIDDEN} {HEADS} heads s{SEQ} b{MICRO} V{VOCAB}, 1 thread, "
          f"median of {TIMED} alternating steps (target tpfuse / plain <= 1.00):")
    for what, median in median_step_times(result, benchmark).items():
        key = "times" if what == "wall" else "cpu_times"
        print(f"  {what:10s}: tpfuse {median['tpfuse'] * 1e3:.1f} ms, plain "
              f"{median['plain'] * 1e3:.1f} ms, plain-fused {median['plain-fused'] * 1e3:.1f} ms;"
              f" tpfuse / plain = {median['tpfuse'] / median['plain']:.3f}, tpfuse / plain-fused"
              f" = {median['tpfuse'] / median['plain-fused']:.3f}; tpfuse / plain per step: "
              + " ".join(f"{a / b:.3f}" for a, b in zip(result[key]["tpfuse"],
                                                       result[key]["plain"])))
