"""One rank, one thread: a training step through megatron_compat (Megatron's calls) vs the same
step through tpfuse's native API, to measure what the Megatron boundary costs.

Both sides train the same GPT (4 layers, hidden 128, 4 heads, sequence 128, micro-batch 4,
vocabulary 256, tied embedding, no dropout) from the same seed on the same batches, two
micro-batches per step:

- ``compat``: ``TransformerConfig`` → ``GPTModel(config, get_gpt_layer_local_spec(), ...)`` →
  ``DistributedDataParallel`` → ``get_megatron_optimizer`` → Megatron's
  ``get_forward_backward_func()`` with a Megatron ``forward_step`` / ``loss_func`` (the
  config's ``finalize_model_grads_func``), ``zero_grad_buffer`` and ``optimizer.step()``;
- ``native``: ``tpfuse.models.GPTModel``, ``DataParallelBuffers``, ``MixedPrecisionOptimizer``,
  ``tpfuse.pipeline.get_forward_backward_func``, ``finish_grad_sync``, ``step``.

The steps alternate (the order swaps every batch: ``step_timing.py``) after warm-up; per-step losses agree (rel
1e-5: the same engine, Megatron's Σ(loss·mask)/Σmask vs a mean). The summary prints median wall
and thread-CPU times and compat / native (target ≤ 1.02).

    python3 -m pytest benchmarks/test_bench_megatron_compat.py --benchmark-enable -q -s \
        -p no:cacheprovider
"""
import pytest
import torch

from tpfuse.parallel.launch import WorkerPool

from step_timing import median_step_times, time_rotating_steps

LAYERS, HIDDEN, HEADS, SEQ, MICRO, VOCAB, SEED = 4, 128, 4, 128, 4, 256, 5
MICROBATCHES, WARMUP, TIMED, LR = 2, 3, 20, 1e-3


def _batches(count):
    gen = torch.Generator().manual_seed(0)
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MICROBATCHES, MICRO, SEQ + 1), generator=gen)
        yield [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(MICRO, SEQ),
                "position_ids": torch.arange(SEQ).expand(MICRO, SEQ)} for t in tokens]


def _compat_trainer():
    from tpfuse.megatron_compat.distributed import (DistributedDataParallel,
                                                    DistributedDataParallelConfig,
                                                    finalize_model_grads)
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.optimizer import OptimizerConfig, get_megatron_optimizer
    from tpfuse.megatron_compat.pipeline_parallel import get_forward_backward_func
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed
    from tpfuse.megatron_compat.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               hidden_dropout=0.0, attention_dropout=0.0,
                               finalize_model_grads_func=finalize_model_grads)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR), [model])
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        output = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor):
            mask = batch["loss_mask"].view(-1)
            loss = torch.sum(output_tensor.view(-1) * mask) / mask.sum()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func

    def step(batches):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                                   model=[model], num_microbatches=MICROBATCHES,
                                   seq_length=SEQ, micro_batch_size=MICRO, forward_only=False)
        optimizer.step()
        return torch.stack([r["lm loss"] for r in reduced]).mean().item()
    return step


def _native_trainer(state):
    from tpfuse.models import GPTModel, TransformerConfig
    from tpfuse.pipeline import get_forward_backward_func
    from tpfuse.training.data_parallel import DataParallelBuffers, DistributedDataParallelConfig
    from tpfuse.training.optimizer import MixedPrecisionOptimizer

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.0,
                               attention_dropout=0.0, seed=SEED)
    model = GPTModel(config, state=state)
    buffers = DataParallelBuffers([model], DistributedDataParallelConfig(), state)
    optimizer = MixedPrecisionOptimizer([model], buffers, state, lr=LR, weight_decay=0.01,
                                        clip_grad=1.0)
    forward_backward = get_forward_backward_func(state)

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        loss = chunk(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        return loss, lambda out: (out.mean(), {"lm loss": out.mean().detach()})

    def step(batches):
        buffers.zero_grad_buffer()
        logs = forward_backward(forward_step, iter(batches), [model], MICROBATCHES, SEQ, MICRO)
        buffers.finish_grad_sync()
        optimizer.step()
        return torch.stack([d["lm loss"] for d in logs]).mean().item()
    return step


def _job():
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.parallel.state import get_default_state
    from tpfuse.training.host_memory import keep_freed_host_memory

    torch.set_num_threads(1)
    keep_freed_host_memory()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        steps = {"compat": _compat_trainer(), "native": _native_trainer(get_default_state())}
        return time_rotating_steps(steps, _batches(WARMUP + TIMED), WARMUP)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def result():
    with WorkerPool(1) as pool:
        return pool.run(_job, timeout_s=1200)[0]


def test_megatron_compat_step_vs_native(benchmark, result):
    benchmark.group = "GPT training step through megatron_compat vs native, one rank"
    losses = result["losses"]
    assert losses["compat"] == pytest.approx(losses["native"], rel=1e-5)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nGPT {LAYERS} layers h{HIDDEN} s{SEQ} b{MICRO}x{MICROBATCHES} V{VOCAB}, 1 thread, "
          f"median of {TIMED} alternating steps (target compat / native <= 1.02):")
    for what, median in median_step_times(result, benchmark).items():
        print(f"  {what:10s}: compat {median['compat'] * 1e3:.1f} ms, native "
              f"{median['native'] * 1e3:.1f} ms; compat / native = "
              f"{median['compat'] / median['native']:.3f}")
