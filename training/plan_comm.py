"""Communication volume of one optimizer step per rank, by group kind, for tpfuse-plan.

A collective's volume is its message as the caller passes it: the input of an all-reduce,
reduce-scatter or all-to-all, the gathered output of an all-gather, the tensor of a send (a
rank's receives are its peers' sends). Scalars (the grad norm, loss logs) are left out. With
``X = s·b·h·e`` (``s`` this rank's tokens seq_length/cp, ``e`` the activation element size) and
``m`` micro-batches per step, per micro-batch on a rank of tp = t > 1:

==========================  ================================================================
TP, no SP (all-reduce)      4X per layer (proj and fc2 forward, QKV and fc1 input gradients),
                            + 2X per layer re-run by full recompute, + X per layer whose MLP
                            is recomputed; embedding X forward, output layer X backward;
                            cross-entropy 3·s·b·4 (max, sum-exp and target logit)
TP with SP                  all-gather 6X per layer (QKV and fc1 inputs forward, their
                            re-gather for the weight gradients, the gradients of the two
                            reduce-scatters) + embedding X (its gradient) + learned positions X
                            + output layer 2X; reduce-scatter 4X per layer + embedding X +
                            output layer X; full / MLP recompute re-run the forward's (2X / X
                            each); all-reduce of the sequence-parallel parameters' gradients
                            (norms, row-parallel biases) in their dtype + cross-entropy
CP ring (send)              (3·cp − 2)·KV per layer, KV = 2·s·b·g/t·d·e (the K, V blocks
                            forward (cp − 1 hops), again in backward, their gradients cp hops)
EP (allgather dispatcher)   per MoE layer all-gather 2·ep·T·h·e + ep·T·E·5 (probabilities and
                            routing map), reduce-scatter 2·ep·T·h·e + ep·T·E·4, T = s·b/t'
EP (alltoall dispatcher)    per MoE layer all-to-all 2·(sent + received)·h·e (dispatch and
                            combine, both again in backward), ``alltoall_rows``: padded to
                            capacity sent = received = E·C, exact; dropless sent = T·k
                            (exact) and received depends on the routing: the plan gives
                            T·k (uniform routing, and the ep group's mean: the group's sum
                            is exact) and its [low, high] in ``step_comm_bounds``; unpadded,
                            the split counts' all-gather ep·E·8 (exact)
PP (send)                   X/t' per micro-batch and chunk with a next stage (activation) and
                            with a previous stage (gradient)
==========================  ================================================================

Per step: DP reduces every gradient buffer once (its padded bytes; a reduce-scatter with the
distributed optimizer on NCCL, an all-reduce otherwise, gloo included: its reduce-scatter is the
slower), the distributed optimizer all-gathers every parameter buffer; the tied word embedding's
gradient is all-reduced over the embedding group (first and last stage, pp > 1). Expert buffers
reduce over the expert-data group (``edp``), dense ones over dp·cp (``dp``). With
``--use-torch-fsdp2`` the buffers' traffic is replaced by FSDP's, per micro-batch and unit
(``fsdp_bytes``): the padded parameters all-gathered in the compute dtype once (ZeRO-2) or twice
(ZeRO-3, forward and backward), the padded fp32 gradients reduce-scattered once.

Checked byte for byte against the collectives of a real step for TP (with and without SP, full
recompute), DP (plain, distributed optimizer, FSDP ZeRO-2 and ZeRO-3), PP and the tied
embedding, CP (cp = 2), EP with the allgather dispatcher and with the alltoall one padded to
capacity (tests/training/test_plan.py); the dropless alltoall dispatcher's all-to-all is checked
within its per-rank bounds and exactly in its sum over each ep group. Not modelled: the alltoall
dispatcher's rows all-gathered and reduce-scattered over the expert-tensor group (etp > 1), and
the TP traffic of MoE layers under tensor parallelism (counted as a dense layer's: their router
statistics, shared-expert-only gathers and the dispatchers' etp collectives differ).
"""
from __future__ import annotations

from collections import defaultdict

from tpfuse.models.layer_assignment import layers_for
from tpfuse.models.moe_config import moe_layer_pattern

from .fsdp import padded_shard_numel, shard_rows
from .plan import buffer_plans, element_bytes, fsdp_units


def _layer_counts(config, pp_rank: int) -> tuple[int, int, int]:
    """(layers, MoE layers, layers re-run by full recompute) of all chunks of ``pp_rank``."""
    vpp = config.virtual_pipeline_model_parallel_size
    pattern = moe_layer_pattern(config)
    layers = moe = rerun = 0
    for chunk in range(vpp or 1):
        indices = layers_for(config, pp_rank, None if vpp is None else chunk)
        layers += len(indices)
        moe += sum(pattern[i] for i in indices)
        if config.recompute_granularity == "full":
            n = config.recompute_num_layers
            rerun += len(indices) if config.recompute_method == "uniform" else min(n, len(indices))
    return layers, moe, rerun


def _sequence_parallel_params(config, pp_rank: int) -> int:
    """Elements whose gradient is all-reduced over TP under SP: norms and row-parallel biases."""
    per_norm = config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)
    layers, _, _ = _layer_counts(config, pp_rank)
    rows = 2 * config.hidden_size if config.add_bias_linear else 0
    total = layers * (2 * per_norm + rows)
    if pp_rank == config.pipeline_model_parallel_size - 1:
        total += per_norm                                       # the final norm
    return total


def tensor_parallel_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    """TP volume of one micro-batch on ``pp_rank`` (its chunks together)."""
    t = config.tensor_model_parallel_size
    if t == 1:
        return {}
    pp = config.pipeline_model_parallel_size
    e = element_bytes(config.params_dtype)
    s = config.seq_length // config.context_parallel_size
    x = s * micro_batch_size * config.hidden_size * e
    layers, _, rerun = _layer_counts(config, pp_rank)
    mlp_rerun = layers if (config.recompute_granularity == "selective"
                           and "mlp" in (config.recompute_modules or ())) else 0
    first, last = pp_rank == 0, pp_rank == pp - 1        # chunk 0 of rank 0, last chunk of last
    cross_entropy = 3 * s * micro_batch_size * 4 if last else 0
    if not config.sequence_parallel:
        reduce = (4 * layers + 2 * rerun + mlp_rerun) * x + (x if first else 0) \
            + (x if last else 0) + cross_entropy
        return {"tp_all_reduce": reduce}
    positions = config.position_embedding_type == "learned_absolute"
    gather = (6 * layers + 2 * rerun + mlp_rerun) * x
    gather += (x + (x if positions else 0)) if first else 0
    gather += 2 * x if last else 0
    scatter = (4 * layers + 2 * rerun + mlp_rerun) * x + (x if first else 0) \
        + (x if last else 0)
    reduce = _sequence_parallel_params(config, pp_rank) * e + cross_entropy
    return {"tp_all_gather": gather, "tp_reduce_scatter": scatter, "tp_all_reduce": reduce}


def context_parallel_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    cp = config.context_parallel_size
    if cp == 1:
        return {}
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.hidden_size // heads
    s = config.seq_length // cp
    kv = 2 * s * micro_batch_size * groups // config.tensor_model_parallel_size * head_dim \
        * element_bytes(config.params_dtype)
    layers, _, rerun = _layer_counts(config, pp_rank)
    return {"cp_send": ((3 * cp - 2) * layers + (cp - 1) * rerun) * kv}


def _moe_tokens(config, micro_batch_size: int) -> int:
    """T: the tokens one rank routes per micro-batch and MoE layer (s/cp · b, / tp under SP)."""
    t_sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return config.seq_length // config.context_parallel_size * micro_batch_size // t_sp


def alltoall_rows(config, micro_batch_size: int) -> dict:
    """Rows (tokens × experts) the alltoall dispatcher moves per MoE layer and micro-batch on one
    rank, with T tokens, k = top-k, E experts, L = E/ep local ones, C = ⌈T·k/E · factor⌉::

        padded to capacity   sent = received = E·C                        (exact)
        dropless             sent = T·k (exact); received: data-dependent, ≤ ep · T · min(k, L)
        capacity, no padding sent ≤ min(T·k, E·C); received ≤ ep · L · C   (both data-dependent)

    ``{"sent", "received", "received_max", "sent_exact", "padded"}``: ``sent`` the rows routed
    (or their bound), ``received`` its value under uniform routing, which is also the mean over
    the ep group (every row sent is received by one rank of it)."""
    from tpfuse.moe.routing import expert_capacity

    tokens, k = _moe_tokens(config, micro_batch_size), config.moe_router_topk
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    local = experts // ep
    factor = config.moe_expert_capacity_factor
    capacity = None if factor is None else expert_capacity(tokens, experts, k, factor)
    if capacity is not None and config.moe_pad_expert_input_to_capacity:
        rows = experts * capacity
        return {"sent": rows, "received": rows, "received_max": rows, "sent_exact": True,
                "padded": True}
    if capacity is None:
        return {"sent": tokens * k, "received": tokens * k,
                "received_max": ep * tokens * min(k, local), "sent_exact": True,
                "padded": False}
    sent = min(tokens * k, experts * capacity)
    return {"sent": sent, "received": sent, "received_max": ep * local * capacity,
            "sent_exact": False, "padded": False}


def _alltoall_bytes(config, micro_batch_size: int, moe_layers: int) -> tuple[dict, dict]:
    """(volume under uniform routing, ``{kind: (low, high)}`` of the routing-dependent kinds).

    Per MoE layer the dispatch all-to-all sends the rows this rank routes, the combine sends
    back the rows its experts received; backward swaps them. Without padding the split sizes
    are exchanged first: an all-gather of every ep rank's (E,) int64 counts (exact)."""
    rows = alltoall_rows(config, micro_batch_size)
    row_bytes = config.hidden_size * element_bytes(config.params_dtype)
    volume = {"ep_all_to_all": moe_layers * 2 * (rows["sent"] + rows["received"]) * row_bytes}
    if rows["padded"]:
        return volume, {}
    ep, experts = config.expert_model_parallel_size, config.num_moe_experts
    volume["ep_all_gather"] = moe_layers * ep * experts * 8
    low = moe_layers * 2 * rows["sent"] * row_bytes if rows["sent_exact"] else 0
    high = moe_layers * 2 * (rows["sent"] + rows["received_max"]) * row_bytes
    return volume, {"ep_all_to_all": (low, high)}


def _expert_parallel(config, micro_batch_size: int, pp_rank: int) -> tuple[dict, dict]:
    ep = config.expert_model_parallel_size
    _, moe_layers, _ = _layer_counts(config, pp_rank)
    if ep == 1 or moe_layers == 0:
        return {}, {}
    if config.moe_token_dispatcher_type == "alltoall":
        return _alltoall_bytes(config, micro_batch_size, moe_layers)
    tokens = _moe_tokens(config, micro_batch_size)
    h, experts = config.hidden_size, config.num_moe_experts
    e = element_bytes(config.params_dtype)
    return {"ep_all_gather": moe_layers * (2 * ep * tokens * h * e + ep * tokens * experts * 5),
            "ep_reduce_scatter": moe_layers * (2 * ep * tokens * h * e
                                               + ep * tokens * experts * 4)}, {}


def expert_parallel_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    """EP volume of one micro-batch on ``pp_rank`` (the alltoall dispatcher unpadded: under
    uniform routing, see ``expert_parallel_bounds``)."""
    return _expert_parallel(config, micro_batch_size, pp_rank)[0]


def expert_parallel_bounds(config, micro_batch_size: int, pp_rank: int) -> dict:
    """``{kind: (low, high)}`` of one micro-batch on ``pp_rank`` for the EP kinds that depend
    on the routing (the alltoall dispatcher without capacity padding); empty otherwise."""
    return _expert_parallel(config, micro_batch_size, pp_rank)[1]


def pipeline_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    """What ``pp_rank`` sends per micro-batch: activations forward, gradients backward."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    if pp == 1:
        return {}
    t_sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    s = config.seq_length // config.context_parallel_size // t_sp
    dtype = getattr(config, "pipeline_dtype", None) or config.params_dtype
    message = s * micro_batch_size * config.hidden_size * element_bytes(dtype)
    stages = pp * vpp
    sends = 0
    for chunk in range(vpp):
        stage = chunk * pp + pp_rank
        sends += (stage < stages - 1) + (stage > 0)
    return {"pp_send": sends * message}


def fsdp_bytes(config, layout, rank: int, strategy: str, num_microbatches: int) -> dict:
    """FSDP per step (``training/fsdp.py``): every unit sharded over n > 1 ranks all-gathers its
    padded parameters (n · ⌈rows/n⌉ rows each, in the compute dtype) in every micro-batch's
    forward, and again in its backward with ZeRO-3 (``optim_grads_params``: resharded after
    forward, the chunk's root unit included); every micro-batch's backward reduce-scatters the
    padded fp32 gradients. The tied embedding's fp32 gradient shard is all-reduced over the
    embedding group once per step (pp > 1)."""
    gathers = 2 if strategy == "optim_grads_params" else 1
    compute = element_bytes(config.params_dtype)
    volume = defaultdict(int)
    for unit in fsdp_units(config, layout, rank):
        size = len(layout.group_of(unit.group, rank)) if unit.group else 1
        if size == 1:
            continue
        numel = sum(padded_shard_numel(s.fsdp_shape, size) * size for s in unit.shapes)
        kind = "dp" if unit.group == "dp-cp" else "edp"
        volume[f"{kind}_param_all_gather"] += gathers * num_microbatches * numel * compute
        volume[f"{kind}_reduce_scatter"] += num_microbatches * numel * 4
    if _tied_across_stages(config, layout.rank_in("pp", rank)):
        rows = config.padded_vocab_size // config.tensor_model_parallel_size
        dp_cp = layout.group_of("dp-cp", rank)
        lo, hi = shard_rows(rows, len(dp_cp), dp_cp.index(rank))
        volume["embedding_all_reduce"] += (hi - lo) * config.hidden_size * 4
    return dict(volume)


def _tied_across_stages(config, pp_rank: int) -> bool:
    """This rank holds one end of the tied word embedding (first or last stage, pp > 1)."""
    pp = config.pipeline_model_parallel_size
    return (not config.untie_embeddings_and_output_weights and pp > 1
            and pp_rank in (0, pp - 1))


def data_parallel_bytes(config, layout, rank: int, buffers, backend: str) -> dict:
    """Per step: gradient reduction and (distributed optimizer) parameter all-gather."""
    param_bytes = element_bytes(config.params_dtype)
    grad_bytes = 4 if buffers.grad_reduce_in_fp32 else param_bytes
    reduce_op = ("reduce_scatter" if buffers.use_distributed_optimizer and backend == "nccl"
                 else "all_reduce")
    volume = defaultdict(int)
    for kind, plan, size, _ in buffer_plans(config, layout, rank, buffers):
        if size == 1:
            continue
        group = "dp" if kind == "dense" else "edp"
        volume[f"{group}_{reduce_op}"] += plan.numel * grad_bytes
        if buffers.use_distributed_optimizer:
            volume[f"{group}_param_all_gather"] += plan.numel * param_bytes
    if _tied_across_stages(config, layout.rank_in("pp", rank)):
        rows = config.padded_vocab_size // config.tensor_model_parallel_size
        volume["embedding_all_reduce"] += rows * config.hidden_size * grad_bytes
    return dict(volume)


def step_comm_bounds(config, layout, rank: int, micro_batch_size: int,
                     num_microbatches: int) -> dict:
    """``{"<group kind>_<op>": [low, high]}`` of one step on ``rank`` for the kinds whose bytes
    depend on where the router sends the tokens (``step_comm_bytes`` gives their value under
    uniform routing, the mean over the ep group); empty when every kind is exact."""
    bounds = expert_parallel_bounds(config, micro_batch_size, layout.rank_in("pp", rank))
    return {key: [int(low * num_microbatches), int(high * num_microbatches)]
            for key, (low, high) in bounds.items()}


def step_comm_bytes(config, layout, rank: int, buffers, micro_batch_size: int,
                    num_microbatches: int, backend: str = "nccl") -> dict:
    """``{"<group kind>_<op>": bytes}`` of one optimizer step on ``rank`` (zero kinds left
    out)."""
    pp_rank = layout.rank_in("pp", rank)
    volume = defaultdict(int)
    for part in (tensor_parallel_bytes, context_parallel_bytes, expert_parallel_bytes,
                 pipeline_bytes):
        for key, value in part(config, micro_batch_size, pp_rank).items():
            volume[key] += value * num_microbatches
    if buffers.fsdp_strategy is not None:
        data = fsdp_bytes(config, layout, rank, buffers.fsdp_strategy, num_microbatches)
    else:
        data = data_parallel_bytes(config, layout, rank, buffers, backend)
    for key, value in data.items():
        volume[key] += value
    return {key: int(value) for key, value in sorted(volume.items()) if value}
