"""Memory accounting: what this rank holds for parameters, fp32 main parameters, gradients and
optimizer state, next to Megatron's theoretical estimate for the configuration.

The measured record (``{"memory_bytes": {...}}``) counts the tensors the optimizer and the
gradient buffers own on this rank (``MixedPrecisionOptimizer.memory_bytes``): a main parameter
that is the model parameter itself (fp32 training) costs nothing extra; with the distributed
optimizer main parameters and Adam moments cover this rank's shard only, and parameters and
gradients include the buffers' alignment padding.

Megatron's estimate (megatron/training/theoretical_memory_usage.py), restated:

    weights + optimizer = P_shard · (18 bytes, or 6 + 12/dp with the distributed optimizer)

with P_shard the parameters of the most loaded model shard, ((L·P_layer + final norm)/pp + V·h)/tp
(+ V·h/tp for an untied output layer at pp = 1); 18 = 2 (16-bit weight) + 4 (fp32 gradient) + 12
(fp32 main weight and two Adam moments). Activations (Korthikanti et al.): per layer
s·b·h·(18 + 4·ffn/h), all divided by tp, with sequence parallelism and selective recompute, else
s·b·h·(10 + 24/tp) and 5 % on top; plus the embedding's 8·s·b·pp + s·b·h·pp, the
interleaved-schedule factor 1 + (pp−1)/(pp·vpp) (or min(1, m/pp) without it) and at pp = 1 the
output layer and loss.
"""
from __future__ import annotations

import math

MIB = 1024 * 1024


# -------------------------------------------------------------------- Megatron's estimate
def parameters_per_layer(config) -> float:
    """Parameters of one dense transformer layer (Megatron's count: biases of the QKV/fc
    layers are left out, norms counted with weight and bias for LayerNorm)."""
    h, heads = config.hidden_size, config.num_attention_heads
    query_ratio = config.kv_channels * heads / h
    attention = 2 * h * h * (1 + config.num_query_groups / heads) * query_ratio
    gated = 1.5 if config.activation == "swiglu" else 1.0
    norm = 1 if config.normalization == "RMSNorm" else 2
    return 2 * h * (config.ffn_hidden_size * gated + norm) + attention


def most_loaded_shard_parameters(config) -> float:
    h, tp, pp = config.hidden_size, config.tensor_model_parallel_size, \
        config.pipeline_model_parallel_size
    norm = 1 if config.normalization == "RMSNorm" else 2
    block = parameters_per_layer(config) * config.num_layers + norm * h
    embedding = h * config.padded_vocab_size
    shard = (block / pp + embedding) / tp
    if config.untie_embeddings_and_output_weights and pp == 1:
        shard += embedding / tp
    return shard


def weight_and_optimizer_bytes(config, dp: int, distributed_optimizer: bool) -> float:
    per_parameter = 6 + 12 / dp if distributed_optimizer else 18
    return most_loaded_shard_parameters(config) * per_parameter


def activation_bytes(config, micro_batch_size: int, num_microbatches: int | None) -> float:
    """Megatron's activation estimate of the first pipeline stage (bytes)."""
    s, b, h = config.seq_length, micro_batch_size, config.hidden_size
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    with_sp = config.sequence_parallel and config.recompute_granularity == "selective"
    per_layer = s * b * h * (18 + 4 * config.ffn_hidden_size / h if with_sp else 10 + 24 / tp)
    total = per_layer * config.num_layers + 8 * s * b * pp + s * b * h * pp
    if vpp is not None:
        total *= 1 + (pp - 1) / (pp * vpp)
    elif pp > 1 and num_microbatches is not None:
        total *= min(1, num_microbatches / pp)
    if with_sp:
        if pp == 1:
            total += s * b * h * 4 * (1 + config.padded_vocab_size / h)
        return total / tp
    if pp == 1:
        total += (s * b * config.padded_vocab_size / tp + s * b * h) * 2
    return total * 1.05


# -------------------------------------------------------------------- the start-up report
def memory_record(optimizer, iteration: int, rank: int = 0) -> dict:
    """The one metrics-file record written before the first iteration of a run (bytes on the
    global rank ``rank``, the logging rank); ``iteration`` is where the run starts (0, or the
    resumed iteration)."""
    return {"iteration": iteration, "rank": rank, "memory_bytes": optimizer.memory_bytes()}


def memory_plan_report(optimizer, config, settings, world_size: int, rank: int) -> str:
    """``--log-memory-plan``: tpfuse-plan's four static kinds for this rank beside what it holds
    (MiB; ``=`` where they agree to the byte), and the planned activation peak."""
    from .plan.report import plan_layout

    (planned,) = plan_layout(config, settings, world_size, ranks=[rank])["ranks"]
    held = optimizer.memory_bytes()
    parts = []
    for kind, value in held.items():
        plan = planned["memory_bytes"][kind]
        mark = "=" if plan == value else "!="
        parts.append(f"{kind.replace('_', ' ')} {value / MIB:.2f} {mark} plan {plan / MIB:.2f}")
    activations = planned["memory_bytes"]["activations"] / MIB
    return (f"> rank {rank} memory (MiB) held vs tpfuse-plan: " + ", ".join(parts)
            + f" | planned activation peak {activations:.2f} MiB "
            f"(micro-batches in flight per chunk {planned['in_flight_microbatches']})")


def memory_report(optimizer, config, dp: int, micro_batch_size: int,
                  num_microbatches: int | None) -> str:
    """The start-up log line: this rank's MiB per kind, and Megatron's estimate beside it."""
    held = optimizer.memory_bytes()
    parts = ", ".join(f"{kind.replace('_', ' ')} {value / MIB:.2f}" for kind, value in held.items())
    weights = weight_and_optimizer_bytes(config, dp, optimizer.distributed) / MIB
    activations = activation_bytes(config, micro_batch_size, num_microbatches) / MIB
    return (f"> memory on this rank (MiB): {parts} (total {sum(held.values()) / MIB:.2f}) | "
            f"Megatron's theoretical estimate (16-bit weights, fp32 grads/main/Adam): weight and "
            f"optimizer={weights:.2f} MiB, activation={activations:.2f} MiB, "
            f"total={weights + activations:.2f} MiB")


def peak_allocated_mib(device) -> float | None:
    """Peak CUDA memory allocated since the last call (then reset); None off CUDA."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / MIB
    torch.cuda.reset_peak_memory_stats(device)
    return peak if math.isfinite(peak) else None
