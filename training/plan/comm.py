"""Communication volume of one optimizer step per rank, by group kind, for tpfuse-plan.

A collective's volume is its message as the caller passes it: the input of an all-reduce,
reduce-scatter or all-to-all, the gathered output of an all-gather, the tensor of a send (a
rank's receives are its peers' sends). Scalars (the grad norm, loss logs) are left out. With
``X = s·b·h·e`` (``s`` this rank's tokens seq_length/cp, ``e`` the activation element size) and
``m`` micro-batches per step, per micro-batch on a rank of tp = t > 1:

==========================  ================================================================
TP, no SP (all-reduce)      2X per attention block and per TP MLP (proj and fc2 forward, QKV
                            and fc1 input gradients), + X per block re-run by full or MLP
                            recompute; embedding X forward, output layer X backward;
                            cross-entropy 3·s·b·4 (max, sum-exp and target logit)
TP with SP                  per attention block and TP MLP all-gather 3X (QKV / fc1 input
                            forward, its re-gather for the weight gradient, the gradient of the
                            reduce-scatter) and reduce-scatter 2X; a re-run forward X of each;
                            + embedding X (its gradient) + learned positions X + output layer
                            2X all-gathered, embedding X + output layer X reduce-scattered;
                            all-reduce of the sequence-parallel parameters' gradients (norms,
                            row-parallel biases, MoE routers' (E, h) weights, shared-expert gates
                            (1, h)) in their dtype +
                            cross-entropy. The TP MLPs: a dense layer's MLP and an MoE layer's
                            shared expert; the routed experts talk over ep / etp (below)
CP ring (send)              (3·cp − 2)·KV per layer (the MTP layers' on the last stage too),
                            KV = 2·s·b·g/t·d·e (the K, V blocks forward (cp − 1 hops), again
                            in backward, their gradients cp hops)
MTP under CP                on the last stage, per MTP depth all-gather cp·2·b·(3·8 + 4): the
                            shift of the ids, positions, labels (int64) and loss mask (fp32)
                            gathers every cp rank's two chunk-first tokens
MoE, allgather dispatcher   per MoE layer over etp × ep (G ranks; the ``ep``, ``etp`` or
                            ``etp-ep`` kind): all-gather 2·G·T·h·e + G·T·E·(p + 1) (tokens
                            forward, output gradient backward; probabilities in the router
                            dtype, p bytes, and the uint8 routing map), reduce-scatter
                            2·G·T·h·e + G·T·E·p; T = s·b/t' tokens per rank
MoE, alltoall dispatcher    per MoE layer all-to-all over ep 2·(sent + received)·h·e (dispatch
                            and combine, both again in backward), ``alltoall_rows``: padded to
                            capacity sent = received = E·C, exact; dropless sent = T·k
                            (exact) and received depends on the routing: the plan gives
                            T·k (uniform routing, and the ep group's mean: the group's sum
                            is exact) and its [low, high] in ``step_comm_bounds``; exact
                            for a recorded routing (``dropless_alltoall_bytes``); over etp
                            (etp > 1) all-gather and reduce-scatter 2·etp·R·h·e each (R the
                            largest etp rank's received rows: E·C padded, else routing-
                            dependent, bounded); unpadded, the split counts' all-gather over
                            etp × ep G·E·8 (exact)
MoE experts' fc2 bias       all-reduce over etp (etp > 1) of its (E/ep, h) gradient
MoE router losses           over tp × cp, per MoE layer: ``aux_loss`` all-reduce E·8 (the top-k
                            counts), ``seq_aux_loss`` all-gather and reduce-scatter s·b·E·4
                            (the scores), when ``moe_aux_loss_coeff`` > 0
PP (send)                   X/t' per micro-batch and chunk with a next stage (activation) and
                            with a previous stage (gradient)
==========================  ================================================================

Per step: DP reduces every gradient buffer once (its padded bytes; a reduce-scatter with the
distributed optimizer on NCCL, an all-reduce otherwise, gloo included: its reduce-scatter is the
slower), the distributed optimizer all-gathers every parameter buffer; the tied word embedding's
gradient is all-reduced over the embedding group (first and last stage, pp > 1). Expert buffers
reduce over the expert-data group (``edp``), dense ones over dp·cp (``dp``). With
``--use-torch-fsdp2`` the buffers' traffic is replaced by FSDP's, per unit (``fsdp_bytes``): the
padded parameters all-gathered in the compute dtype once per step (ZeRO-2) or twice per
micro-batch (ZeRO-3, forward and backward; without a pipeline the root once per step, the
last layer once per micro-batch and the first once more), the padded fp32 gradients reduced
once per step (reduce-scattered on NCCL, all-reduced on gloo).

Hybrid sharding (``--num-distributed-optimizer-instances`` N > 1): the reduction and the
gathers above run inside one instance of s = n/N ranks (kinds ``intra-dp`` / ``intra-edp``:
the buffer or unit reduce-scattered and all-gathered over s ranks), and each rank's shard
(1/s of it) is all-reduced across the N instances once per step (``inter-dp`` / ``inter-edp``).

A forward re-run by recompute (full: the layer; selective ``mlp``: its MLP block, an MoE
layer's dispatch included) repeats the forward's collectives.

Every reduce-scatter above runs as ``--reduce-scatter-strategy`` says, resolved for the backend
by ``parallel.comm_options.resolve_reduce_scatter`` (the function the step's collectives use):
by default all-reduce + this rank's block on gloo, native on NCCL. Run as an all-reduce, a
reduce-scatter passes the same message (its whole input), so its bytes count as that kind's
all-reduce (``as_run``); FSDP on NCCL keeps FSDP2's own reduce-scatter.

Checked byte for byte against the collectives of a real step for TP (with and without SP, full
recompute), DP (plain, distributed optimizer, FSDP ZeRO-2 and ZeRO-3), PP and the tied
embedding, CP (cp = 2; cp = 4 with MTP), EP with the allgather dispatcher and with the alltoall
one padded to capacity, MoE layers under TP + SP (the allgather dispatcher over etp × ep, the
alltoall one's etp gathers, ep = 1, a gated shared expert, full and MLP recompute, both
load-balancing losses) (tests/training/test_plan.py);
the dropless alltoall dispatcher's all-to-all is checked within its per-rank bounds and
exactly in its sum over each ep group, and, given the step's recorded routing, exactly on every
rank (with MLP recompute, under TP + SP, and with tokens dropped at capacity).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tpfuse.models.layer_assignment import layers_for
from tpfuse.models.moe_config import moe_layer_pattern
from tpfuse.parallel.comm_options import resolve_reduce_scatter

from ..fsdp import gathers_per_step, keeps_seams, padded_shard_numel, shard_rows
from .memory import buffer_plans, element_bytes, fsdp_units, replica_group, shard_group


@dataclass(frozen=True)
class _Layers:
    """The layers of all chunks of one pipeline rank: dense and MoE ones, and how many of each
    re-run their forward in backward (full recompute: the whole layer; ``*_mlp_rerun``: the MLP
    block, by full recompute or the selective ``mlp`` module)."""
    dense: int
    moe: int
    dense_rerun: int
    moe_rerun: int
    dense_mlp_rerun: int
    moe_mlp_rerun: int

    @property
    def total(self) -> int:
        return self.dense + self.moe

    @property
    def rerun(self) -> int:
        return self.dense_rerun + self.moe_rerun


def _layer_counts(config, pp_rank: int) -> _Layers:
    vpp = config.virtual_pipeline_model_parallel_size
    pattern = moe_layer_pattern(config)
    mlp_recompute = (config.recompute_granularity == "selective"
                     and "mlp" in (config.recompute_modules or ()))
    counts = defaultdict(int)
    for chunk in range(vpp or 1):
        indices = layers_for(config, pp_rank, None if vpp is None else chunk)
        rerun = ()
        if config.recompute_granularity == "full":
            n = config.recompute_num_layers
            rerun = indices if config.recompute_method == "uniform" else indices[:n]
        for i in indices:
            kind = "moe" if pattern[i] else "dense"
            counts[kind] += 1
            counts[f"{kind}_rerun"] += i in rerun
            counts[f"{kind}_mlp_rerun"] += (i in rerun) or mlp_recompute
    return _Layers(**{f: counts[f] for f in ("dense", "moe", "dense_rerun", "moe_rerun",
                                            "dense_mlp_rerun", "moe_mlp_rerun")})


def _has_shared_expert(config) -> bool:
    return config.num_moe_experts is not None and \
        config.moe_shared_expert_intermediate_size is not None


def _tp_mlps(config, layers: _Layers) -> tuple[int, int]:
    """(dense TP MLPs, their forwards re-run): the dense layers' MLPs and the MoE layers'
    shared experts (a ParallelMLP on the same tokens)."""
    shared = _has_shared_expert(config)
    return (layers.dense + shared * layers.moe,
            layers.dense_mlp_rerun + shared * layers.moe_mlp_rerun)


def _sequence_parallel_params(config, pp_rank: int) -> int:
    """Elements whose gradient is all-reduced over TP under SP: norms, row-parallel biases (the
    attention projection's, the dense MLPs' fc2), the MoE routers' weights (E, h) and the
    shared experts' gates (1, h)."""
    h = config.hidden_size
    per_norm = h * (2 if config.normalization == "LayerNorm" else 1)
    layers = _layer_counts(config, pp_rank)
    mlps, _ = _tp_mlps(config, layers)
    biases = (layers.total + mlps) * h if config.add_bias_linear else 0
    total = layers.total * 2 * per_norm + biases
    if layers.moe:
        total += layers.moe * config.num_moe_experts * h
        if _has_shared_expert(config) and config.moe_shared_expert_gate:
            total += layers.moe * h                             # the shared expert's gate (1, h)
    if pp_rank == config.pipeline_model_parallel_size - 1:
        total += per_norm                                       # the final norm
    return total


def tensor_parallel_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    """TP volume of one micro-batch on ``pp_rank`` (its chunks together).

    Per layer the attention block moves 3X with SP (gathers; 2X reduce-scattered) and 2X
    all-reduced without; so does every dense TP MLP: a dense layer's MLP and an MoE layer's
    shared expert (an MoE layer's routed experts talk over their own groups, see
    ``expert_parallel_bytes``). A re-run forward adds X per block (attention, MLP)."""
    t = config.tensor_model_parallel_size
    if t == 1:
        return {}
    pp = config.pipeline_model_parallel_size
    e = element_bytes(config.params_dtype)
    s = config.seq_length // config.context_parallel_size
    x = s * micro_batch_size * config.hidden_size * e
    layers = _layer_counts(config, pp_rank)
    mlps, mlp_reruns = _tp_mlps(config, layers)
    first, last = pp_rank == 0, pp_rank == pp - 1        # chunk 0 of rank 0, last chunk of last
    cross_entropy = 3 * s * micro_batch_size * 4 if last else 0
    # forward and backward of every block, + the forwards re-run
    blocks = 2 * (layers.total + mlps) + layers.rerun + mlp_reruns
    if not config.sequence_parallel:
        reduce = blocks * x + (x if first else 0) + (x if last else 0) + cross_entropy
        return {"tp_all_reduce": reduce}
    positions = config.position_embedding_type == "learned_absolute"
    gather = (blocks + layers.total + mlps) * x       # + the re-gather for the weight gradient
    gather += (x + (x if positions else 0)) if first else 0
    gather += 2 * x if last else 0
    scatter = blocks * x + (x if first else 0) + (x if last else 0)
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
    layers = _layer_counts(config, pp_rank)
    mtp = (config.mtp_num_layers or 0) if pp_rank == config.pipeline_model_parallel_size - 1 \
        else 0
    return {"cp_send": ((3 * cp - 2) * (layers.total + mtp) + (cp - 1) * layers.rerun) * kv}


def mtp_context_parallel_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    """The MTP token shift under cp (``parallel/context_sequence.py``), on the last stage: per
    depth one all-gather of the (2, b) chunk-first tokens of each rolled tensor."""
    cp = config.context_parallel_size
    if cp == 1 or not config.mtp_num_layers \
            or pp_rank != config.pipeline_model_parallel_size - 1:
        return {}
    return {"cp_all_gather": config.mtp_num_layers * cp * 2 * micro_batch_size * (3 * 8 + 4)}


def _moe_tokens(config, micro_batch_size: int) -> int:
    """T: the tokens one rank routes per micro-batch and MoE layer (s/cp · b, / tp under SP)."""
    t_sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return config.seq_length // config.context_parallel_size * micro_batch_size // t_sp


def _expert_tensor_size(config) -> int:
    return config.expert_tensor_parallel_size or config.tensor_model_parallel_size


def expert_group_kind(config) -> str:
    """The kind of the group the allgather dispatcher and the split counts use (etp × ep): the
    ep group when etp = 1, the etp group when ep = 1, else ``etp-ep``."""
    etp, ep = _expert_tensor_size(config), config.expert_model_parallel_size
    return "ep" if etp == 1 else "etp" if ep == 1 else "etp-ep"


def _router_prob_bytes(config) -> int:
    """The probabilities are in the router's dtype (the tokens' dtype unless set)."""
    return {"fp32": 4, "fp64": 8}.get(config.moe_router_dtype,
                                      element_bytes(config.params_dtype))


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


def as_run(key: str, reduce_scatter: str) -> str:
    """The kind ``key`` ("<group>_<op>") is counted under when reduce-scatters run as
    ``reduce_scatter`` ("native" or "all_reduce"): "<group>_all_reduce" for a reduce-scatter
    run as an all-reduce (the same message), else ``key``."""
    if reduce_scatter == "all_reduce" and key.endswith("_reduce_scatter"):
        return key[:-len("_reduce_scatter")] + "_all_reduce"
    return key


class _Volume:
    """Bytes by kind, each a value with its ``[low, high]`` (equal where exact); the kinds as
    reduce-scatters run (``as_run``)."""

    def __init__(self, reduce_scatter: str = "native"):
        self.value, self.low, self.high = defaultdict(int), defaultdict(int), defaultdict(int)
        self.reduce_scatter = reduce_scatter

    def add(self, key: str, value, low=None, high=None) -> None:
        key = as_run(key, self.reduce_scatter)
        self.value[key] += value
        self.low[key] += value if low is None else low
        self.high[key] += value if high is None else high

    def result(self) -> tuple[dict, dict]:
        bounds = {key: (self.low[key], self.high[key]) for key in self.value
                  if (self.low[key], self.high[key]) != (self.value[key], self.value[key])}
        return {key: v for key, v in self.value.items() if v}, bounds


def _allgather_dispatcher(config, micro_batch_size: int, layers: _Layers, volume) -> None:
    """Per MoE layer over etp × ep (G ranks), T tokens: forward all-gathers the tokens
    (G·T·h·e), probabilities (G·T·E·p) and routing map (G·T·E, uint8) and reduce-scatters the
    combined rows (G·T·h·e); backward reduce-scatters the tokens' and probabilities'
    gradients and all-gathers the output's. A re-run forward repeats the forward's."""
    group = _expert_tensor_size(config) * config.expert_model_parallel_size
    tokens, h, experts = _moe_tokens(config, micro_batch_size), config.hidden_size, \
        config.num_moe_experts
    rows = group * tokens * h * element_bytes(config.params_dtype)
    probs = group * tokens * experts * _router_prob_bytes(config)
    kind = expert_group_kind(config)
    gather_forward, scatter_forward = rows + probs + group * tokens * experts, rows
    volume.add(f"{kind}_all_gather", layers.moe * (gather_forward + rows)
               + layers.moe_mlp_rerun * gather_forward)
    volume.add(f"{kind}_reduce_scatter", layers.moe * (scatter_forward + rows + probs)
               + layers.moe_mlp_rerun * scatter_forward)


def _alltoall_dispatcher(config, micro_batch_size: int, layers: _Layers, volume,
                         routed: bool = True) -> None:
    """Per MoE layer: the dispatch all-to-all over ep sends the rows this rank routes, the
    combine sends back the rows its experts received (backward swaps them); over etp the
    received rows are all-gathered (each etp rank's block padded to the largest, R rows:
    etp·R·h·e) and the combine reduce-scatters them, both again in backward. Without padding
    the split sizes are exchanged first: an all-gather of every etp × ep rank's (E,) int64
    counts (exact). A re-run forward repeats the forward's. ``routed`` False: only the counts'
    all-gather (the rows' collectives come from a recorded routing, ``dropless_alltoall_bytes``)."""
    rows = alltoall_rows(config, micro_batch_size)
    row_bytes = config.hidden_size * element_bytes(config.params_dtype)
    ep, etp = config.expert_model_parallel_size, _expert_tensor_size(config)
    passes = 2 * layers.moe + layers.moe_mlp_rerun            # forward, backward, re-runs
    if ep > 1 and routed:
        low = rows["sent"] if rows["sent_exact"] else 0
        volume.add("ep_all_to_all", passes * (rows["sent"] + rows["received"]) * row_bytes,
                   passes * low * row_bytes,
                   passes * (rows["sent"] + rows["received_max"]) * row_bytes)
    if etp > 1 and routed:
        gathered = etp * row_bytes
        low = rows["received"] if rows["padded"] else 0
        for op in ("all_gather", "reduce_scatter"):
            volume.add(f"etp_{op}", passes * rows["received"] * gathered,
                       passes * low * gathered, passes * rows["received_max"] * gathered)
    if not rows["padded"]:
        forwards = layers.moe + layers.moe_mlp_rerun
        volume.add(f"{expert_group_kind(config)}_all_gather",
                   forwards * etp * ep * config.num_moe_experts * 8)


def _expert_parallel(config, micro_batch_size: int, pp_rank: int,
                     reduce_scatter: str = "native", routed: bool = True) -> tuple[dict, dict]:
    layers = _layer_counts(config, pp_rank)
    etp = _expert_tensor_size(config)
    if layers.moe == 0 or etp * config.expert_model_parallel_size == 1:
        return {}, {}
    volume = _Volume(reduce_scatter)
    if config.moe_token_dispatcher_type == "alltoall":
        _alltoall_dispatcher(config, micro_batch_size, layers, volume, routed)
    else:
        _allgather_dispatcher(config, micro_batch_size, layers, volume)
    if etp > 1 and config.add_bias_linear:       # fc2's bias enters through copy over etp
        local = config.num_moe_experts // config.expert_model_parallel_size
        volume.add("etp_all_reduce", layers.moe * local * config.hidden_size
                   * element_bytes(config.params_dtype))
    return volume.result()


def router_loss_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    """The load-balancing loss's statistics over the sequence partition group (tp × cp, when
    it has more than one rank and ``moe_aux_loss_coeff`` > 0), once per MoE layer and
    micro-batch (a recomputed layer computes its losses only in the re-run): ``aux_loss``
    all-reduces the (E,) int64 top-k counts; ``seq_aux_loss`` all-gathers the scores of the
    whole sequence (s·b·E, fp32 or the fp64 router dtype) and reduce-scatters their gradient."""
    partition = config.tensor_model_parallel_size * config.context_parallel_size
    kind = config.moe_router_load_balancing_type
    if partition == 1 or not config.moe_aux_loss_coeff or kind == "none":
        return {}
    layers = _layer_counts(config, pp_rank)
    if layers.moe == 0:
        return {}
    group = "tp" if config.context_parallel_size == 1 else "tp-cp"
    if kind == "aux_loss":
        return {f"{group}_all_reduce": layers.moe * config.num_moe_experts * 8}
    scores = config.seq_length * micro_batch_size * config.num_moe_experts \
        * (8 if config.moe_router_dtype == "fp64" else 4)
    return {f"{group}_all_gather": layers.moe * scores,
            f"{group}_reduce_scatter": layers.moe * scores}


def expert_parallel_bytes(config, micro_batch_size: int, pp_rank: int) -> dict:
    """The routed experts' volume of one micro-batch on ``pp_rank``: the dispatcher's
    collectives over ep, etp and etp × ep, and the etp all-reduce of the experts' fc2 bias
    gradient (the alltoall dispatcher unpadded: under uniform routing, see
    ``expert_parallel_bounds``)."""
    return _expert_parallel(config, micro_batch_size, pp_rank)[0]


def expert_parallel_bounds(config, micro_batch_size: int, pp_rank: int,
                           reduce_scatter: str = "native") -> dict:
    """``{kind: (low, high)}`` of one micro-batch on ``pp_rank`` for the EP kinds that depend
    on the routing (the alltoall dispatcher without capacity padding); empty otherwise. The
    kinds as reduce-scatters run (``reduce_scatter``: "native" or "all_reduce", ``as_run``)."""
    return _expert_parallel(config, micro_batch_size, pp_rank, reduce_scatter)[1]


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


def _kind(group: str, instances: int, where: str = "intra") -> str:
    """The plan's name of the reduce group ``group`` ("dp-cp" → "dp", "edp"), with N > 1
    instances that of its ``where`` ("intra" / "inter") part."""
    kind = "dp" if group == "dp-cp" else "edp"
    return kind if instances == 1 else f"{where}-{kind}"


def fsdp_bytes(config, layout, rank: int, strategy: str, num_microbatches: int,
               backend: str = "nccl", reduce_scatter: str = "auto", instances: int = 1) -> dict:
    """FSDP per step (``training/fsdp.py``): every unit sharded over n > 1 ranks all-gathers its
    padded parameters (n · ⌈rows/n⌉ rows each, in the compute dtype) once per step with ZeRO-2
    (kept over the micro-batches), in every micro-batch's forward and backward with ZeRO-3
    (``optim_grads_params``: resharded after each), less what its seams keep without a pipeline
    (``fsdp.gathers_per_step``: the root once, the last layer m times, the first m + 1); the
    padded fp32 gradients, accumulated over the micro-batches, are reduced once, in the last
    backward (a reduce-scatter on NCCL; on gloo as ``reduce_scatter`` resolves, by default an
    all-reduce). The tied embedding's fp32 gradient shard is all-reduced over the embedding
    group once per step (pp > 1). With N > 1 ``instances`` all of that runs over the unit's
    instance, and its padded fp32 gradient shard is all-reduced across the instances."""
    seams = keeps_seams(strategy, config.pipeline_model_parallel_size)
    host = "native" if backend == "nccl" else resolve_reduce_scatter(reduce_scatter, backend)
    reduce_op = "reduce_scatter" if host == "native" else "all_reduce"
    compute = element_bytes(config.params_dtype)
    volume = defaultdict(int)
    for unit in fsdp_units(config, layout, rank):
        if unit.group is None:
            continue
        size = len(shard_group(layout, unit.group, rank, instances))
        replicas = len(replica_group(layout, unit.group, rank, instances))
        numel = sum(padded_shard_numel(s.fsdp_shape, size) * size for s in unit.shapes)
        if replicas > 1:
            volume[f"{_kind(unit.group, instances, 'inter')}_all_reduce"] += numel // size * 4
        if size == 1:
            continue
        kind = _kind(unit.group, instances)
        gathers = gathers_per_step(
            strategy, num_microbatches,
            kept_after_forward=seams and (unit.last_layer or unit.root),
            kept_after_backward=seams and (unit.first_layer or unit.root))
        volume[f"{kind}_param_all_gather"] += gathers * numel * compute
        volume[f"{kind}_{reduce_op}"] += numel * 4
    if _tied_across_stages(config, layout.rank_in("pp", rank)):
        rows = config.padded_vocab_size // config.tensor_model_parallel_size
        dp_cp = shard_group(layout, "dp-cp", rank, instances)
        lo, hi = shard_rows(rows, len(dp_cp), dp_cp.index(rank))
        volume["embedding_all_reduce"] += (hi - lo) * config.hidden_size * 4
    return dict(volume)


def _tied_across_stages(config, pp_rank: int) -> bool:
    """This rank holds one end of the tied word embedding (first or last stage, pp > 1)."""
    pp = config.pipeline_model_parallel_size
    return (not config.untie_embeddings_and_output_weights and pp > 1
            and pp_rank in (0, pp - 1))


def data_parallel_bytes(config, layout, rank: int, buffers, backend: str,
                        reduce_scatter: str = "auto") -> dict:
    """Per step: gradient reduction (the distributed optimizer's reduce-scatter as
    ``reduce_scatter`` resolves for ``backend``) and (distributed optimizer) parameter
    all-gather; with N > 1 instances (``buffers.instances``) both inside the instance, then each
    bucket's shard all-reduced across the instances."""
    param_bytes = element_bytes(config.params_dtype)
    grad_bytes = 4 if buffers.grad_reduce_in_fp32 else param_bytes
    native = resolve_reduce_scatter(reduce_scatter, backend) == "native"
    reduce_op = "reduce_scatter" if buffers.use_distributed_optimizer and native else "all_reduce"
    volume = defaultdict(int)
    instances = buffers.instances if buffers.use_distributed_optimizer else 1
    for kind, plan, size, _ in buffer_plans(config, layout, rank, buffers):
        base = "dp-cp" if kind == "dense" else "edp"
        if len(replica_group(layout, base, rank, instances)) > 1:
            volume[f"{_kind(base, instances, 'inter')}_all_reduce"] += \
                plan.numel // size * grad_bytes
        if size == 1:
            continue
        group = _kind(base, instances)
        volume[f"{group}_{reduce_op}"] += plan.numel * grad_bytes
        if buffers.use_distributed_optimizer:
            volume[f"{group}_param_all_gather"] += plan.numel * param_bytes
    if _tied_across_stages(config, layout.rank_in("pp", rank)):
        rows = config.padded_vocab_size // config.tensor_model_parallel_size
        volume["embedding_all_reduce"] += rows * config.hidden_size * grad_bytes
    return dict(volume)


def dropless_alltoall_bytes(config, layout, rank: int, dispatches) -> dict:
    """The alltoall dispatcher's routing-dependent collectives of one step on ``rank``, exact for
    a recorded routing: ``dispatches`` are the step's ``moe.dispatcher.DispatchRecord`` on this
    rank (its dispatchers' ``routing_log``), ``counts[p][e]`` the rows etp × ep member p sent to
    expert e. With this rank at (etp q, ep r), L = E/ep experts from r·L and
    ``R_q' = Σ_r' Σ_{e local} counts[(q', r')][e]`` the rows etp rank q' receives, one dispatch
    moves, per direction (forward, and backward again when it built the graph)::

        ep all-to-all                   (Σ_e counts[(q, r)][e] + R_q) · h · e
        etp all-gather, reduce-scatter  etp · max_q' R_q' · h · e each (blocks padded to the largest)
    """
    ep, etp = config.expert_model_parallel_size, _expert_tensor_size(config)
    local = config.num_moe_experts // ep
    row_bytes = config.hidden_size * element_bytes(config.params_dtype)
    members = layout.group_of("etp-ep", rank)
    position = {(layout.coords(m)["etp"], layout.coords(m)["ep"]): p
                for p, m in enumerate(members)}
    q, r = layout.coords(rank)["etp"], layout.coords(rank)["ep"]
    mine = slice(r * local, (r + 1) * local)
    volume = defaultdict(int)
    for record in dispatches:
        received = [sum(sum(record.counts[position[(q2, r2)]][mine]) for r2 in range(ep))
                    for q2 in range(etp)]
        directions = 2 if record.builds_graph else 1
        if ep > 1:
            sent = sum(record.counts[position[(q, r)]])
            volume["ep_all_to_all"] += directions * (sent + received[q]) * row_bytes
        if etp > 1:
            for op in ("all_gather", "reduce_scatter"):
                volume[f"etp_{op}"] += directions * etp * max(received) * row_bytes
    return dict(volume)


def step_comm_bounds(config, layout, rank: int, micro_batch_size: int,
                     num_microbatches: int, backend: str = "nccl",
                     reduce_scatter: str = "auto") -> dict:
    """``{"<group kind>_<op>": [low, high]}`` of one step on ``rank`` for the kinds whose bytes
    depend on where the router sends the tokens (``step_comm_bytes`` gives their value under
    uniform routing, the mean over the ep group); empty when every kind is exact."""
    bounds = expert_parallel_bounds(config, micro_batch_size, layout.rank_in("pp", rank),
                                    resolve_reduce_scatter(reduce_scatter, backend))
    return {key: [int(low * num_microbatches), int(high * num_microbatches)]
            for key, (low, high) in bounds.items()}


def step_comm_bytes(config, layout, rank: int, buffers, micro_batch_size: int,
                    num_microbatches: int, backend: str = "nccl",
                    reduce_scatter: str = "auto", routing=None) -> dict:
    """``{"<group kind>_<op>": bytes}`` of one optimizer step on ``rank`` (zero kinds left
    out); ``reduce_scatter``: the ``--reduce-scatter-strategy``; ``routing``: the step's
    recorded dispatches on ``rank`` (``dropless_alltoall_bytes``), which make the unpadded
    alltoall dispatcher's volume exact (without: its value under uniform routing)."""
    pp_rank = layout.rank_in("pp", rank)
    run_as = resolve_reduce_scatter(reduce_scatter, backend)
    routed = routing is None or config.moe_token_dispatcher_type != "alltoall" \
        or config.moe_pad_expert_input_to_capacity

    def experts(config, micro_batch_size, pp_rank):
        return _expert_parallel(config, micro_batch_size, pp_rank, routed=routed)[0]

    volume = defaultdict(int)
    for part in (tensor_parallel_bytes, context_parallel_bytes, mtp_context_parallel_bytes,
                 experts, router_loss_bytes, pipeline_bytes):
        for key, value in part(config, micro_batch_size, pp_rank).items():
            volume[as_run(key, run_as)] += value * num_microbatches
    if not routed:
        for key, value in dropless_alltoall_bytes(config, layout, rank, routing).items():
            volume[as_run(key, run_as)] += value
    if buffers.fsdp_strategy is not None:
        data = fsdp_bytes(config, layout, rank, buffers.fsdp_strategy, num_microbatches,
                          backend, reduce_scatter, buffers.instances)
    else:
        data = data_parallel_bytes(config, layout, rank, buffers, backend, reduce_scatter)
    for key, value in data.items():
        volume[key] += value
    return {key: int(value) for key, value in sorted(volume.items()) if value}
