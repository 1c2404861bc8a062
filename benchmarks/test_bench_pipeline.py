"""tpfuse's interleaved pipeline vs torch.distributed.pipelining's ScheduleInterleaved1F1B.

The same small GPT (tpfuse.models.GPTModel, 8 layers, one per virtual stage at pp=4, vpp=2),
the same weights and micro-batches, CPU gloo, pp = 2 and 4, vpp = 2, m = 8; one optimizer step's
forward + backward (no optimizer). Each job builds the model once, runs warm-up steps, then
times steps on every rank between two barriers (so a step is the whole pipeline's time); the
summary prints median step times and the tpfuse / torch ratio (< 1: tpfuse faster) from one
run; the implementations step in turn in one job, so a change of load hits all alike, and the
order rotates (which step runs right after which moves a step's time through the allocator's and
caches' state, so each side is first, and follows each other side, equally often). A third side
is tpfuse with its receives in the strict message order (``p2p_recv_ahead=0``, what NCCL runs)
instead of gloo's default of posting them ahead.

    python3 -m pytest benchmarks/test_bench_pipeline.py --benchmark-enable -q -s \
        --benchmark-columns=median,iqr,rounds

pytest-benchmark's own table times the whole job (model build, warm-up, every side's timed
steps); the printed per-step medians are the numbers to quote. All sides must produce the same
per-micro-batch losses and gradient norms (checked), so they do the same work.
Without --benchmark-enable (pytest.ini disables benchmarks) each case runs once as a smoke test.
"""
import functools
import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tpfuse.parallel.launch import WorkerPool

VPP, M, MICRO_BATCH = 2, 8, 2
BASE = dict(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
            make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0, seed=5)
WARMUP_STEPS, TIMED_STEPS = 3, 30


def _micro_batches():
    gen = torch.Generator().manual_seed(3)
    shape = (M * MICRO_BATCH, BASE["seq_length"])
    return (torch.randint(0, BASE["vocab_size"], shape, generator=gen),
            torch.randint(0, BASE["vocab_size"], shape, generator=gen))     # (M·b, s) each


def _lm_loss(logits, labels):
    """Mean next-token cross-entropy of logits (b, s, V) against labels (b, s)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


# ------------------------------------------------------------------ tpfuse's executor

def _tpfuse_forward_step(data_iterator, chunk):
    ids, labels = next(data_iterator)
    output = chunk(ids)   # hidden (s, b, h), or logits (b, s, V) on the last chunk

    def loss_func(logits):
        loss = _lm_loss(logits, labels)
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _tpfuse_step(chunks, state, ids, labels, recv_ahead=None):
    """One tpfuse step; ``recv_ahead`` is the chunks' ``config.p2p_recv_ahead`` (None: gloo's
    default, 0: the strict order NCCL runs)."""
    from tpfuse.pipeline import get_forward_backward_func

    for chunk in chunks:
        chunk.config.p2p_recv_ahead = recv_ahead
    batches = list(zip(ids.split(MICRO_BATCH), labels.split(MICRO_BATCH)))
    iterators = [iter(batches) for _ in chunks]
    loss_dicts = get_forward_backward_func(state)(
        _tpfuse_forward_step, iterators, chunks, M, BASE["seq_length"], MICRO_BATCH)
    return [d["loss"].item() for d in loss_dicts]


# ------------------------------------------------------------------ torch.distributed.pipelining

class _TorchStage(nn.Module):
    """A GPTModel chunk as a PipelineStage module: tokens in on the first stage, hidden
    states (s, b, h) in elsewhere."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        if self.chunk.pre_process:
            return self.chunk(x)
        self.chunk.set_input_tensor(x)
        return self.chunk(None)


def _torch_schedule(chunks, state):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    pp = state.pp_size
    stages = [PipelineStage(_TorchStage(chunk), c * pp + state.pp_rank, pp * VPP,
                            torch.device("cpu"), group=state.pp_group)
              for c, chunk in enumerate(chunks)]
    return ScheduleInterleaved1F1B(stages, M, loss_fn=_lm_loss)


def _torch_step(schedule, ids, labels):
    losses: list = []
    schedule.step(ids, target=labels, losses=losses)
    return [loss.item() for loss in losses]


# ------------------------------------------------------------------ the job on every rank

def _bench_job(pp):
    """The sides on the same chunks and data, stepped in turn (so a change of machine load
    hits all alike): per side the step times, last losses and the squared gradient norm."""
    from tpfuse.models import TransformerConfig
    from tpfuse.models.build import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(pp=pp, vpp=VPP)
    try:
        config = TransformerConfig(**BASE, pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=VPP)
        chunks = build_model(make_gpt_model_provider(config), config, state=state)
        ids, labels = _micro_batches()
        steps = {"tpfuse": functools.partial(_tpfuse_step, chunks, state, ids, labels),
                 "tpfuse-strict": functools.partial(_tpfuse_step, chunks, state, ids, labels,
                                                    recv_ahead=0),
                 "torch": functools.partial(_torch_step, _torch_schedule(chunks, state), ids,
                                            labels)}
        out = {impl: {"times": []} for impl in steps}
        names = list(steps)
        for index in range(WARMUP_STEPS + TIMED_STEPS):
            turn = index % len(names)    # each side first in turn, after each other side
            for impl in names[turn:] + names[:turn]:
                step = steps[impl]
                for chunk in chunks:
                    chunk.zero_grad(set_to_none=True)
                dist.barrier(group=state.pp_group)
                start = time.perf_counter()
                out[impl]["losses"] = step()
                dist.barrier(group=state.pp_group)
                if index >= WARMUP_STEPS:
                    out[impl]["times"].append(time.perf_counter() - start)
                out[impl]["grad_sq"] = sum(float((p.grad.double() ** 2).sum()) for chunk in chunks
                                           for p in chunk.parameters() if p.grad is not None)
        return out
    finally:
        state.destroy()


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_step(benchmark, pp):
    benchmark.group = f"interleaved GPT step pp={pp}"
    with WorkerPool(pp) as pool:
        results = benchmark.pedantic(pool.run, args=(_bench_job, pp), rounds=1, iterations=1)
    last = results[pp - 1]
    # the last pp rank holds the last virtual stage; same model, same data: same losses and
    # gradients up to fp32 rounding (the two run the same GEMMs, reductions may reorder); the
    # two tpfuse sides only post their receives at other times: bitwise the same
    assert len(last["tpfuse"]["losses"]) == M
    assert last["tpfuse"]["losses"] == pytest.approx(last["torch"]["losses"], rel=1e-5)
    assert last["tpfuse"]["losses"] == last["tpfuse-strict"]["losses"]
    for rank in results:
        assert rank["tpfuse"]["grad_sq"] == pytest.approx(rank["torch"]["grad_sq"], rel=1e-4)
        assert rank["tpfuse"]["grad_sq"] == rank["tpfuse-strict"]["grad_sq"]
    median = {impl: statistics.median(times["times"]) for impl, times in results[0].items()}
    benchmark.extra_info.update({f"{impl}_step_s": t for impl, t in median.items()})
    print(f"\npp={pp} vpp={VPP} m={M}, median over {TIMED_STEPS} steps in rotating order (after "
          f"{WARMUP_STEPS} warm-up), CPU gloo, 1 thread per rank: tpfuse "
          f"{median['tpfuse'] * 1e3:.1f} ms, tpfuse strict p2p order "
          f"{median['tpfuse-strict'] * 1e3:.1f} ms, torch ScheduleInterleaved1F1B "
          f"{median['torch'] * 1e3:.1f} ms; tpfuse / torch = "
          f"{median['tpfuse'] / median['torch']:.3f}, strict / torch = "
          f"{median['tpfuse-strict'] / median['torch']:.3f}")
