"""Checkpoints Megatron-LM's training wrote (``iter_XXXXXXX/`` torch_dist folders): what their
common.pt records beside the model, in tpfuse's terms.

``args`` is Megatron-LM's argparse.Namespace (read with ``weights_only=True``, see
``dist.safe_loading.common_safe_globals``). Its model shape is checked against this run's as
Megatron's ``check_checkpoint_args`` does (``checkpoint_args_mismatch``), or taken for the run
with ``--use-checkpoint-args`` (``model_config_of``).

``opt_param_scheduler`` is megatron-core's OptimizerParamScheduler state; Megatron-LM counts its
steps in samples (``step(increment=global batch)``), so for an iteration-based run every count is
divided by the checkpoint's global batch (``scheduler_state``). Megatron's ``_check_and_set``:
without ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` the
checkpoint's peak and minimum lr, warm-up, decay length and style must equal this run's
(``scheduler_mismatch``).

``optimizer`` of the distributed optimizer in Megatron-LM's default ``dp_reshardable`` layout
(``DistributedOptimizer.sharded_param_state_dp_reshardable``): per gradient buffer and bucket
one flat tensor per state (``param`` = the fp32 main copy, ``exp_avg``, ``exp_avg_sq``) under
``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<..>.bucket_idx_<k>.<state>``, of
the bucket's unpadded size. megatron-core's ``_ParamAndGradBuffer`` places the parameters in
its buckets in reverse registration order, each start rounded up to a multiple of 64, a new
bucket begun after the parameter that fills one to ``bucket_size`` elements (``bucket_layout``;
the saved buckets' sizes say where); the registration order is the GPT layer's
(``LAYER_ORDER``: the local spec's, or the Transformer Engine spec's with the norms inside
linear_qkv / linear_fc1). At tp > 1 every tp rank has buckets of its own, ``dp_group_idx_<g>``
with g its model-parallel rank (= the tp rank at pp = 1), laid out the same way over that
rank's pieces of the parameters: the index stores a TP-split tensor as one chunk per tp rank,
rank r's the r-th along its split axis, a replicated one whole (``rank_pieces``); every rank's
pieces are put back at their offsets, so the states come out in the global shapes and each
rank of this run takes its own piece of them, whatever its tp (``BucketState.stacked``).
Read: the buckets of one buffer per tp rank of a dense GPT saved at pp = 1 and any tp, tied
or untied embeddings (tied at pp = 1 the output layer has no weight of its own, so no bucket
of its own either), in one bucket (Megatron-LM's default, without ``--overlap-grad-reduce``)
or several (``--overlap-grad-reduce`` with ``--ddp-bucket-size``). Refused, naming the
setting (``_refused_layout``): a chained optimizer's keys (MoE's expert optimizer), a save at
pp > 1, buckets not of one group per recorded tp rank, several buffers. The main copies must
equal the checkpoint's weights, which checks the layout (``_bucket_optimizer_states``).
"""
from __future__ import annotations

import math
import re

import torch

from .dist.gpt_layout import LAYERS_PREFIX, LOCAL_SPEC_KEYS_MAP
from .dist.mapping import ShardedObject, ShardedTensor

BUCKET_PREFIX = "optimizer.distributed."
_BUCKET_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                         r"dtype_(.+)\.bucket_idx_(\d+)\.([A-Za-z0-9_]+)$")
_CHAINED_KEY = re.compile(r"^chained_(\d+)\.optimizer\.distributed\.")
PARAM_ALIGNMENT = 64                   # _pad_start_of_param_if_needed
STATE_NAMES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

# model shape: (Megatron-LM's args name, tpfuse's config field, flag), compared as
# check_checkpoint_args (plus the shapes its torch_dist loading would refuse later)
MODEL_SHAPE_ARGS = (
    ("num_layers", "num_layers", "--num-layers"),
    ("hidden_size", "hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "num_query_groups", "--num-query-groups"),
    ("kv_channels", "kv_channels", "--kv-channels"),
    ("num_experts", "num_moe_experts", "--num-experts"),
)
# --use-checkpoint-args: Megatron-LM's args name → tpfuse's config field
CONFIG_OF_ARGS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
    "ffn_hidden_size": "ffn_hidden_size", "kv_channels": "kv_channels",
    "normalization": "normalization", "norm_epsilon": "layernorm_epsilon",
    "position_embedding_type": "position_embedding_type", "rotary_base": "rotary_base",
    "add_bias_linear": "add_bias_linear", "add_qkv_bias": "add_qkv_bias",
    "qk_layernorm": "qk_layernorm",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
    "num_experts": "num_moe_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk", "max_position_embeddings": "max_position_embeddings",
}

# the parameters of one GPT layer in registration order (module names inside the layer)
_ATTENTION = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
             "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")
_FC2 = ("mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
LAYER_ORDER = {
    "local": ("input_layernorm.weight", "input_layernorm.bias", *_ATTENTION,
              "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", *_QK_NORMS,
              "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
              "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", *_FC2),
    "transformer_engine": (*_ATTENTION, "self_attention.linear_qkv.layer_norm_weight",
                           "self_attention.linear_qkv.layer_norm_bias",
                           "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                           *_QK_NORMS, "mlp.linear_fc1.layer_norm_weight",
                           "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
                           "mlp.linear_fc1.bias", *_FC2),
}
FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


# ---------------------------------------------------------------------------- args
def is_megatron_common(common: dict) -> bool:
    """common.pt of Megatron-LM's training (its ``args`` Namespace, no tpfuse entry)."""
    return "tpfuse" not in common and hasattr(common.get("args"), "num_layers")


def checkpoint_args_mismatch(args, config) -> tuple | None:
    """(flag, this run's value, args name, the checkpoint's value) of the first model-shape
    field that differs between Megatron-LM's ``args`` and this run's config, None if none."""
    for name, field, flag in MODEL_SHAPE_ARGS:
        if not hasattr(args, name) or not hasattr(config, field):
            continue
        saved, mine = getattr(args, name), getattr(config, field)
        if name == "num_query_groups" and not getattr(args, "group_query_attention", True):
            saved = args.num_attention_heads
        if saved is not None and saved != mine:
            return flag, mine, name, saved
    learned = getattr(args, "position_embedding_type", None) == "learned_absolute"
    if learned and getattr(args, "max_position_embeddings", None) not in (
            None, config.max_position_embeddings):
        return ("--max-position-embeddings", config.max_position_embeddings,
                "max_position_embeddings", args.max_position_embeddings)
    return None


def model_config_of(args) -> dict:
    """tpfuse's model config fields of Megatron-LM's ``args`` (``--use-checkpoint-args``)."""
    saved = {field: getattr(args, name) for name, field in CONFIG_OF_ARGS.items()
             if hasattr(args, name)}
    if not getattr(args, "group_query_attention", True):
        saved["num_query_groups"] = args.num_attention_heads
    if getattr(args, "swiglu", False):
        saved["activation"] = "swiglu"
    elif hasattr(args, "swiglu"):
        saved["activation"] = "squared_relu" if getattr(args, "squared_relu", False) else "gelu"
    if getattr(args, "position_embedding_type", None) == "rope":
        saved["position_embedding_type"] = "rope"
    saved["seq_length"] = getattr(args, "seq_length", None)
    return {k: v for k, v in saved.items() if v is not None}


# ---------------------------------------------------------------------------- scheduler
def scheduler_state(saved: dict, args, unit: str) -> dict:
    """tpfuse's LRScheduler state of megatron-core's OptimizerParamScheduler ``saved`` (its
    counts in samples; divided by the checkpoint's global batch for an iteration-based run)."""
    batch = 1 if unit == "samples" else int(getattr(args, "global_batch_size", 0) or 0)
    if batch < 1 or (unit != "samples" and getattr(args, "rampup_batch_size", None)):
        raise ValueError("the checkpoint's lr schedule counts samples under a varying (or "
                         "unrecorded) global batch: resume it with --train-samples")
    counts = {"num_steps": saved["num_steps"], "warmup_steps": saved["lr_warmup_steps"],
              "decay_steps": saved["lr_decay_steps"]}
    for name, value in counts.items():
        if value is not None and value % batch:
            raise ValueError(f"the checkpoint's lr schedule {name} = {value} samples is no "
                             f"multiple of its global batch {batch}: resume it with "
                             f"--train-samples")
    state = {name: None if value is None else value // batch for name, value in counts.items()}
    state.update(max_lr=float(saved["max_lr"]), min_lr=float(saved["min_lr"]),
                 decay_style=saved["lr_decay_style"], unit=unit)
    return state


# (LRScheduler attribute, megatron-core's name of it in _check_and_set)
SCHEDULE_FIELDS = (("max_lr", "learning rate"), ("min_lr", "minimum learning rate"),
                   ("warmup_steps", "warmup iterations"),
                   ("decay_steps", "total number of iterations"),
                   ("decay_style", "learning rate decay style"))


def scheduler_mismatch(state: dict, run: dict) -> tuple | None:
    """(megatron-core's name, this run's value, the checkpoint's) of the first schedule field
    that differs; None when all agree."""
    for field, name in SCHEDULE_FIELDS:
        saved, mine = state[field], run[field]
        same = math.isclose(saved, mine, rel_tol=1e-12) if isinstance(saved, float) and \
            isinstance(mine, (int, float)) else saved == mine
        if not same:
            return name, mine, saved
    return None


# ---------------------------------------------------------------------------- optimizer
def _local_spec_name(rest: str) -> str:
    for local, stored in LOCAL_SPEC_KEYS_MAP.items():
        if rest.startswith(stored):
            return local + rest[len(stored):]
    return rest


def model_tensors(metadata) -> dict:
    """Stored model key → global shape of every model tensor in the checkpoint's index."""
    return {key: tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if hasattr(entry, "size") and not key.startswith(("optimizer.", "rng_state"))}


def rank_pieces(metadata, tp_size: int) -> dict:
    """Stored model key → [(offsets, sizes)] of each tp rank's piece of it, in rank order (the
    layer axis of a stacked key left out). A TP-split tensor is stored as one chunk per tp rank
    (per layer), rank r's at the r-th offset along its split axis; a replicated one as one
    chunk, every rank's piece. ValueError for a key cut otherwise."""
    out = {}
    for key, shape in model_tensors(metadata).items():
        skip = 1 if key.startswith(LAYERS_PREFIX) else 0
        chunks = metadata.state_dict_metadata[key].chunks
        pieces = sorted({(tuple(c.offsets)[skip:], tuple(c.sizes)[skip:]) for c in chunks})
        if len(pieces) not in (1, tp_size):
            raise ValueError(f"its tensor {key} is stored in {len(pieces)} pieces, neither "
                             f"whole nor one per tp rank of its {tp_size}")
        out[key] = pieces * tp_size if len(pieces) == 1 else pieces
    return out


def parameter_order(stored: dict, transformer_impl: str) -> list:
    """[(stored key, layer or None, per-layer shape)] in megatron-core's registration order."""
    order = LAYER_ORDER["transformer_engine" if transformer_impl == "transformer_engine"
                        else "local"]
    local = transformer_impl != "transformer_engine"
    layered = {}
    for key, shape in stored.items():
        if key.startswith(LAYERS_PREFIX):
            rest = key[len(LAYERS_PREFIX):]
            layered[_local_spec_name(rest) if local else rest] = (key, shape)
    unknown = sorted(set(layered) - set(order)) + sorted(
        key for key in stored if not key.startswith(LAYERS_PREFIX) and key not in FIRST + LAST)
    if unknown:
        raise ValueError(f"its parameters {unknown} are not those of a dense GPT layer")
    layers = next(iter(layered.values()))[1][0] if layered else 0
    out = [(key, None, stored[key]) for key in FIRST if key in stored]
    for layer in range(layers):
        out += [(layered[name][0], layer, layered[name][1][1:]) for name in order
                if name in layered]
    return out + [(key, None, stored[key]) for key in LAST if key in stored]


def bucket_layout(order: list, bucket_sizes: list) -> dict:
    """(stored key, layer) → (bucket, [start, end) in it): megatron-core's _ParamAndGradBuffer.

    The parameters fill the buffer in reverse registration order, every start rounded up to a
    multiple of PARAM_ALIGNMENT; a bucket is closed after the parameter that brings it to
    ``bucket_size`` elements (never with Megatron-LM's default, without
    ``--overlap-grad-reduce``) and the next one starts at the bucket's end padded to a multiple
    of lcm(dp, 128), so every start is PARAM_ALIGNMENT-aligned inside its bucket too. A bucket's
    saved tensor holds its unpadded size, the end of its last parameter: ``bucket_sizes`` (in
    bucket order) say where each bucket closed. ValueError where no such filling gives them."""
    layout, bucket, start = {}, 0, 0
    for key, layer, shape in reversed(order):
        if bucket == len(bucket_sizes):
            raise ValueError(f"its buckets hold {list(bucket_sizes)} elements, fewer than "
                             "megatron-core's layout of its parameters")
        start = -(-start // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        end = start + math.prod(shape)
        if end > bucket_sizes[bucket]:
            raise ValueError(f"its bucket {bucket} holds {bucket_sizes[bucket]} elements, "
                             f"megatron-core's layout of its parameters does not end a bucket "
                             f"there ({key} ends at {end})")
        layout[(key, layer)] = (bucket, start, end)
        bucket, start = (bucket + 1, 0) if end == bucket_sizes[bucket] else (bucket, end)
    if bucket != len(bucket_sizes):
        raise ValueError(f"its buckets hold {list(bucket_sizes)} elements, more than "
                         "megatron-core's layout of its parameters")
    return layout


def is_bucket_key(key: str) -> bool:
    """A tensor of a distributed optimizer's dp_reshardable state (one optimizer's, or a
    chained optimizer's: ``chained_<i>.optimizer.distributed....``)."""
    return key.startswith(BUCKET_PREFIX) or _CHAINED_KEY.match(key) is not None


def _buckets_of(metadata) -> dict:
    """(dp group, buffer, dtype, bucket) → {state: (stored key, global shape)}."""
    buckets = {}
    for key, entry in metadata.state_dict_metadata.items():
        match = _BUCKET_KEY.match(key)
        if match and hasattr(entry, "size"):
            group, buffer, dtype, bucket, state = match.groups()
            buckets.setdefault((int(group), int(buffer), dtype, int(bucket)), {})[state] = \
                (key, tuple(entry.size))
    return buckets


_RESUME_WITHOUT = ("resume without its optimizer state with --no-load-optim, or save it with "
                   "--dist-ckpt-optim-fully-reshardable")


def saved_tp_size(args) -> int:
    """The tensor-parallel size Megatron-LM's ``args`` record (1 when absent)."""
    return getattr(args, "tensor_model_parallel_size", 1) or 1


def _refused_group(buckets: dict) -> str | None:
    """Why tpfuse cannot read one model-parallel rank's buckets, None if it can."""
    buffers = sorted({bucket[:3] for bucket in buckets})
    if len(buffers) != 1:
        names = [f"dp_group_idx_{g}.gbuf_idx_{b}.dtype_{d}" for g, b, d in buffers]
        return (f"has {len(buffers)} gradient buffers {names} (parameters of several "
                "dtypes); tpfuse reads one")
    indices = sorted(bucket[3] for bucket in buckets)
    if indices != list(range(len(indices))):
        return f"has the buckets {indices}, not 0 to {len(indices) - 1}"
    names = {frozenset(states) for states in buckets.values()}
    if len(names) != 1:
        return f"has other states in different buckets: {sorted(map(sorted, names))}"
    return None


def _refused_layout(metadata, args, buckets: dict) -> str | None:
    """Why tpfuse cannot read these buckets (the setting that wrote them), None if it can:
    one optimizer's, saved at pp = 1, one buffer per tp rank (``dp_group_idx_<tp rank>``,
    megatron-core's data_parallel_group_idx = the model-parallel rank)."""
    chained = sorted({m.group(1) for m in map(_CHAINED_KEY.match, metadata.state_dict_metadata)
                      if m})
    if chained:
        return (f"belongs to {len(chained)} chained optimizers (keys chained_<i>.optimizer."
                "distributed...: megatron-core's separate optimizer of the MoE expert "
                "parameters, --num-experts); tpfuse reads one optimizer's")
    parallel = [getattr(args, name, 1) or 1 for name in ("tensor_model_parallel_size",
                                                         "pipeline_model_parallel_size")]
    if parallel[1] > 1:
        return (f"was saved at tp, pp = {parallel[0]}, {parallel[1]} "
                "(--tensor-model-parallel-size, --pipeline-model-parallel-size: one bucket "
                "layout per model-parallel rank); tpfuse reads it saved at pp = 1")
    groups = sorted({bucket[0] for bucket in buckets})
    if groups != list(range(parallel[0])):
        return (f"has the model-parallel groups {groups} (dp_group_idx_<g>), not one per tp "
                f"rank 0 to {parallel[0] - 1} of its --tensor-model-parallel-size "
                f"{parallel[0]}")
    for group in groups:
        refused = _refused_group({b: s for b, s in buckets.items() if b[0] == group})
        if refused is not None:
            return refused
    return None


class BucketState:
    """The dp_reshardable optimizer state of a Megatron-LM checkpoint (module docstring): every
    tp rank's buckets (``ranks``), each laid out over that rank's pieces of the parameters."""

    def __init__(self, metadata, args, folder: str):
        buckets = _buckets_of(metadata)
        where = f"checkpoint {folder}: its optimizer state (Megatron's dp_reshardable layout)"
        refused = _refused_layout(metadata, args, buckets)
        if refused is not None:
            raise ValueError(f"{where} {refused} ({_RESUME_WITHOUT})")
        self.shapes = model_tensors(metadata)
        try:
            self.pieces = rank_pieces(metadata, saved_tp_size(args))
        except ValueError as error:
            raise ValueError(f"{where}: {error} (resume without its optimizer state with "
                             "--no-load-optim)") from None
        impl = getattr(args, "transformer_impl", "transformer_engine")
        self.ranks = [_RankBuckets({b: s for b, s in buckets.items() if b[0] == group},
                                   self._piece_shapes(group), impl, where)
                      for group in range(saved_tp_size(args))]
        self.group = 0
        self.buckets, self.layout, self.order = (self.ranks[0].buckets, self.ranks[0].layout,
                                                 self.ranks[0].order)
        self.states = tuple(self.buckets[0])

    def _piece_shapes(self, group: int) -> dict:
        """Stored key → tp rank ``group``'s piece's shape (a stacked key's layer axis kept)."""
        return {key: self.shapes[key][:1 if key.startswith(LAYERS_PREFIX) else 0] +
                pieces[group][1] for key, pieces in self.pieces.items()}

    def requests(self) -> dict:
        """Load requests: every state's whole tensor of every bucket of every tp rank, and the
        optimizer's common object (its param groups' ``step``)."""
        out = {f"megatron_bucket/{group}/{index}/{name}": ShardedTensor.from_rank_offsets(
            key, torch.empty(shape, dtype=torch.float32), replica_id=0)
            for group, rank in enumerate(self.ranks)
            for index, states in enumerate(rank.buckets)
            for name, (key, shape) in states.items()}
        out["megatron_bucket_common"] = ShardedObject(
            f"optimizer.distributed.dp_group_idx_{self.group}.optimizer", None, (1,), (0,), 0)
        return out

    def stacked(self, loaded: dict, name: str) -> dict:
        """Stored model key → the state ``name`` in the key's global shape (layers stacked):
        every tp rank's piece put at its offsets (a replicated tensor: rank 0's)."""
        out = {}
        for group, rank in enumerate(self.ranks):
            for key, local in rank.stacked(loaded, group, name).items():
                if key not in out:
                    out[key] = torch.full(self.shapes[key], float("nan"))
                elif self.pieces[key][group] == self.pieces[key][0]:
                    continue
                region = out[key]
                skip = 1 if key.startswith(LAYERS_PREFIX) else 0
                for axis, (offset, size) in enumerate(zip(*self.pieces[key][group])):
                    region = region.narrow(axis + skip, offset, size)
                region.copy_(local)
        return out

    @staticmethod
    def step(loaded: dict):
        """The Adam step megatron-core records in its param groups (None when absent): the
        object is DistributedOptimizer.state_dict()'s ``optimizer`` entry."""
        common = loaded.get("megatron_bucket_common") or {}
        groups = common.get("param_groups") or []
        steps = {group.get("step") for group in groups} - {None}
        return torch.tensor(float(steps.pop())) if len(steps) == 1 else None


class _RankBuckets:
    """One tp rank's buckets (``dp_group_idx_<rank>``) and megatron-core's layout of that
    rank's parameter pieces (``shapes``: stored key → the piece's shape) in them."""

    def __init__(self, buckets: dict, shapes: dict, transformer_impl: str, where: str):
        self.buckets = [{name: states[name] for name in STATE_NAMES if name in states}
                        for _, states in sorted(buckets.items(), key=lambda item: item[0][3])]
        sizes = []
        for states in self.buckets:
            stored = {shape for _, shape in states.values()}
            if len(stored) != 1 or len(next(iter(stored))) != 1:
                raise ValueError(f"{where} holds states of the shapes {sorted(stored)} in one "
                                 "bucket: not a layout tpfuse knows")
            sizes.append(next(iter(stored))[0])
        try:
            self.order = parameter_order(shapes, transformer_impl)
            self.layout = bucket_layout(self.order, sizes)
        except ValueError as error:
            raise ValueError(f"{where}: {error} (resume without its optimizer state with "
                             "--no-load-optim)") from None

    def stacked(self, loaded: dict, group: int, name: str) -> dict:
        """Stored model key → this rank's piece of the state ``name`` (layers stacked)."""
        flats = [loaded[f"megatron_bucket/{group}/{index}/{name}"].reshape(-1)
                 for index in range(len(self.buckets))]
        per_key = {}
        for key, layer, shape in self.order:
            bucket, start, end = self.layout[(key, layer)]
            per_key.setdefault(key, []).append(flats[bucket][start:end].view(shape))
        return {key: torch.stack(parts) if key.startswith(LAYERS_PREFIX) else parts[0]
                for key, parts in per_key.items()}


def local_piece(entry: ShardedTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` (the entry's global tensor): the prepended axes indexed,
    the others sliced by the entry's offsets and local shape."""
    piece = full
    for axis in range(entry.prepend_axis_num):
        piece = piece[entry.global_offset[axis]]
    for axis, (offset, size) in enumerate(zip(entry.global_offset[entry.prepend_axis_num:],
                                              entry.local_shape)):
        piece = piece.narrow(axis, offset, size)
    return piece.contiguous()
