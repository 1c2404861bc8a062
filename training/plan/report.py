"""One layout's plan: every rank's memory and communication, the micro-batches and the bubble.

``plan_layout(config, settings, world_size)`` is what ``tpfuse-plan --json`` prints::

    {"world_size": N, "layout": {"tp", "pp", "vpp", "cp", "ep", "etp", "dp"},
     "num_microbatches": m, "micro_batch_size": b, "bubble_fraction": f,
     "ranks": [{"rank", "coords": {...}, "memory_bytes": {parameters, main_parameters,
                gradients, optimizer_state, activations, total},
                "in_flight_microbatches": [per chunk], "comm_bytes_per_step": {...},
                "comm_bounds_per_step": {kind: [low, high]}}, ...]}

``memory_bytes``' first four kinds are the trainer's record (``memory.py``), activations the
schedule's peak (``activations.py``); ``comm_bytes_per_step``: ``comm.py``, exact
for every kind except those ``comm_bounds_per_step`` names (the alltoall dispatcher's
all-to-all without capacity padding: its value under uniform routing, and the range the routing
can take it to).
"""
from __future__ import annotations

from tpfuse.parallel.layout import check_distributed_optimizer_instances

from .memory import MEMORY_KINDS, buffer_settings, layout_of, static_memory
from .activations import activation_peaks, bubble_fraction
from .comm import step_comm_bounds, step_comm_bytes


def data_parallel_size(config, world_size: int) -> int:
    model = (config.tensor_model_parallel_size * config.pipeline_model_parallel_size
             * config.context_parallel_size)
    return world_size // model


def num_microbatches(settings, dp: int) -> int:
    """m of a full global batch (after any ramp-up); ValueError when it does not divide."""
    training = settings.training
    global_batch = training.global_batch_size or training.micro_batch_size * dp
    per_step = training.micro_batch_size * dp
    if global_batch % per_step:
        raise ValueError(f"--global-batch-size {global_batch} is not divisible by "
                         f"--micro-batch-size {training.micro_batch_size} × dp {dp}")
    return global_batch // per_step


def planned_backend(settings) -> str:
    """The collective backend the plan assumes: ``--distributed-backend``, else nccl (a plan is
    for the GPUs to rent)."""
    return settings.distributed.distributed_backend or "nccl"


def rank_memory(config, layout, rank: int, buffers, activation_peak: dict) -> dict:
    held = static_memory(config, layout, rank, buffers)
    held["activations"] = activation_peak["bytes"]
    held["total"] = sum(held[k] for k in MEMORY_KINDS) + held["activations"]
    return held


def checked_layout(config, settings, world_size: int):
    """The RankLayout of the config over ``world_size`` ranks, its distributed-optimizer
    instances checked against the data-parallel sizes (ValueError naming the flag)."""
    layout = layout_of(config, world_size)
    check_distributed_optimizer_instances(
        settings.data_parallel.num_distributed_optimizer_instances, layout.dp * layout.cp,
        layout.edp)
    return layout


def plan_layout(config, settings, world_size: int, ranks=None) -> dict:
    """The plan of every rank (or of ``ranks``); see the module docstring."""
    layout = checked_layout(config, settings, world_size)
    dp = data_parallel_size(config, world_size)
    m = num_microbatches(settings, dp)
    b = settings.training.micro_batch_size
    buffers = buffer_settings(config, settings, dp * config.context_parallel_size)
    peaks = activation_peaks(config, b, m)
    backend = planned_backend(settings)
    reduce_scatter = settings.distributed.reduce_scatter_strategy
    rows = []
    for rank in (range(world_size) if ranks is None else ranks):
        peak = peaks[layout.rank_in("pp", rank)]
        rows.append({"rank": rank, "coords": layout.coords(rank),
                     "memory_bytes": rank_memory(config, layout, rank, buffers, peak),
                     "in_flight_microbatches": peak["in_flight"],
                     "comm_bytes_per_step": step_comm_bytes(config, layout, rank, buffers, b, m,
                                                            backend, reduce_scatter),
                     "comm_bounds_per_step": step_comm_bounds(config, layout, rank, b, m,
                                                              backend, reduce_scatter)})
    return {"world_size": world_size,
            "layout": {"tp": config.tensor_model_parallel_size,
                       "pp": config.pipeline_model_parallel_size,
                       "vpp": config.virtual_pipeline_model_parallel_size,
                       "cp": config.context_parallel_size,
                       "ep": config.expert_model_parallel_size,
                       "etp": config.expert_tensor_parallel_size, "dp": dp,
                       "sequence_parallel": config.sequence_parallel,
                       "use_distributed_optimizer":
                           settings.data_parallel.use_distributed_optimizer,
                       "fsdp": buffers.fsdp_strategy,
                       "num_distributed_optimizer_instances": buffers.instances},
            "num_microbatches": m, "micro_batch_size": b, "backend": backend,
            "bubble_fraction": bubble_fraction(config, m), "ranks": rows}


def representative_ranks(layout) -> list:
    """One rank per pipeline stage with every other coordinate 0 (its dp shard is the largest
    with the distributed optimizer: the padding sits in the last shards)."""
    return [layout.groups("pp")[0][stage] for stage in range(layout.pp)]


GIB = 2.0 ** 30


def format_plan(plan: dict) -> str:
    """The text table: one line per rank (GiB), and the step's communication per rank (a
    routing-dependent kind with its [low, high] after the uniform-routing value)."""
    layout = plan["layout"]
    head = (f"tpfuse-plan: {plan['world_size']} ranks, " + " ".join(
        f"{k}={v}" for k, v in layout.items()) + f" | m={plan['num_microbatches']} micro-batches"
        f" of {plan['micro_batch_size']}, bubble {plan['bubble_fraction']:.1%}")
    kinds = ("parameters", "main_parameters", "gradients", "optimizer_state", "activations",
             "total")
    big = max(row["memory_bytes"]["total"] for row in plan["ranks"]) >= GIB
    unit, scale = ("GiB", GIB) if big else ("MiB", 2.0 ** 20)
    lines = [head, f"{'rank':>5s} {'pp':>3s} " + " ".join(f"{k[:11]:>11s}" for k in kinds)
             + f"  ({unit})   comm per step (MiB)"]
    for row in plan["ranks"]:
        held = row["memory_bytes"]
        bounds = row.get("comm_bounds_per_step", {})
        comm = ", ".join(f"{k} {v / 2 ** 20:.1f}" + (
            f" [{bounds[k][0] / 2 ** 20:.1f}, {bounds[k][1] / 2 ** 20:.1f}]" if k in bounds else "")
            for k, v in row["comm_bytes_per_step"].items())
        lines.append(f"{row['rank']:5d} {row['coords']['pp']:3d} "
                     + " ".join(f"{held[k] / scale:11.3f}" for k in kinds) + f"  {comm}")
    return "\n".join(lines)
