"""The memory and communication of a layout, per rank, from the flags alone (``tpfuse-plan``).

Nothing is built: no model, no process group. What a rank holds follows from the config, the
rank's coordinates in the ``RankLayout`` and the trainer's settings, computed the way the trainer
lays it out:

- **parameters, main parameters, gradients, optimizer state**: the chunk's parameters in the
  modules' registration order (``parameter_shapes``, one entry per ``nn.Parameter`` of the
  GPTModel chunk, the tied output weight once where it is the embedding's Parameter), grouped
  into the gradient buffers as ``training/data_parallel.py`` groups them (dense over dp·cp,
  expert over the expert-data group; one buffer per (param dtype, grad dtype)), laid out by the
  trainer's own ``grad_buffers.plan_buffer`` (64-element parameter alignment and lcm(dp, 128)
  bucket padding with the distributed optimizer). Then, as ``MixedPrecisionOptimizer.memory_bytes``
  counts them::

      parameters       Σ param numel · es            (distributed: the padded param buffers)
      gradients        Σ padded grad buffer · es_grad
      main_parameters  elements this rank updates · 4 when the params are not fp32, else 0
      optimizer_state  elements this rank updates · b, b per element (``state_bytes``): 8 for
                       Adam's two fp32 moments, 4 for one fp32 momentum buffer (SGD with
                       --sgd-momentum > 0, Muon's matrices), 0 for SGD without momentum

  where "elements this rank updates" is every parameter element, or with the distributed
  optimizer the parameters' intersection with this rank's shard of every bucket.
- **activations** at the schedule's peak: ``activations.py``.
- **communication** per optimizer step, by group kind: ``comm.py``.

With ``--use-torch-fsdp2`` (``training/fsdp.py``) there are no buffers: FSDP units (one per
transformer layer, the layer's expert parameters one over the expert-data group when edp > 1 and
unsharded otherwise, the chunk's remaining parameters one) hold every parameter's fp32 shard of
⌈rows/n⌉ rows over their group of n ranks, so (``fsdp_rank_bytes`` over each unit group)::

    parameters = gradients   Σ ⌈rows/n⌉ · (numel/rows) · 4     (the padded shards)
    main_parameters          0                                  (the shards are the main copy)
    optimizer_state          Σ (this rank's rows of the torch.chunk split) · (numel/rows) · b

the moments being made for the unpadded shards (``FullyShardedOptimizer.memory_bytes``).

Hybrid sharding (``--num-distributed-optimizer-instances`` N > 1, the distributed optimizer or
FSDP2): the shard group is one instance, ``intra-dp-cp`` / ``intra-edp`` of dp·cp/N and edp/N
ranks (``shard_group``), so every formula above holds with n the instance's size: a rank holds
1/(n/N) of what one process would, and the instances hold the same shards.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpfuse.models.layer_assignment import layers_for
from tpfuse.models.moe_config import is_moe_layer, moe_layer_pattern
from tpfuse.parallel.layout import RankLayout, instance_group_of

from ..fsdp import fsdp_rank_bytes, shard_rows
from ..grad_buffers import plan_buffer

MEMORY_KINDS = ("parameters", "main_parameters", "gradients", "optimizer_state")
DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


@dataclass(frozen=True)
class ParamShape:
    """One ``nn.Parameter`` of a chunk: its element count, whether it is an expert parameter
    (reduced over the expert-data group), whether it is the tied embedding copy of the last
    stage (a bucket of its own with the distributed optimizer) and its dim-0 size (what FSDP
    cuts into row blocks; 0: a 1-D parameter, ``numel`` rows)."""
    name: str
    numel: int
    expert: bool = False
    tied_copy: bool = False
    dim0: int = 0
    matrix: bool = False        # a 2-D weight of a linear map (Muon's, training/muon.py)

    @property
    def rows(self) -> int:
        return self.dim0 or self.numel

    @property
    def fsdp_shape(self) -> tuple:
        """(dim 0, the rest flattened): the shape FSDP's row split sees."""
        return (self.rows, self.numel // self.rows)


def element_bytes(dtype) -> int:
    return DTYPE_BYTES[str(dtype)]


def layout_of(config, world_size: int) -> RankLayout:
    """The RankLayout of the config's sizes over ``world_size`` ranks (its checks included)."""
    return RankLayout(world_size, tp=config.tensor_model_parallel_size,
                      pp=config.pipeline_model_parallel_size,
                      cp=config.context_parallel_size, ep=config.expert_model_parallel_size,
                      etp=config.expert_tensor_parallel_size)


# -------------------------------------------------------------------- parameters of a chunk
def _norm(prefix: str, config, size: int | None = None) -> list:
    """A norm's weight (and LayerNorm's bias) of ``size`` elements (default: hidden_size)."""
    h = config.hidden_size if size is None else size
    shapes = [ParamShape(f"{prefix}.weight", h)]
    if config.normalization == "LayerNorm":
        shapes.append(ParamShape(f"{prefix}.bias", h))
    return shapes


def _linear(prefix: str, rows: int, cols: int, bias_numel: int | None, expert=False) -> list:
    shapes = [ParamShape(f"{prefix}.weight", rows * cols, expert, dim0=rows, matrix=True)]
    if bias_numel is not None:
        shapes.append(ParamShape(f"{prefix}.bias", bias_numel, expert))
    return shapes


def _dense_mlp(prefix: str, config, ffn: int, tp: int) -> list:
    h, bias = config.hidden_size, config.add_bias_linear
    fc1_rows = (2 if config.activation == "swiglu" else 1) * ffn // tp
    return (_linear(f"{prefix}.linear_fc1", fc1_rows, h, fc1_rows if bias else None)
            + _linear(f"{prefix}.linear_fc2", h, ffn // tp, h if bias else None))


def _moe_mlp(prefix: str, config, ep: int, etp: int, tp: int) -> list:
    """Router (E, h), then the local experts' weight1 (E/ep, h, k·F/etp), weight2
    (E/ep, F/etp, h), their biases, then the shared experts (a dense MLP over tp)."""
    h, experts = config.hidden_size, config.num_moe_experts
    local, ffn = experts // ep, config.moe_ffn_hidden_size
    stride = 2 if config.activation == "swiglu" else 1
    shapes = [ParamShape(f"{prefix}.router.weight", experts * h, dim0=experts, matrix=True)]
    shapes += [ParamShape(f"{prefix}.experts.weight1", local * h * stride * ffn // etp, True,
                          dim0=local),
               ParamShape(f"{prefix}.experts.weight2", local * ffn // etp * h, True, dim0=local)]
    if config.add_bias_linear:
        shapes += [ParamShape(f"{prefix}.experts.bias1", local * stride * ffn // etp, True,
                              dim0=local),
                   ParamShape(f"{prefix}.experts.bias2", local * h, True, dim0=local)]
    if config.moe_shared_expert_intermediate_size is not None:
        if config.moe_shared_expert_gate:            # its own parameter, before its linears'
            shapes.append(ParamShape(f"{prefix}.shared_experts.gate_weight", h, dim0=1,
                                     matrix=True))        # (1, h)
        shapes += _dense_mlp(f"{prefix}.shared_experts", config,
                             config.moe_shared_expert_intermediate_size, tp)
    return shapes


def _mla_attention(prefix: str, config, tp: int) -> list:
    """MultiLatentAttention's parameters in registration order: linear_proj (row-parallel),
    the query projection (column-parallel) or the replicated q down and column-parallel q up
    projections, the replicated kv down and column-parallel kv up projections, then the q / kv
    latent norms (--qk-layernorm)."""
    h, heads, rq = config.hidden_size, config.num_attention_heads, config.q_lora_rank
    q_rows = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim) // tp
    shapes = _linear(f"{prefix}.linear_proj", h, heads * config.v_head_dim // tp,
                     h if config.add_bias_linear else None)
    if rq is None:
        shapes += _linear(f"{prefix}.linear_q_proj", q_rows, h, None)
    else:
        shapes += _linear(f"{prefix}.linear_q_down_proj", rq, h, None)
        shapes += _linear(f"{prefix}.linear_q_up_proj", q_rows, rq, None)
    shapes += _linear(f"{prefix}.linear_kv_down_proj",
                      config.kv_lora_rank + config.qk_pos_emb_head_dim, h, None)
    shapes += _linear(f"{prefix}.linear_kv_up_proj",
                      heads * (config.qk_head_dim + config.v_head_dim) // tp,
                      config.kv_lora_rank, None)
    if config.qk_layernorm:
        if rq is not None:
            shapes += _norm(f"{prefix}.q_layernorm", config, rq)
        shapes += _norm(f"{prefix}.kv_layernorm", config, config.kv_lora_rank)
    return shapes


def layer_shapes(config, index: int) -> list:
    """The parameters of global layer ``index`` on one rank, in registration order."""
    h, tp, bias = config.hidden_size, config.tensor_model_parallel_size, config.add_bias_linear
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = h // heads
    qkv_rows = (heads + 2 * groups) * head_dim // tp
    prefix = f"layers.{index}"
    shapes = _norm(f"{prefix}.input_norm", config)
    if config.multi_latent_attention:
        shapes += _mla_attention(f"{prefix}.self_attention", config, tp)
    else:
        shapes += _linear(f"{prefix}.self_attention.linear_qkv", qkv_rows, h,
                          qkv_rows if bias else None)
        shapes += _linear(f"{prefix}.self_attention.linear_proj", h, heads * head_dim // tp,
                          h if bias else None)
    if config.qk_layernorm and not config.multi_latent_attention:                     # one (d,) norm for q, one for k, replicated
        shapes += _norm(f"{prefix}.self_attention.q_layernorm", config, head_dim)
        shapes += _norm(f"{prefix}.self_attention.k_layernorm", config, head_dim)
    shapes += _norm(f"{prefix}.pre_mlp_norm", config)
    if is_moe_layer(config, index):        # an MTP layer: the last decoder layer's kind
        etp = config.expert_tensor_parallel_size or tp
        shapes += _moe_mlp(f"{prefix}.mlp", config, config.expert_model_parallel_size, etp, tp)
    else:
        shapes += _dense_mlp(f"{prefix}.mlp", config, config.ffn_hidden_size, tp)
    return shapes


def chunk_shapes(config, pp_rank: int, chunk: int) -> list:
    """Every trainable parameter of model chunk ``chunk`` of pipeline rank ``pp_rank`` (the
    GPTModel's registration order: embedding, layers, final norm, output layer)."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    tp, h = config.tensor_model_parallel_size, config.hidden_size
    pre = pp_rank == 0 and chunk == 0
    post = pp_rank == pp - 1 and chunk == (vpp or 1) - 1
    vocab_rows = config.padded_vocab_size // tp
    shapes = []
    if pre:
        shapes.append(ParamShape("embedding.word_embeddings.weight", vocab_rows * h,
                                 dim0=vocab_rows))
        if config.position_embedding_type == "learned_absolute":
            shapes.append(ParamShape("embedding.position_embeddings.weight",
                                     config.max_position_embeddings * h,
                                     dim0=config.max_position_embeddings))
    for index in layers_for(config, pp_rank, None if vpp is None else chunk):
        shapes += layer_shapes(config, index)
    if post:
        shapes += _norm("final_norm", config)
        tied = not config.untie_embeddings_and_output_weights
        if not (tied and pre):                  # tied on one chunk: the embedding's Parameter
            shapes.append(ParamShape("output_layer.weight", vocab_rows * h,
                                     tied_copy=tied, dim0=vocab_rows))
        shapes += mtp_shapes(config, pre)
    return shapes


def mtp_shapes(config, pre: bool) -> list:
    """The MTP block of the chunk with the output layer (``models/multi_token_prediction.py``):
    per depth enorm, hnorm, eh_proj (h/tp × 2h, no bias), the transformer layer (global layer
    num_layers + depth), final_layernorm; then, on a chunk without the embedding, the untied
    word-embedding copy the MTP layers read (tied: the output layer's Parameter itself)."""
    tp, h = config.tensor_model_parallel_size, config.hidden_size
    shapes = []
    for depth in range(config.mtp_num_layers or 0):
        prefix = f"mtp.layers.{depth}"
        shapes += _norm(f"{prefix}.enorm", config) + _norm(f"{prefix}.hnorm", config)
        shapes += _linear(f"{prefix}.eh_proj", h // tp, 2 * h, None)
        layer = config.num_layers + depth
        shapes += [dataclasses.replace(shape, name=shape.name.replace(
            f"layers.{layer}.", f"{prefix}.transformer_layer.", 1))
            for shape in layer_shapes(config, layer)]
        shapes += _norm(f"{prefix}.final_layernorm", config)
    if config.mtp_num_layers and not pre and config.untie_embeddings_and_output_weights:
        vocab_rows = config.padded_vocab_size // tp
        shapes.append(ParamShape("mtp_embedding.word_embeddings.weight", vocab_rows * h,
                                 tied_copy=True, dim0=vocab_rows))
    return shapes


def rank_shapes(config, pp_rank: int) -> list:
    """The trainable parameters of every chunk of pipeline rank ``pp_rank``, chunk order."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    return [shape for chunk in range(vpp) for shape in chunk_shapes(config, pp_rank, chunk)]


def _tied_embedding_bucket(config, pp_rank: int, shape: ParamShape) -> bool:
    """The word embedding gets a bucket of its own on both ends of a pipeline (tied, or untied
    with the MTP layers' copy on the last stage; pp > 1)."""
    untied = config.untie_embeddings_and_output_weights and not config.mtp_num_layers
    if untied or config.pipeline_model_parallel_size == 1:
        return False
    return shape.tied_copy or shape.name == "embedding.word_embeddings.weight"


# -------------------------------------------------------------------- the four static kinds
@dataclass(frozen=True)
class BufferSettings:
    """What decides the buffers' layout (``training/precision_args.ddp_config_from_settings``)."""
    grad_reduce_in_fp32: bool
    use_distributed_optimizer: bool
    bucket_size: int | None          # None: one bucket per buffer
    fsdp_strategy: str | None = None  # --use-torch-fsdp2's optim_grads | optim_grads_params
    optimizer: str = "adam"          # --optimizer (the optimizer state's bytes per element)
    sgd_momentum: float = 0.9
    instances: int = 1               # --num-distributed-optimizer-instances


def state_bytes(shape: ParamShape, buffers: BufferSettings) -> int:
    """Optimizer-state bytes per element of ``shape`` this rank updates (module docstring)."""
    if buffers.optimizer == "sgd":
        return 4 if buffers.sgd_momentum else 0
    if buffers.optimizer == "muon" and shape.matrix:
        return 4
    return 8


def buffer_settings(config, settings, dp_cp: int) -> BufferSettings:
    from ..precision_args import ddp_config_from_settings

    optimizer = dict(optimizer=settings.optimizer.optimizer,
                     sgd_momentum=settings.optimizer.sgd_momentum,
                     instances=settings.data_parallel.num_distributed_optimizer_instances)
    if settings.data_parallel.use_torch_fsdp2:      # fp32 shards and an fp32 reduce
        return BufferSettings(True, False, None, settings.data_parallel.fsdp_strategy,
                              **optimizer)
    ddp = ddp_config_from_settings(settings.precision, settings.data_parallel, config)
    bucket = ddp.bucket_size or max(40_000_000, 1_000_000 * dp_cp)
    return BufferSettings(ddp.grad_reduce_in_fp32, ddp.use_distributed_optimizer,
                          bucket if ddp.overlap_grad_reduce else None, **optimizer)


def shard_group(layout: RankLayout, group: str, rank: int, instances: int = 1) -> list:
    """The ranks ``rank`` shards ``group``'s parameters over (``"dp-cp"`` or ``"edp"``): the
    group itself, or its instance with N > 1 (``intra-<group>``)."""
    if instances == 1:
        return layout.group_of(group, rank)
    return instance_group_of(layout, f"intra-{group}", instances, rank)


def replica_group(layout: RankLayout, group: str, rank: int, instances: int = 1) -> list:
    """The ranks holding ``rank``'s shard in the other instances (``inter-<group>``; the rank
    alone when N = 1)."""
    if instances == 1:
        return [rank]
    return instance_group_of(layout, f"inter-{group}", instances, rank)


def _owned_elements(plan, shard_over: int, shard_rank: int) -> int:
    """Elements of the parameters inside shard ``shard_rank`` of every bucket."""
    owned = 0
    for bucket in plan.buckets:
        size = (bucket.end - bucket.start) // shard_over
        lo, hi = bucket.start + shard_rank * size, bucket.start + (shard_rank + 1) * size
        for index in bucket.params:
            start, end = plan.ranges[index]
            owned += max(0, min(end, hi) - max(start, lo))
    return owned


def _owned_by_param(plan, shard_over: int, shard_rank: int) -> list:
    """Per parameter of the plan: its elements inside shard ``shard_rank`` of its bucket."""
    owned = [0] * len(plan.ranges)
    for bucket in plan.buckets:
        size = (bucket.end - bucket.start) // shard_over
        lo, hi = bucket.start + shard_rank * size, bucket.start + (shard_rank + 1) * size
        for index in bucket.params:
            start, end = plan.ranges[index]
            owned[index] += max(0, min(end, hi) - max(start, lo))
    return owned


def buffer_plans(config, layout: RankLayout, rank: int, buffers: BufferSettings) -> list:
    """``[(kind, BufferPlan, shard size, shard rank), ...]`` of ``rank``: one plan per reduce
    group with parameters (the model has one params dtype)."""
    pp_rank = layout.rank_in("pp", rank)
    shapes = rank_shapes(config, pp_rank)
    plans = []
    for kind, group in (("dense", "dp-cp"), ("expert", "edp")):
        mine = [s for s in shapes if s.expert == (kind == "expert")]
        if not mine:
            continue
        sharded = shard_group(layout, group, rank, buffers.instances
                              if buffers.use_distributed_optimizer else 1)
        size = len(sharded)
        plan = plan_buffer([s.numel for s in mine], buffers.bucket_size,
                           size if buffers.use_distributed_optimizer else None,
                           [buffers.use_distributed_optimizer
                            and _tied_embedding_bucket(config, pp_rank, s) for s in mine])
        plans.append((kind, plan, size, sharded.index(rank)))
    return plans


# -------------------------------------------------------------------- FSDP
@dataclass(frozen=True)
class FsdpUnit:
    """One ``fully_shard`` unit of a chunk: its parameters, the group they are sharded over
    (``"dp-cp"``, ``"edp"``, or None: the unsharded experts of edp = 1) and its place in the
    chunk (a unit of the first or last transformer layer, or the root: the seams ZeRO-3 may keep
    gathered, ``fsdp.keeps_seams``)."""
    group: str | None
    shapes: tuple
    first_layer: bool = False
    last_layer: bool = False
    root: bool = False


def fsdp_units(config, layout: RankLayout, rank: int) -> list:
    """The FSDP units of ``rank``'s chunks as ``training/fsdp.py`` wraps them: per transformer
    layer its expert parameters (over edp when edp > 1, else left unsharded) and the rest (over
    dp·cp), then the chunk's remaining parameters (embedding, final norm, output layer)."""
    pp_rank = layout.rank_in("pp", rank)
    expert_group = "edp" if len(layout.group_of("edp", rank)) > 1 else None
    units = []
    for chunk in range(config.virtual_pipeline_model_parallel_size or 1):
        layers, root = {}, []
        for shape in chunk_shapes(config, pp_rank, chunk):
            if shape.name.startswith("layers."):
                layers.setdefault(shape.name.split(".")[1], []).append(shape)
            else:
                root.append(shape)
        for index, shapes in enumerate(layers.values()):
            place = dict(first_layer=index == 0, last_layer=index == len(layers) - 1)
            experts = tuple(s for s in shapes if s.expert)
            if experts:
                units.append(FsdpUnit(expert_group, experts, **place))
            units.append(FsdpUnit("dp-cp", tuple(s for s in shapes if not s.expert), **place))
        units.append(FsdpUnit("dp-cp", tuple(root), root=True))
    return units


def fsdp_static_memory(config, layout: RankLayout, rank: int,
                       buffers: BufferSettings | None = None) -> dict:
    """The four kinds of ``FullyShardedOptimizer.memory_bytes`` on ``rank`` (module docstring);
    ``buffers`` names the optimizer (default: Adam) and the instances (default: 1)."""
    buffers = buffers or BufferSettings(True, False, None, "optim_grads")
    instances = buffers.instances
    held = dict.fromkeys(MEMORY_KINDS, 0)
    for unit in fsdp_units(config, layout, rank):
        group = shard_group(layout, unit.group, rank, instances) if unit.group else [rank]
        size, shard_rank = len(group), group.index(rank)
        padded = fsdp_rank_bytes([s.fsdp_shape for s in unit.shapes], size)
        held["parameters"] += padded["parameters"]
        held["gradients"] += padded["gradients"]
        for shape in unit.shapes:
            lo, hi = shard_rows(shape.rows, size, shard_rank)
            held["optimizer_state"] += (hi - lo) * (shape.numel // shape.rows) * \
                state_bytes(shape, buffers)
    return held


def static_memory(config, layout: RankLayout, rank: int, buffers: BufferSettings) -> dict:
    """The four kinds of ``MixedPrecisionOptimizer.memory_bytes`` on ``rank``, in bytes."""
    if buffers.fsdp_strategy is not None:
        return fsdp_static_memory(config, layout, rank, buffers)
    param_bytes = element_bytes(config.params_dtype)
    grad_bytes = 4 if buffers.grad_reduce_in_fp32 else param_bytes
    held = dict.fromkeys(MEMORY_KINDS, 0)
    shapes = rank_shapes(config, layout.rank_in("pp", rank))
    for kind, plan, size, shard_rank in buffer_plans(config, layout, rank, buffers):
        numel = sum(end - start for start, end in plan.ranges)
        mine = [s for s in shapes if s.expert == (kind == "expert")]   # plan.ranges' order
        if buffers.use_distributed_optimizer:
            held["parameters"] += plan.numel * param_bytes
            owned = _owned_elements(plan, size, shard_rank)
            per_param = _owned_by_param(plan, size, shard_rank)
        else:
            held["parameters"] += numel * param_bytes
            owned = numel
            per_param = [end - start for start, end in plan.ranges]
        held["gradients"] += plan.numel * grad_bytes
        held["main_parameters"] += owned * 4 if param_bytes != 4 else 0
        held["optimizer_state"] += sum(count * state_bytes(shape, buffers)
                                       for count, shape in zip(per_param, mine))
    return held
