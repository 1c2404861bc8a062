"""``tpfuse-plan --search``: every valid layout of a world size, those that fit, fastest first.

Candidates: tp over the divisors of the world size up to ``--gpus-per-node`` (heads, query groups
and the MLP width divisible by it), sequence parallelism on whenever tp > 1; pp dividing the
layers; vpp ∈ {none, 2, 4, ...} dividing the layers per stage (interleaving needs m ≥ pp); cp
dividing the sequence into 2·cp chunks; for MoE models ep dividing the experts; the rest of the
world is dp and must divide the global batch with the micro-batch. Each candidate takes the
command line's precision, batch, recompute and distributed-optimizer flags, and is validated as
the trainer validates it (``RankLayout`` + ``TransformerConfig``: a ValueError drops it). Memory
is planned on one rank per pipeline stage (dp rank 0: its optimizer shard is the largest) and the
candidate fits when every stage's total ≤ ``--gpu-memory-gib``.

The roofline step time (seconds), stated::

    compute  = F / (world · peak · MFU)
               F = models.flops.flops_per_iteration(config, global batch): the model FLOPs
               the trainer's --log-throughput counts MFU with (matrix multiplies only,
               attention's full s × s square, backward = 2 × forward, + 1 forward under
               full recompute; MoE: router and the top-k experts)
    bubble   = compute · f / (1 − f)      f: the simulated bubble fraction of the schedule
    comm     = Σ over group kinds  bytes_kind · ring_factor / bandwidth_kind
               ring_factor: 2(n−1)/n all-reduce, (n−1)/n all-gather / reduce-scatter /
               all-to-all, 1 for sends; bandwidth: --intra-node-gbps when the group sits in
               one node (--gpus-per-node consecutive ranks), else --inter-node-gbps
    step     = compute + bubble + comm          (nothing overlapped: an upper bound)

with the global batch = m · b · dp samples, peak ``--peak-tflops`` (default 989.4,
``models.flops.H200_BF16_DENSE_TFLOPS``: an H100 / H200's dense bf16) and MFU ``--mfu``
(default 0.5, the share of peak the GEMMs reach).
"""
from __future__ import annotations

import dataclasses

from tpfuse.models.flops import H200_BF16_DENSE_TFLOPS, flops_per_iteration

from .memory import MEMORY_KINDS, buffer_settings, replica_group, shard_group
from .activations import activation_peaks, bubble_fraction
from .comm import step_comm_bytes
from .report import (GIB, checked_layout, data_parallel_size, num_microbatches,
                          planned_backend, rank_memory, representative_ranks)


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu_memory_gib: float
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0     # GB/s per GPU inside a node (NVLink)
    inter_node_gbps: float = 50.0      # GB/s per GPU across nodes (400 Gb/s NIC)
    peak_tflops: float = H200_BF16_DENSE_TFLOPS
    mfu: float = 0.5


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_sizes(config, world_size: int, gpus_per_node: int):
    """(tp, pp, vpp, cp, ep) tuples worth validating (the cheap divisibility filters)."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    ffn = config.ffn_hidden_size
    for tp in _divisors(world_size):
        if tp > gpus_per_node or heads % tp or groups % tp or ffn % tp:
            continue
        for pp in _divisors(world_size // tp):
            if config.num_layers % pp:
                continue
            vpps = [None] + [v for v in (2, 4, 8) if pp > 1 and config.num_layers % (pp * v) == 0]
            for cp in _divisors(world_size // (tp * pp)):
                if config.seq_length % (2 * cp if cp > 1 else 1):
                    continue
                eps = [1]
                if config.num_moe_experts:
                    eps = [e for e in _divisors(config.num_moe_experts)
                           if (world_size // (tp * pp)) % e == 0]
                for vpp in vpps:
                    for ep in eps:
                        yield tp, pp, vpp, cp, ep


def candidate_config(config, tp, pp, vpp, cp, ep):
    """The config with these sizes (validated by TransformerConfig: ValueError if invalid)."""
    return dataclasses.replace(
        config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, num_layers_per_virtual_pipeline_stage=None,
        context_parallel_size=cp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=None if config.expert_tensor_parallel_size is None else tp,
        sequence_parallel=tp > 1, pipeline_schedule=None,
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)


def compute_seconds(config, global_batch_size: int, world_size: int,
                    cluster: Cluster) -> float:
    """The roofline's compute term: the step's model FLOPs (``models/flops.py``, the trainer's
    MFU accounting) at ``cluster.mfu`` of every rank's peak."""
    flops = flops_per_iteration(config, global_batch_size)
    return flops / (world_size * cluster.peak_tflops * 1e12 * cluster.mfu)


def _ring_factor(op: str, n: int) -> float:
    if op == "send":
        return 1.0
    if op.endswith("all_reduce"):
        return 2 * (n - 1) / n
    return (n - 1) / n


GROUP_OF_KIND = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": "dp-cp", "edp": "edp",
                 "embedding": "embedding", "etp": "etp", "etp-ep": "etp-ep", "tp-cp": "tp-cp"}


def _group_of_kind(kind: str, layout, rank: int, instances: int) -> list:
    """The ranks of ``rank``'s group of the plan's kind ``kind`` (``intra-dp`` / ``inter-dp``
    / ``intra-edp`` / ``inter-edp``: the distributed-optimizer instances')."""
    where, _, base = kind.partition("-")
    if where in ("intra", "inter") and base in ("dp", "edp"):
        pick = shard_group if where == "intra" else replica_group
        return pick(layout, GROUP_OF_KIND[base], rank, instances)
    return layout.group_of(GROUP_OF_KIND[kind], rank) or [rank]


def comm_seconds(comm: dict, layout, rank: int, cluster: Cluster, instances: int = 1) -> float:
    seconds = 0.0
    for key, nbytes in comm.items():
        kind, op = key.split("_", 1)
        group = _group_of_kind(kind, layout, rank, instances)
        one_node = len({r // cluster.gpus_per_node for r in group}) == 1
        bandwidth = (cluster.intra_node_gbps if one_node else cluster.inter_node_gbps) * 1e9
        seconds += nbytes * _ring_factor(op, len(group)) / bandwidth
    return seconds


def evaluate(config, settings, world_size: int, cluster: Cluster, cache=None) -> dict:
    """One candidate's fit and step time (one rank per pipeline stage); ``cache``: a dict
    shared by the candidates (schedules and bubbles by shape)."""
    cache = {} if cache is None else cache
    layout = checked_layout(config, settings, world_size)
    dp = data_parallel_size(config, world_size)
    m = num_microbatches(settings, dp)
    if config.virtual_pipeline_model_parallel_size and m % config.pipeline_model_parallel_size:
        raise ValueError("interleaving needs the micro-batches to fill whole rounds of pp")
    b = settings.training.micro_batch_size
    buffers = buffer_settings(config, settings, dp * config.context_parallel_size)
    peaks = activation_peaks(config, b, m, cache)
    backend = planned_backend(settings)
    stages, comm_time = [], 0.0
    for rank in representative_ranks(layout):
        held = rank_memory(config, layout, rank, buffers, peaks[layout.rank_in("pp", rank)])
        stages.append(held)
        comm = step_comm_bytes(config, layout, rank, buffers, b, m, backend,
                               settings.distributed.reduce_scatter_strategy)
        comm_time = max(comm_time, comm_seconds(comm, layout, rank, cluster, buffers.instances))
    compute = compute_seconds(config, m * b * dp, world_size, cluster)
    bubble = bubble_fraction(config, m, cache)
    idle = compute * bubble / (1 - bubble) if bubble < 1 else float("inf")
    worst = max(stages, key=lambda held: held["total"])
    return {"tp": config.tensor_model_parallel_size, "pp": config.pipeline_model_parallel_size,
            "vpp": config.virtual_pipeline_model_parallel_size,
            "cp": config.context_parallel_size, "ep": config.expert_model_parallel_size,
            "dp": dp, "m": m, "memory_gib": worst["total"] / GIB,
            "memory_by_kind": {k: worst[k] for k in (*MEMORY_KINDS, "activations")},
            "fits": worst["total"] <= cluster.gpu_memory_gib * GIB,
            "compute_s": compute, "bubble_s": idle, "comm_s": comm_time,
            "step_s": compute + idle + comm_time, "bubble_fraction": bubble, "config": config}


def search(config, settings, world_size: int, cluster: Cluster) -> list:
    """Every valid layout that fits, fastest first (ties: less memory)."""
    results, cache = [], {}
    for sizes in candidate_sizes(config, world_size, cluster.gpus_per_node):
        try:
            candidate = candidate_config(config, *sizes)
            result = evaluate(candidate, settings, world_size, cluster, cache)
        except ValueError:
            continue
        if result["fits"]:
            results.append(result)
    return sorted(results, key=lambda r: (r["step_s"], r["memory_gib"]))


def format_search(results: list, cluster: Cluster, top: int) -> str:
    head = (f"{len(results)} layouts fit in {cluster.gpu_memory_gib:g} GiB; roofline step time "
            f"(MFU {cluster.mfu:g} of {cluster.peak_tflops:g} TFLOP/s, {cluster.intra_node_gbps:g}"
            f" / {cluster.inter_node_gbps:g} GB/s in / across nodes of {cluster.gpus_per_node})")
    lines = [head, f"{'tp':>3s} {'pp':>3s} {'vpp':>4s} {'cp':>3s} {'ep':>3s} {'dp':>4s} {'m':>5s} "
             f"{'GiB':>7s} {'step s':>8s} {'compute':>8s} {'bubble':>8s} {'comm':>8s}"]
    for r in results[:top]:
        lines.append(f"{r['tp']:3d} {r['pp']:3d} {str(r['vpp'] or '-'):>4s} {r['cp']:3d} "
                     f"{r['ep']:3d} {r['dp']:4d} {r['m']:5d} {r['memory_gib']:7.2f} "
                     f"{r['step_s']:8.3f} {r['compute_s']:8.3f} {r['bubble_s']:8.3f} "
                     f"{r['comm_s']:8.3f}")
    return "\n".join(lines)


def save_png(results: list, path: str, top: int) -> None:
    """Stacked bars: the most loaded rank's memory by kind for the top layouts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = results[:top]
    labels = [f"tp{r['tp']} pp{r['pp']}" + (f" v{r['vpp']}" if r["vpp"] else "")
              + (f" cp{r['cp']}" if r["cp"] > 1 else "") + (f" ep{r['ep']}" if r["ep"] > 1
                                                              else "") for r in shown]
    fig, ax = plt.subplots(figsize=(max(6, len(shown) * 0.9), 4))
    bottom = [0.0] * len(shown)
    for kind in (*MEMORY_KINDS, "activations"):
        values = [r["memory_by_kind"][kind] / GIB for r in shown]
        ax.bar(labels, values, bottom=bottom, label=kind.replace("_", " "))
        bottom = [a + v for a, v in zip(bottom, values)]
    ax.set_ylabel("GiB on the most loaded rank")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
