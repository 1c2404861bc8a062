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


def measured_memory_body(flag_sets):
    """For each flag set: this rank's optimizer.memory_bytes() (the trainer's build path) and
    the ``--log-memory-plan`` line the trainer would print."""
    import torch.distributed as dist

    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.training.memory import memory_plan_report
    from tpfuse.training.train_step import build_buffers_and_optimizer

    results = []
    for flags in flag_sets:
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
            line = memory_plan_report(optimizer, config, settings, dist.get_world_size(),
                                      dist.get_rank())
            results.append((optimizer.memory_bytes(), line))
        finally:
            state.destroy()
    return dist.get_rank(), results


GRID = {
    2: [["--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"],
        ["--context-parallel-size", "2", "--attention-dropout", "0",
         "--use-distributed-optimizer"],
        ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--use-distributed-optimizer", "--bf16"],
        ["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm",
         "--use-distributed-optimizer", "--fp16"]],
    4: [["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"],
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
         "--global-batch-size", "4"],
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000",
         "--untie-embeddings-and-output-weights"],
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--accumulate-allreduce-grads-in-fp32"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2",
         "--use-distributed-optimizer", "--bf16", "--moe-router-topk", "2"],
        ["--tensor-model-parallel-size", "2", "--num-experts", "2",
         "--expert-model-parallel-size", "2", "--sequence-parallel",
         "--use-distributed-optimizer", "--moe-layer-freq", "2"]],
}


@pytest.mark.parametrize("world", sorted(GRID))
def test_static_memory_equals_the_trainers_record_on_every_rank(run_distributed, world):
    """Every layout of the grid, every rank: the plan's four kinds are the optimizer's bytes,
    and the ``--log-memory-plan`` line says so."""
    measured = dict(run_distributed(world, measured_memory_body, GRID[world]))
    for index, flags in enumerate(GRID[world]):
        config, settings = parse_args(BASE + flags)
        layout = layout_of(config, world)
        buffers = buffer_settings(config, settings, world // (
            config.tensor_model_parallel_size * config.pipeline_model_parallel_size))
        for rank in range(world):
            held, line = measured[rank][index]
            assert static_memory(config, layout, rank, buffers) == held, (flags, rank)
            assert "!=" not in line and line.startswith(f"> rank {rank} memory"), line


# -------------------------------------------------------------------- communication
STEP = ["--eval-iters", "0", "--no-progress-bar", "--no-layout-table", "--attention-dropout", "0",
        "--micro-batch-size", "2"]
COUNTER_NAMES = {"dp-cp_all_reduce": "dp_all_reduce", "dp-cp_all_gather": "dp_param_all_gather",
                 "edp_all_gather": "edp_param_all_gather"}


def counted_step_body(flags):
    """The bytes of the collectives of the first training step, by group kind."""
    import torch.distributed as dist

    from support.comm_counter import counting
    from tpfuse import pretrain_gpt
    from tpfuse.training import pretrain as trainer

    counted = {}
    original = trainer._Run.train_step

    def train_step(run, iterators):
        with counting(run.state) as counts:
            result = original(run, iterators)
        counted.update(counts)
        return result

    trainer._Run.train_step = train_step
    try:
        trainer.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                         pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                         argv=BASE + STEP + flags)
    finally:
        trainer._Run.train_step = original
    return dist.get_rank(), {COUNTER_NAMES.get(k, k): v for k, v in counted.items()}


COMM_GRID = [
    (2, ["--tensor-model-parallel-size", "2", "--global-batch-size", "4"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
         "full", "--recompute-method", "uniform", "--recompute-num-layers", "2",
         "--global-batch-size", "4"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--bf16", "--global-batch-size", "4"]),
    (2, ["--use-distributed-optimizer", "--bf16", "--global-batch-size", "4"]),
    (2, ["--global-batch-size", "4", "--recompute-granularity", "selective",
         "--recompute-modules", "mlp", "--tensor-model-parallel-size", "2"]),
    (2, ["--context-parallel-size", "2", "--global-batch-size", "4"]),
    (4, ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
         "--global-batch-size", "8"]),
]


@pytest.mark.parametrize("world,flags", COMM_GRID, ids=[" ".join(f) for _, f in COMM_GRID])
def test_comm_bytes_equal_the_collectives_of_a_real_step(run_distributed, world, flags):
    from tpfuse.training.plan_comm import step_comm_bytes

    counted = dict(run_distributed(world, counted_step_body, flags))
    config, settings = parse_args(BASE + STEP + flags)
    layout = layout_of(config, world)
    dp = world // (config.tensor_model_parallel_size * config.pipeline_model_parallel_size
                   * config.context_parallel_size)
    m = settings.training.global_batch_size // (settings.training.micro_batch_size * dp)
    buffers = buffer_settings(config, settings, dp * config.context_parallel_size)
    for rank in range(world):
        planned = step_comm_bytes(config, layout, rank, buffers, 2, m, backend="gloo")
        assert planned == counted[rank], rank
