"""megatron-core 0.16's ``transformer.moe.experts`` names: ``GroupedMLP`` (one grouped GEMM,
``moe_grouped_gemm=True``) and ``SequentialMLP`` (a loop over the local experts); tpfuse's
``moe.experts.GroupedExperts`` computes both. ``experts_sharded_state_dict`` gives its weights in
Megatron's torch_dist layout (both expert modules write the same tensors)::

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
import functools

import torch

from ...dist_checkpointing.mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory,
                                           strided_pieces)
from ..attention import _BuiltByTheLayer


class GroupedMLP(_BuiltByTheLayer):
    pass


class TEGroupedMLP(_BuiltByTheLayer):
    def __init__(self, *args, **kwargs):
        raise ValueError("TEGroupedMLP needs Transformer Engine, which tpfuse does not use; use "
                         "get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=True)")


class SequentialMLP(_BuiltByTheLayer):
    pass


# ------------------------------------------------------------------------- checkpoint layout
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
        if grouped:                              # (layer,) prepended; expert axis cut over ep
            offsets = ((layer_axis,), ((1, ep_rank, ep_size),))
            axis = None if cut_axis is None else 1 + 1 + cut_axis
            return pieces(key, data, replica_id, offsets, axis)
        axis = None if cut_axis is None else 2 + cut_axis
        return [pieces(key, data[e], replica_id,
                       ((layer_axis, (1, ep_rank * local + e, total)), ()), axis)
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
                               grouped: bool) -> dict:
    """``{state_prefix + name: ShardedTensorFactory}`` of tpfuse's stacked experts under
    Megatron's keys ``key_prefix + experts.linear_fc1.weight`` ... (layout above);
    ``layer_axis`` the prepended ``(0, layer, num_layers)``."""
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
            key_prefix + "experts." + suffix, param.detach(),
            functools.partial(build, layer_axis=layer_axis),
            _expert_piece_merger(cut_stride, grouped, cut_axis, transposed), replica)
    return out


def experts_extra_state_objects(num_local: int, state_prefix: str, key_prefix: str,
                                layer: int, num_layers: int) -> dict:
    """Megatron's (empty) ``_extra_state`` objects of every expert's fc1 and fc2."""
    ep_size, ep_rank, _, etp_rank, edp_rank = expert_coordinates()
    total = num_local * ep_size
    objects = {}
    for local in range(num_local):
        expert = ep_rank * num_local + local
        for linear in ("linear_fc1", "linear_fc2"):
            objects[f"{state_prefix}expert{expert}.{linear}._extra_state"] = ShardedObject(
                f"{key_prefix}experts.{linear}._extra_state", None, (num_layers, total),
                (layer, expert), (0, etp_rank, edp_rank))
    return objects
