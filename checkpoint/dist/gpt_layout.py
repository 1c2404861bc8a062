"""Megatron's torch_dist keys of a tpfuse GPT chunk: what ``model.sharded_state_dict()`` of
megatron-core 0.16's GPTModel (local spec) holds, built from a native ``tpfuse.models.GPTModel``
chunk; shared by the trainer's ``--ckpt-format torch_dist`` and ``megatron_compat``'s GPTModel.

Names. A native state-dict name becomes Megatron's module name (``megatron_name``)::

    layers.<i>.input_norm.*      → decoder.layers.<i>.input_layernorm.*
    layers.<i>.pre_mlp_norm.*    → decoder.layers.<i>.pre_mlp_layernorm.*
    layers.<i>.<rest>            → decoder.layers.<i>.<rest>     (self_attention, mlp: same names)
    final_norm.*                 → decoder.final_layernorm.*
    embedding.*, output_layer.*  unchanged

and a module name its stored key (``layer_key``): layers stacked on a leading axis of
``num_layers`` under ``decoder.layers.<rest>`` at their global layer number (so any pp / vpp
split reads the same tensor), the norms renamed by the spec's ``sharded_state_dict_keys_map``
(the local spec's: ``LOCAL_SPEC_KEYS_MAP``, the TE names ``...linear_qkv.layer_norm_weight``).
Tensor-parallel weights are cut along their partition dim (``mapping.sharded_tensor_for``), a
tied output layer is a non-written replica of ``embedding.word_embeddings.weight``, the experts
are stored per expert (``experts_sharded_state_dict``, below), and every linear layer's empty
``_extra_state`` object Megatron's local spec saves is written too (so megatron-core loads the
checkpoint).

Layers of different kinds (an MoE pattern other than every layer: ``homogeneous_layers``) keep
per-layer keys, ``decoder.layers.<global layer>.…``, without the layer axis below, as
megatron-core's ``non_homogeneous_layers``.

Experts (megatron-core's layout; SequentialMLP and GroupedMLP write the same tensors)::

    <prefix>experts.experts.linear_fc1.weight   (num_layers, E, F1, h)   F1 = 2F gated: [gate; up]
    <prefix>experts.experts.linear_fc1.bias     (num_layers, E, F1)
    <prefix>experts.experts.linear_fc2.weight   (num_layers, E, h, F)
    <prefix>experts.experts.linear_fc2.bias     (num_layers, E, h)
    <prefix>experts.experts.linear_fc{1,2}._extra_state   objects on (num_layers, E)

tpfuse's stacked ``weight1 (L, h, F1/etp)`` / ``weight2 (L, F/etp, h)`` (L = E/ep local experts
from ep rank · L) are transposed to Megatron's (out, in) per expert. SequentialMLP stores every
expert as its own chunk (the expert axis prepended, size 1); GroupedMLP stores the L experts of
an ep rank as one chunk (the expert axis cut over ep) — the same global tensors, so either
loads into either. fc1 is cut over etp with stride 2 when gated (``strided_pieces``), fc2 by
its input columns; what etp does not cut is replicated over etp (replica id (0, etp rank, edp
rank)), the cut pieces over expert data parallel (0, 0, edp rank).
"""
from __future__ import annotations

import functools

import torch

from .mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory, sharded_tensor_for,
                      strided_pieces, tp_coordinates)

LAYERS_PREFIX = "decoder.layers."
WORD_EMBEDDING_KEY = "embedding.word_embeddings.weight"
EXTRA_STATE = "._extra_state"
# the linear layers whose (empty) extra state Megatron's local spec checkpoints, per layer
LINEARS_WITH_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv",
                            "mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
# megatron-core's local spec: the norms stored under the Transformer Engine spec's names
LOCAL_SPEC_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                       "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# native layer part → Megatron's module name inside a layer
_LAYER_PARTS = {"input_norm.": "input_layernorm.", "pre_mlp_norm.": "pre_mlp_layernorm."}
_NATIVE_LAYERS, _NATIVE_FINAL_NORM = "layers.", "final_norm."


def megatron_name(native_name: str) -> str:
    """Megatron's module name of a native GPT state-dict name (module docstring)."""
    if native_name.startswith(_NATIVE_FINAL_NORM):
        return "decoder.final_layernorm." + native_name[len(_NATIVE_FINAL_NORM):]
    if not native_name.startswith(_NATIVE_LAYERS):
        return native_name
    local, rest = native_name[len(_NATIVE_LAYERS):].split(".", 1)
    for old, new in _LAYER_PARTS.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return f"{LAYERS_PREFIX}{local}.{rest}"


def homogeneous_layers(config) -> bool:
    """Megatron stacks every layer's tensor of one key along a prepended layer axis unless the
    layers differ (``non_homogeneous_layers``: an MoE pattern other than every layer,
    ``moe_layer_freq`` a list or > 1); then each layer keeps its own keys,
    ``decoder.layers.<global layer>.…``, without the axis."""
    freq = config.moe_layer_freq
    return config.num_moe_experts is None or (isinstance(freq, int) and freq == 1)


def layer_key(name: str, keys_map: dict, layer_indices, num_layers: int,
              homogeneous: bool = True):
    """(stored key, prepended layer axis) of a Megatron module name (``megatron_name``'s)."""
    if not name.startswith(LAYERS_PREFIX):
        return name, ()
    local, rest = name[len(LAYERS_PREFIX):].split(".", 1)
    for old, new in keys_map.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    layer = layer_indices[int(local)]
    if not homogeneous:
        return f"{LAYERS_PREFIX}{layer}.{rest}", ()
    return LAYERS_PREFIX + rest, ((0, layer, num_layers),)


def _is_moe(layer) -> bool:
    return hasattr(getattr(layer, "mlp", None), "experts")


def gpt_sharded_state_dict(native, keys_map: dict = LOCAL_SPEC_KEYS_MAP, prefix: str = "",
                           tensors: dict | None = None) -> dict:
    """``{prefix + Megatron module name: ShardedTensor / ShardedTensorFactory / ShardedObject}``
    of the native GPT chunk ``native`` (layout: module docstring). ``tensors``: the data to
    store per native state-dict name (default: the chunk's own tensors; the trainer passes
    whole TP shards of FSDP-sharded parameters); the cut follows the chunk's parameters."""
    config = native.config
    tied = native.share_embeddings_and_output_weights
    data = tensors if tensors is not None else {}
    out = {}
    for name, tensor in native.state_dict(keep_vars=True).items():
        if getattr(tensor, "allreduce", True) is False:
            continue                                     # MoE experts: below
        module_name = megatron_name(name)
        if tied and name == "output_layer.weight":
            sharded = sharded_tensor_for(prefix + WORD_EMBEDDING_KEY, tensor)
            sharded.replica_id = (1,) + tuple(sharded.replica_id)[1:]  # read, never written
        else:
            key, layer_axis = layer_key(module_name, keys_map, native.layer_indices,
                                        config.num_layers, homogeneous_layers(config))
            sharded = sharded_tensor_for(prefix + key, tensor, layer_axis)
        if name in data:
            sharded = _with_data(sharded, data[name])
        out[prefix + module_name] = sharded
    out.update(_experts_sharded(native, prefix, data))
    out.update(_extra_state_objects(native, prefix))
    return out


def _with_data(sharded, tensor: torch.Tensor):
    """``sharded`` storing ``tensor`` (same shape) instead of its parameter."""
    from dataclasses import replace

    return replace(sharded, data=tensor.detach())


def _moe_layers(native):
    """(local index, global layer, MoE layer) of the chunk's MoE layers."""
    for local, (layer, block) in enumerate(zip(native.layer_indices, native.layers)):
        if _is_moe(block):
            yield local, layer, block.mlp


def _experts_sharded(native, prefix: str, data: dict) -> dict:
    out = {}
    stacked = homogeneous_layers(native.config)
    for local, layer, moe in _moe_layers(native):
        state_prefix = f"{_NATIVE_LAYERS}{local}.mlp.experts."
        mine = {name[len(state_prefix):]: tensor for name, tensor in data.items()
                if name.startswith(state_prefix)}
        key = f"{prefix}{LAYERS_PREFIX}mlp.experts." if stacked else \
            f"{prefix}{LAYERS_PREFIX}{layer}.mlp.experts."
        out.update(experts_sharded_state_dict(
            moe.experts, f"{prefix}{LAYERS_PREFIX}{local}.mlp.experts.", key,
            (0, layer, native.config.num_layers) if stacked else None,
            grouped=bool(native.config.moe_grouped_gemm), tensors=mine))
    return out


def _extra_state_objects(native, prefix: str) -> dict:
    """Megatron's local spec saves each linear layer's extra state (None) per layer, as a
    ShardedObject on the layer axis (an expert's on the layer and expert axes)."""
    _, tp_rank, dp_rank = tp_coordinates()
    num_layers = native.config.num_layers
    stacked = homogeneous_layers(native.config)
    objects = {}
    for local, (layer, block) in enumerate(zip(native.layer_indices, native.layers)):
        linears = LINEARS_WITH_EXTRA_STATE
        if _is_moe(block):
            linears = linears[:2] + (SHARED_EXPERT_LINEARS
                                     if native.config.moe_shared_expert_intermediate_size
                                     else ())
        for linear in linears:
            key = f"{prefix}{LAYERS_PREFIX}{'' if stacked else f'{layer}.'}{linear}{EXTRA_STATE}"
            shape, offset = ((num_layers,), (layer,)) if stacked else ((1,), (0,))
            objects[f"{prefix}{LAYERS_PREFIX}{local}.{linear}{EXTRA_STATE}"] = ShardedObject(
                key, None, shape, offset, (0, tp_rank, dp_rank))
    for local, layer, moe in _moe_layers(native):
        objects.update(experts_extra_state_objects(
            moe.experts.num_local, f"{prefix}{LAYERS_PREFIX}{local}.mlp.experts.",
            f"{prefix}{LAYERS_PREFIX}{'' if stacked else f'{layer}.'}mlp.experts.",
            layer if stacked else None, num_layers))
    return objects


# ------------------------------------------------------------------------- experts
def expert_coordinates():
    """(ep size, ep rank, etp size, etp rank, edp rank) of this rank (all 1 / 0 alone)."""
    from tpfuse.parallel.state import resolve_state_or_none

    state = resolve_state_or_none()
    if state is None:
        return 1, 0, 1, 0, 0
    return (state.ep_size, state.ep_rank, state.etp_size, state.etp_rank,
            state.edp_rank or 0)


def _expert_piece_builder(ep, etp, cut_axis, stride, grouped, transposed):
    """build_fn of one stacked expert tensor (tpfuse's ``(L, in, out)`` when ``transposed``,
    else ``(L, *per-expert Megatron shape)``; the data given to it may be the parameter or an
    optimizer state of its shape): cut_axis is the per-expert axis of Megatron's tensor that
    etp cuts (None: replicated over etp)."""
    ep_size, ep_rank, etp_size, etp_rank = ep + etp

    def pieces(key, data, replica_id, offsets, axis):
        if cut_axis is not None and stride > 1 and etp_size > 1:
            return strided_pieces(key, data, offsets[0], axis, etp_rank, etp_size, stride,
                                  replica_id, offsets[1])
        cuts = list(offsets[1])
        if cut_axis is not None and etp_size > 1:
            cuts.append((axis, etp_rank, etp_size))
        return ShardedTensor.from_rank_offsets(key, data.contiguous(), *offsets[0], *cuts,
                                               replica_id=replica_id,
                                               prepend_axis_num=len(offsets[0]))

    def build(key, data, replica_id, flattened_range, layer_axis):
        if transposed:
            data = data.transpose(-1, -2)                  # (L, out, in) as Megatron's
        local = data.shape[0]
        total = local * ep_size
        layers = () if layer_axis is None else (layer_axis,)
        n = len(layers)                          # the expert axis follows the layer axis
        if grouped:                              # (layer,) prepended; expert axis cut over ep
            offsets = (layers, ((n, ep_rank, ep_size),))
            axis = None if cut_axis is None else n + 1 + cut_axis
            return pieces(key, data, replica_id, offsets, axis)
        axis = None if cut_axis is None else n + 1 + cut_axis
        return [pieces(key, data[e], replica_id,
                       ((*layers, (n, ep_rank * local + e, total)), ()), axis)
                for e in range(local)]
    return build


def _expert_piece_merger(stride, grouped, cut_axis, transposed):
    def merge_one(piece, axis):
        return torch.cat(piece, dim=axis) if isinstance(piece, list) else piece

    def merge(loaded):
        if grouped:
            stacked = merge_one(loaded, 1 + (cut_axis or 0))
        else:
            stacked = torch.stack([merge_one(p, cut_axis or 0) for p in loaded])
        return stacked.transpose(-1, -2).contiguous() if transposed else stacked
    return merge


def experts_sharded_state_dict(experts, state_prefix: str, key_prefix: str, layer_axis,
                               grouped: bool, tensors: dict | None = None) -> dict:
    """``{state_prefix + name: ShardedTensorFactory}`` of tpfuse's stacked experts under
    Megatron's keys ``key_prefix + experts.linear_fc1.weight`` ... (layout above);
    ``layer_axis`` the prepended ``(0, layer, num_layers)`` (None: no layer axis, a
    non-homogeneous model's per-layer keys); ``tensors``: the data to store
    per parameter name (default: the parameters)."""
    ep_size, ep_rank, etp_size, etp_rank, edp_rank = expert_coordinates()
    stride = 2 if experts.gated else 1
    # name: (Megatron key, etp-cut axis of the per-expert Megatron tensor, stride, transposed)
    layout = {"weight1": ("linear_fc1.weight", 0, stride, True),
              "weight2": ("linear_fc2.weight", 1, 1, True),
              "bias1": ("linear_fc1.bias", 0, stride, False),
              "bias2": ("linear_fc2.bias", None, 1, False)}
    out = {}
    for name, param in experts.named_parameters(recurse=False):
        suffix, cut_axis, cut_stride, transposed = layout[name]
        cut = cut_axis is not None and etp_size > 1
        replica = (0, 0, edp_rank) if cut else (0, etp_rank, edp_rank)
        build = _expert_piece_builder((ep_size, ep_rank), (etp_size, etp_rank), cut_axis,
                                      cut_stride, grouped, transposed)
        out[state_prefix + name] = ShardedTensorFactory(
            key_prefix + "experts." + suffix, (tensors or {}).get(name, param).detach(),
            functools.partial(build, layer_axis=layer_axis),
            _expert_piece_merger(cut_stride, grouped, cut_axis, transposed), replica)
    return out


def experts_extra_state_objects(num_local: int, state_prefix: str, key_prefix: str,
                                layer: int | None, num_layers: int) -> dict:
    """Megatron's (empty) ``_extra_state`` objects of every expert's fc1 and fc2 (``layer``
    None: no layer axis, a non-homogeneous model's per-layer keys)."""
    ep_size, ep_rank, _, etp_rank, edp_rank = expert_coordinates()
    total = num_local * ep_size
    objects = {}
    for local in range(num_local):
        expert = ep_rank * num_local + local
        for linear in ("linear_fc1", "linear_fc2"):
            shape, offset = ((num_layers, total), (layer, expert)) if layer is not None \
                else ((total,), (expert,))
            objects[f"{state_prefix}expert{expert}.{linear}._extra_state"] = ShardedObject(
                f"{key_prefix}experts.{linear}._extra_state", None, shape, offset,
                (0, etp_rank, edp_rank))
    return objects
