"""tpfuse-plan against real runs: the four static memory kinds equal what the trainer's optimizer
holds on every rank (``MixedPrecisionOptimizer.memory_bytes``, the ``memory_bytes`` record), the
activation prediction is within 5 % of the tensors saved for backward (saved-tensor hooks), and
the communication volume of TP and DP equals the bytes passed to the collectives of a real step.
"""
import pytest

from support.pretrain_run import run_pretrain
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
            ep=config.expert_model_parallel_size, etp=config.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=(
                settings.data_parallel.num_distributed_optimizer_instances))
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


FSDP = ["--use-torch-fsdp2", "--data-parallel-sharding-strategy"]
GRID = {
    2: [["--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16", "--qk-layernorm"],
        ["--context-parallel-size", "2", "--attention-dropout", "0",
         "--use-distributed-optimizer"],
        ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--use-distributed-optimizer", "--bf16"],
        ["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm",
         "--use-distributed-optimizer", "--fp16"],
        # FSDP ZeRO-2 (3 experts: the row split pads) and ZeRO-3
        FSDP + ["optim_grads", "--bf16", "--num-experts", "3", "--moe-router-topk", "2"],
        FSDP + ["optim_grads_params"],
        # Muon's matrices hold one momentum buffer (4 bytes), AdamW's rest two moments: over
        # the distributed optimizer's shards, and FSDP's rows with the router / shared gate
        ["--optimizer", "muon", "--tensor-model-parallel-size", "2", "--bf16",
         "--use-distributed-optimizer"],
        FSDP + ["optim_grads", "--optimizer", "muon", "--num-experts", "3", "--moe-router-topk",
                "2", "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate"],
        ["--optimizer", "sgd", "--use-distributed-optimizer"],
        ["--optimizer", "sgd", "--sgd-momentum", "0"],
        # an MoE model's MTP layer is an MoE layer (its experts sharded over ep)
        ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
         "--mtp-num-layers", "1", "--position-embedding-type", "rope",
         "--use-distributed-optimizer"]],
    4: [["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"],
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
         "--global-batch-size", "4"],
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000",
         "--untie-embeddings-and-output-weights"],
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--accumulate-allreduce-grads-in-fp32", "--qk-layernorm"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2",
         "--use-distributed-optimizer", "--bf16", "--moe-router-topk", "2"],
        ["--tensor-model-parallel-size", "2", "--num-experts", "2",
         "--expert-model-parallel-size", "2", "--sequence-parallel",
         "--use-distributed-optimizer", "--moe-layer-freq", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"]
        + FSDP + ["optim_grads_params"],
        # multi-token prediction on the last stage, its own untied word-embedding copy there
        ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--mtp-num-layers", "2", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--use-distributed-optimizer", "--bf16"]],
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


def counted_step_body(flags, record_routing=False):
    """The bytes of the collectives of the first training step, by group kind (and with
    ``record_routing`` the alltoall dispatchers' records of that step, in dispatch order)."""
    import torch.distributed as dist

    from support.comm_counter import counting
    from tpfuse.moe.dispatcher import AlltoAllDispatcher
    from tpfuse.training import pretrain as trainer

    counted, routing = {}, []
    original = trainer._Run.train_step

    def train_step(run, iterators):
        if not counted and record_routing:
            for module in (m for chunk in run.model for m in chunk.modules()):
                if isinstance(getattr(module, "dispatcher", None), AlltoAllDispatcher):
                    module.dispatcher.routing_log = routing
        with counting(run.state) as counts:
            result = original(run, iterators)
        if not counted:
            counted.update(counts)
            for module in (m for chunk in run.model for m in chunk.modules()):
                if hasattr(module, "dispatcher"):
                    module.dispatcher.routing_log = None
        return result

    trainer._Run.train_step = train_step
    try:
        run_pretrain(BASE + STEP + flags)
    finally:
        trainer._Run.train_step = original
    if record_routing:
        return dist.get_rank(), dict(counted), routing
    return dist.get_rank(), dict(counted)


ALLTOALL = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
            "--global-batch-size", "8", "--moe-token-dispatcher-type", "alltoall"]
TP_MOE = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "4",
          "--moe-router-topk", "2", "--global-batch-size", "4"]
PADDED_ALLTOALL = ["--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.5",
                   "--moe-pad-expert-input-to-capacity"]
COMM_GRID = [
    (2, ["--tensor-model-parallel-size", "2", "--global-batch-size", "4",
         "--log-memory-plan"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
         "full", "--recompute-method", "uniform", "--recompute-num-layers", "2",
         "--global-batch-size", "4"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--bf16", "--global-batch-size", "4"]),
    (2, ["--use-distributed-optimizer", "--bf16", "--global-batch-size", "4"]),
    (2, ["--global-batch-size", "4", "--recompute-granularity", "selective",
         "--recompute-modules", "mlp", "--tensor-model-parallel-size", "2"]),
    (2, ["--context-parallel-size", "2", "--global-batch-size", "4"]),
    # MTP's token shift over cp 4 (cp 2's (2, 2) fp32 mask gather is a counter-skipped scalar)
    (4, ["--context-parallel-size", "4", "--global-batch-size", "4", "--mtp-num-layers", "1",
         "--position-embedding-type", "rope"]),
    (4, ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
         "--global-batch-size", "8"]),
    # the alltoall dispatcher padded to capacity: E·C rows each way, whatever the routing
    (4, ALLTOALL + ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"]),
    # MoE layers under TP + SP: the allgather dispatcher over etp × ep (bf16 probabilities,
    # dense layers between), the alltoall one's etp gathers, ep = 1 (the dispatchers over etp
    # = the tp group) with a gated shared expert and full or MLP recompute re-running the forwards
    (4, TP_MOE + ["--expert-model-parallel-size", "2", "--moe-layer-freq", "2", "--bf16"]),
    (4, TP_MOE + ["--expert-model-parallel-size", "2"] + PADDED_ALLTOALL),
    (2, TP_MOE + ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
                  "--recompute-granularity", "full", "--recompute-method", "block",
                  "--recompute-num-layers", "1"]),
    (2, TP_MOE + PADDED_ALLTOALL + ["--recompute-granularity", "selective",
                                    "--recompute-modules", "mlp"]),
    # the load-balancing losses' statistics over tp (8 experts: the counts are not a scalar)
    (2, TP_MOE + ["--num-experts", "8", "--moe-aux-loss-coeff", "0.01", "--recompute-granularity",
                  "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    (2, TP_MOE + ["--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type",
                  "seq_aux_loss"]),
    # FSDP: ZeRO-2 (3 experts over edp = dp: padded row splits), ZeRO-3 beside TP + SP
    (2, FSDP + ["optim_grads", "--bf16", "--num-experts", "3", "--moe-router-topk", "2",
                "--global-batch-size", "8"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
         "--global-batch-size", "4"] + FSDP + ["optim_grads_params"]),
]


PLAN_GROUPS = {"dp": "dp-cp"}            # the plan's kinds whose group has another name
OPS = ("param_all_gather", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send")


def _as_counted(planned: dict, layout, rank: int) -> dict:
    """The plan's kinds as the counter names them: it tells groups apart by their ranks, so a
    kind is counted under the first of the counter's kinds whose group on ``rank`` holds the
    same ranks (the expert-data group is the dp·cp group where ep = 1; the etp group is the
    tp group where etp = tp; with tp = etp = ep = 2 over 4 ranks the ep group is the dp
    group), and ``*_param_all_gather`` as an ``all_gather``."""
    from support.comm_counter import KINDS, SEND_KINDS

    merged = {}
    for key, value in planned.items():
        op = next(op for op in OPS if key.endswith("_" + op))
        kind = key[:-len(op) - 1]
        ranks = layout.group_of(PLAN_GROUPS.get(kind, kind), rank)
        counted_op = "all_gather" if op == "param_all_gather" else op
        counted_kind = next(k for k in (SEND_KINDS if op == "send" else KINDS)
                            if len(layout.group_of(k, rank)) > 1
                            and layout.group_of(k, rank) == ranks)
        merged[f"{counted_kind}_{counted_op}"] = merged.get(f"{counted_kind}_{counted_op}",
                                                            0) + value
    return merged


@pytest.mark.parametrize("world,flags", COMM_GRID, ids=[" ".join(f) for _, f in COMM_GRID])
def test_comm_bytes_equal_the_collectives_of_a_real_step(run_distributed, world, flags):
    from tpfuse.training.plan.comm import step_comm_bytes

    counted = dict(run_distributed(world, counted_step_body, flags))
    config, settings = parse_args(BASE + STEP + flags)
    layout = layout_of(config, world)
    dp = world // (config.tensor_model_parallel_size * config.pipeline_model_parallel_size
                   * config.context_parallel_size)
    m = settings.training.global_batch_size // (settings.training.micro_batch_size * dp)
    buffers = buffer_settings(config, settings, dp * config.context_parallel_size)
    for rank in range(world):
        planned = step_comm_bytes(config, layout, rank, buffers, 2, m, backend="gloo")
        assert _as_counted(planned, layout, rank) == counted[rank], rank


@pytest.mark.parametrize("flags", [
    ALLTOALL, TP_MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        "alltoall"]], ids=["ep2", "tp2-sp-ep2"])
def test_dropless_alltoall_volume_is_exact_over_the_ep_group_and_bounded_per_rank(
        run_distributed, flags):
    """Dropless, the rows an ep rank's experts receive follow the routing: per rank the counted
    all-to-all lies in the plan's [low, high] (low: the rows it sends, exact; high: every token
    of the group routed to its experts) and over each ep group it sums to the plan's value
    (every row sent is received there: the plan's per-rank value is the group's mean, and the
    exact value under uniform routing); so do the etp gathers of the received rows under TP
    (each etp rank's block padded to the largest: bounded, counted with the tp group's);
    every other kind, the counts' all-gather included, is exact per rank."""
    from tpfuse.training.plan.comm import step_comm_bounds, step_comm_bytes

    counted = dict(run_distributed(4, counted_step_body, flags))
    config, settings = parse_args(BASE + STEP + flags)
    layout = layout_of(config, 4)
    dp = 4 // config.tensor_model_parallel_size
    buffers = buffer_settings(config, settings, dp)
    m = settings.training.global_batch_size // (2 * dp)
    for group in layout.groups("ep"):
        planned_sum = counted_sum = 0
        for rank in group:
            planned = step_comm_bytes(config, layout, rank, buffers, 2, m, backend="gloo")
            bounds = step_comm_bounds(config, layout, rank, 2, m, backend="gloo")
            assert "ep_all_to_all" in bounds
            low, high = ({key: bounds.get(key, (value, value))[side]
                          for key, value in planned.items()} for side in (0, 1))
            low, high = _as_counted(low, layout, rank), _as_counted(high, layout, rank)
            assert set(low) == set(counted[rank]), rank
            for key, volume in counted[rank].items():      # equal where low = high
                assert low[key] <= volume <= high[key], (rank, key, low[key], volume, high[key])
            (all_to_all,) = _as_counted({"ep_all_to_all": 1}, layout, rank)
            planned_sum += _as_counted(planned, layout, rank)[all_to_all]
            counted_sum += counted[rank][all_to_all]
        assert counted_sum == planned_sum, group



@pytest.mark.parametrize("flags", [
    ALLTOALL + ["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
    TP_MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    ALLTOALL + ["--moe-expert-capacity-factor", "1.0"]], ids=["ep2-mlp-recompute", "tp2-sp-ep2",
                                                            "ep2-capacity-unpadded"])
def test_dropless_alltoall_volume_is_exact_for_the_recorded_routing(run_distributed, flags):
    """Given the step's routing (each dispatch's exchanged count table), the plan's all-to-all
    and etp gathers equal the counted collectives on every rank, and so does every other kind:
    the re-run MLP forwards (selective ``mlp``) move their rows once more without a backward,
    the etp blocks are padded to the largest etp rank's, dropped tokens are not sent."""
    from tpfuse.training.plan.comm import step_comm_bytes

    results = run_distributed(4, counted_step_body, flags, True)
    config, settings = parse_args(BASE + STEP + flags)
    layout = layout_of(config, 4)
    dp = 4 // config.tensor_model_parallel_size
    buffers = buffer_settings(config, settings, dp)
    m = settings.training.global_batch_size // (2 * dp)
    for rank, counted, routing in results:
        assert routing and len({r.builds_graph for r in routing}) == (
            2 if "mlp" in flags else 1), rank
        planned = step_comm_bytes(config, layout, rank, buffers, 2, m, backend="gloo",
                                  routing=routing)
        assert _as_counted(planned, layout, rank) == counted, rank

# -------------------------------------------------------------------- activations
ACTIVATION_SHAPE = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
                    "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "61",
                    "--mock-data", "--micro-batch-size", "2", "--train-iters", "1", "--lr",
                    "1e-3", "--attention-dropout", "0"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
ACTIVATION_GRID = [
    [], ["--hidden-dropout", "0"], ["--bf16"], ["--swiglu", "--position-embedding-type", "rope"],
    ["--bf16", "--normalization", "RMSNorm", "--swiglu"],
    SELECTIVE + ["core_attn"], SELECTIVE + ["mlp"], SELECTIVE + ["layernorm"],
    ["--bf16"] + SELECTIVE + ["layernorm", "mlp"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"],
    ["--recompute-granularity", "full", "--recompute-method", "block",
     "--recompute-num-layers", "1", "--bf16"],
    ["--qk-layernorm", "--position-embedding-type", "rope"],
    ["--qk-layernorm", "--normalization", "RMSNorm", "--bf16"] + SELECTIVE + ["core_attn"],
    ["--kv-channels", "24", "--position-embedding-type", "rope", "--qk-layernorm"],
    ["--mtp-num-layers", "2"], ["--mtp-num-layers", "1", "--bf16", "--swiglu"],
]
TP_ACTIVATION_GRID = [["--tensor-model-parallel-size", "2"],
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"],
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
                      + SELECTIVE + ["mlp"],
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
                       "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                       "rope"] + SELECTIVE + ["mlp", "layernorm"],
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--qk-layernorm", "--normalization", "RMSNorm"] + SELECTIVE + ["core_attn"],
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--mtp-num-layers", "1"]]


def saved_chunk_bytes_body(flag_sets):
    """For each flag set: the bytes one micro-batch's forward through this rank's whole model
    chunk (embedding, layers, loss) holds for backward once the forward is done, counted with
    saved-tensor hooks (each storage once, parameters excluded, its size read after the forward:
    what the layernorm recompute discards is not held)."""
    import torch

    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers.random import model_parallel_seed

    results = []
    for flags in flag_sets:
        config, _ = parse_args(ACTIVATION_SHAPE + flags)
        state = None
        if config.tensor_model_parallel_size > 1:
            state = ParallelState.initialize(tp=config.tensor_model_parallel_size)
        try:
            model_parallel_seed(1234, state)
            (model,) = build_model(make_gpt_model_provider(config), config, state)
            model.train()
            params = {p.untyped_storage()._cdata for p in model.parameters()}
            storages = {}           # StorageImpl → its storage, kept alive (no address reuse)

            def pack(t):
                storage = t.untyped_storage()
                if storage._cdata not in params:
                    storages.setdefault(storage._cdata, storage)
                return t

            ids = torch.randint(0, config.vocab_size, (2, config.seq_length),
                                generator=torch.Generator().manual_seed(0))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(ids, labels=ids)
            # read after the forward: an output the layernorm recompute discarded counts 0
            results.append(sum(storage.nbytes() for storage in storages.values()))
            loss.float().mean().backward()
        finally:
            if state is not None:
                state.destroy()
    return results


def _predicted_chunk_bytes(flags) -> float:
    from tpfuse.training.plan.activations import chunk_activation_bytes

    config, _ = parse_args(ACTIVATION_SHAPE + flags)
    kept, _transient = chunk_activation_bytes(config, 2, 0, 0)
    return kept


def test_predicted_activations_are_within_5_percent_of_the_saved_tensors():
    """Dropout, dtypes, norms, activations, rope, each recompute mode (one process)."""
    measured = saved_chunk_bytes_body(ACTIVATION_GRID)
    for flags, saved in zip(ACTIVATION_GRID, measured):
        assert _predicted_chunk_bytes(flags) == pytest.approx(saved, rel=0.05), flags


def test_predicted_activations_under_tensor_and_sequence_parallelism(run_distributed):
    measured = run_distributed(2, saved_chunk_bytes_body, TP_ACTIVATION_GRID)
    for index, flags in enumerate(TP_ACTIVATION_GRID):
        for saved in (rank_result[index] for rank_result in measured):
            assert _predicted_chunk_bytes(flags) == pytest.approx(saved, rel=0.05), flags


def test_in_flight_micro_batches_follow_the_schedules():
    """1F1B holds pp − r micro-batches on rank r; interleaving holds more on the first rank
    (Megatron's warm-up of (pp − r − 1)·2 + (vpp − 1)·pp + 1 forwards, split over the chunks)."""
    from tpfuse.training.plan.activations import activation_peaks

    config, _ = parse_args(BASE + ["--pipeline-model-parallel-size", "4"])
    peaks = activation_peaks(config, 1, 8)
    assert [p["in_flight"] for p in peaks] == [[4], [3], [2], [1]]
    config, _ = parse_args(BASE + ["--pipeline-model-parallel-size", "2",
                                   "--num-layers-per-virtual-pipeline-stage", "1"])
    first, last = activation_peaks(config, 1, 4)
    assert sum(first["in_flight"]) == (2 - 0 - 1) * 2 + (2 - 1) * 2 + 1
    assert sum(last["in_flight"]) == (2 - 1 - 1) * 2 + (2 - 1) * 2 + 1


# -------------------------------------------------------------------- search and CLI
LLAMA_70B = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
             "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--swiglu",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--vocab-size", "128256", "--mock-data",
             "--micro-batch-size", "1", "--global-batch-size", "1024", "--train-iters", "1",
             "--lr", "1e-4", "--bf16", "--use-distributed-optimizer", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--recompute-granularity", "selective"]


def test_search_on_a_70b_config_over_512_ranks_returns_a_valid_layout_that_fits():
    import dataclasses
    import time

    from tpfuse.models.config import TransformerConfig
    from tpfuse.parallel.layout import RankLayout
    from tpfuse.training.plan.report import plan_layout
    from tpfuse.training.plan.search import Cluster, search

    config, settings = parse_args(LLAMA_70B)
    started = time.process_time()
    results = search(config, settings, 512, Cluster(gpu_memory_gib=80))
    assert time.process_time() - started < 20.0          # seconds of CPU, not minutes
    assert results and all(r["fits"] for r in results)
    assert [r["step_s"] for r in results] == sorted(r["step_s"] for r in results)
    best = results[0]
    # the layout rebuilt from scratch: RankLayout and TransformerConfig accept it
    layout = RankLayout(512, tp=best["tp"], pp=best["pp"], cp=best["cp"], ep=best["ep"])
    assert layout.dp == best["dp"]
    values = {f.name: getattr(best["config"], f.name)
              for f in dataclasses.fields(TransformerConfig) if f.init}
    rebuilt = TransformerConfig(**values)
    assert (rebuilt.tensor_model_parallel_size, rebuilt.pipeline_model_parallel_size) == \
        (best["tp"], best["pp"])
    assert 8 % best["tp"] == 0 and 64 % best["tp"] == 0 and 80 % best["pp"] == 0
    assert 4096 % (2 * best["cp"]) == 0 or best["cp"] == 1
    assert 1024 % (best["dp"] * 1) == 0
    # the full plan of that layout: every rank fits
    plan = plan_layout(best["config"], settings, 512)
    assert max(r["memory_bytes"]["total"] for r in plan["ranks"]) <= 80 * 2 ** 30


@pytest.mark.parametrize("flags", [
    ["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--swiglu"],
    ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
     "--moe-shared-expert-intermediate-size", "32", "--global-batch-size", "8",
     "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"]], ids=["dense", "moe-full-recompute"])
def test_search_compute_term_is_the_trainers_model_flops(flags):
    """The roofline's compute is ``models.flops.flops_per_iteration`` (what --log-throughput
    gives MFU with) at the cluster's MFU of every rank's peak."""
    from tpfuse.models.flops import flops_per_iteration
    from tpfuse.training.plan.search import Cluster, evaluate

    config, settings = parse_args(BASE + flags)
    cluster = Cluster(gpu_memory_gib=80, peak_tflops=100.0, mfu=0.25)
    result = evaluate(config, settings, 4, cluster)
    assert result["dp"] * result["m"] == 8
    assert result["compute_s"] * 4 * 100e12 * 0.25 == pytest.approx(
        flops_per_iteration(config, 8), rel=1e-12)


def test_cli_json_has_every_rank(capsys):
    import json

    from tpfuse.training.plan.cli import main

    assert main(BASE + ["--world-size", "4", "--tensor-model-parallel-size", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in plan["ranks"]] == [0, 1, 2, 3]
    assert set(plan["ranks"][0]["memory_bytes"]) == {
        "parameters", "main_parameters", "gradients", "optimizer_state", "activations", "total"}
    assert "tp_all_reduce" in plan["ranks"][0]["comm_bytes_per_step"]


def test_cli_rejects_a_layout_that_does_not_divide_the_world():
    from tpfuse.training.plan.cli import main

    with pytest.raises(SystemExit, match="world_size=6 is not divisible"):
        main(BASE + ["--world-size", "6", "--tensor-model-parallel-size", "4"])
    with pytest.raises(SystemExit, match="--gpu-memory-gib"):
        main(BASE + ["--world-size", "4", "--search"])


# -------------------------------------------------------------------- hybrid sharding (hsdp)
HSDP2 = ["--num-distributed-optimizer-instances", "2"]
HSDP_GRID = [["--use-distributed-optimizer"] + HSDP2,
             FSDP + ["optim_grads_params"] + HSDP2,
             ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
              "--use-distributed-optimizer", "--bf16"] + HSDP2]


def test_hybrid_sharding_memory_is_one_shard_of_one_process_and_the_plan(run_distributed):
    """dp 4 = 2 instances x 2 shards: every rank's record is the plan's; with FSDP2 a rank holds
    exactly half of one process's parameters, gradients and optimizer state (every dim 0 of
    this model is even: no row padding), with the distributed optimizer the two ranks of an
    instance hold one process's optimizer state between them (the buffers are cut in halves,
    each padded to lcm(2, 128): the halves are not equal), and each rank holds exactly what its
    replica in the other instance holds."""
    single = dict(run_distributed(1, measured_memory_body, [[]]))[0][0][0]
    measured = dict(run_distributed(4, measured_memory_body, HSDP_GRID))
    for index, flags in enumerate(HSDP_GRID):
        config, settings = parse_args(BASE + flags)
        layout = layout_of(config, 4)
        buffers = buffer_settings(config, settings, 4)
        assert buffers.instances == 2
        for rank in range(4):
            held, line = measured[rank][index]
            assert static_memory(config, layout, rank, buffers) == held, (flags, rank)
            assert "!=" not in line, line
            assert held == measured[(rank + 2) % 4][index][0]    # its replica (ranks r, r + 2)
    fsdp = [measured[rank][1][0] for rank in range(4)]
    for held in fsdp:
        for kind in ("parameters", "gradients", "optimizer_state"):
            assert 2 * held[kind] == single[kind], kind
    distributed = [measured[rank][0][0] for rank in (0, 1)]    # instance 0
    assert sum(h["optimizer_state"] for h in distributed) == single["optimizer_state"]
    assert all(h["parameters"] >= single["parameters"] for h in distributed)   # ZeRO-1: whole


HSDP_COMM_GRID = [["--use-distributed-optimizer", "--global-batch-size", "8"] + HSDP2,
                  ["--global-batch-size", "8"] + FSDP + ["optim_grads_params"] + HSDP2]


def _hsdp_as_counted(planned: dict, layout, rank: int) -> dict:
    """``_as_counted`` with the instance kinds (``intra-dp`` ...) under the state's names."""
    instance = {k: v for k, v in planned.items() if k.startswith(("intra-", "inter-"))}
    merged = _as_counted({k: v for k, v in planned.items() if k not in instance}, layout, rank)
    for key, value in instance.items():
        kind, op = key.split("_", 1)
        op = "all_gather" if op == "param_all_gather" else op
        name = {"intra-dp": "intra-dp-cp", "inter-dp": "inter-dp-cp"}.get(kind, kind)
        merged[f"{name}_{op}"] = merged.get(f"{name}_{op}", 0) + value
    return merged


@pytest.mark.parametrize("flags", HSDP_COMM_GRID, ids=["distopt", "fsdp-zero3"])
def test_hybrid_sharding_comm_bytes_equal_the_collectives_of_a_real_step(run_distributed, flags):
    """dp 4 = 2 x 2 on gloo: the plan's reduction and gathers inside the instance and its
    all-reduce of the shard across the instances are the bytes the step's collectives pass."""
    from tpfuse.training.plan.comm import step_comm_bytes

    counted = dict(run_distributed(4, counted_step_body, flags))
    config, settings = parse_args(BASE + STEP + flags)
    layout = layout_of(config, 4)
    buffers = buffer_settings(config, settings, 4)
    for rank in range(4):
        planned = step_comm_bytes(config, layout, rank, buffers, 2, 1, backend="gloo")
        assert any(k.startswith("inter-dp") for k in planned), planned
        assert _hsdp_as_counted(planned, layout, rank) == counted[rank], rank
