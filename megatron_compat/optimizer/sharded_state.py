"""megatron-core 0.16's ``optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=False,
metadata=None)`` for the compat optimizers, and the ``load_state_dict`` of what
``dist_checkpointing.load`` returns for it.

Every optimizer state tensor is stored as Megatron stores it in its model-space formats: under
the model parameter's key with a prefix, cut exactly as the parameter (the same ShardedTensor
or ShardedTensorFactory with the state as its data), so the state reshards across tp / pp /
ep / dp like the weights::

    optimizer.state.exp_avg.<model key>      Adam's first moment  (fp32, the parameter's shape)
    optimizer.state.exp_avg_sq.<model key>   Adam's second moment
    optimizer.state.fp32_param.<model key>   the fp32 main copy (bf16 / fp16 parameters only)

The nesting follows Megatron's classes: ``FP32Optimizer`` ``{"state": {i: {"exp_avg",
"exp_avg_sq"}, "common_step"}, "param_groups"}``; ``Float16OptimizerWithFloat16Params``
``{"optimizer": that, "fp32_from_fp16_params": [[fp32_param per parameter of the group]],
"grad_scaler"}``; ``DistributedOptimizer`` its ``fully_reshardable`` format ``{"optimizer":
{"param_groups", "state": {"common_step"}}, "param_state": {i: {"fp32_param", "exp_avg",
"exp_avg_sq"}}, "param_state_sharding_type": "fully_reshardable", "grad_scaler"}``. Each class
names its nesting in its ``sharded_nesting`` attribute (``TORCH_NESTING``, ``MAIN_COPY_NESTING``,
``DISTRIBUTED_NESTING``), so this module needs no optimizer class. In the distributed one each
parameter's state is gathered over its data-parallel group at save (the optimizer holds 1/dp of
it) and sliced back to this rank's pieces at load. Megatron's default distributed format
(``fully_sharded_model_space``: flattened pieces) is written in this form too; the other
``distrib_optim_sharding_type`` values are refused. ``i`` is the parameter's position in the
optimizer; the step (one for all parameters) and the loss scaler's state are common entries.
The param groups' hyper-parameters are saved for reference; at load they stay this run's (as
the native optimizer's ``load_state_dict``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

PREFIX = "optimizer.state"
FORMAT_KEY = "param_state_sharding_type"
TORCH_NESTING = "torch"                        # FP32Optimizer: the torch optimizer's own
MAIN_COPY_NESTING = "fp32_from_fp16_params"    # Float16OptimizerWithFloat16Params
DISTRIBUTED_NESTING = "fully_reshardable"      # DistributedOptimizer
_REFUSED_DISTRIBUTED_FORMATS = ("dp_reshardable", "dp_zero_gather_scatter",
                                "fully_sharded_bucket_space", "fsdp_dtensor")


# --------------------------------------------------------------------------- parameters
def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def _address(tensor: torch.Tensor):
    return tensor.data_ptr(), tensor.numel()


def _written(entry) -> bool:
    """Not a read-only copy of a weight written elsewhere (a tied output layer)."""
    replica = entry.replica_id
    return is_main_replica(replica if isinstance(replica, int) else replica[:1])


def sharded_entries_of(params, model_sharded_state_dict) -> list:
    """The model's ShardedTensor / ShardedTensorFactory of every parameter (the written replica
    where a tied weight appears twice), matched by the memory they describe."""
    by_address = {}
    for leaf in _leaves(model_sharded_state_dict):
        if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and leaf.data is not None:
            known = by_address.get(_address(leaf.data))
            if known is None or (not _written(known) and _written(leaf)):
                by_address[_address(leaf.data)] = leaf
    entries = []
    for position, param in enumerate(params):
        entry = by_address.get(_address(param))
        if entry is None:
            raise ValueError(f"optimizer.sharded_state_dict: parameter {position} (shape "
                             f"{tuple(param.shape)}) is not in the model's sharded state dict "
                             "(pass model.sharded_state_dict() of the optimized model)")
        entries.append(entry)
    return entries


def _as_state(entry, state_key: str, data: torch.Tensor):
    """Megatron's ``make_sharded_optimizer_tensor``: the model entry with the state as data."""
    from dataclasses import replace

    key = f"{PREFIX}.{state_key}.{entry.key}"
    if isinstance(entry, ShardedTensorFactory):
        return replace(entry, key=key, data=data)
    return replace(entry, key=key, data=data, dtype=data.dtype)


# --------------------------------------------------------------------------- whole states
def _pieces_by_position(native) -> dict:
    pieces = {}
    for piece in native.pieces:
        pieces.setdefault(piece.position, []).append(piece)
    return pieces


def _whole_states(native, param, pieces, gather: bool) -> dict:
    """``{state key: fp32 tensor of the parameter's shape}`` of one parameter: its moments (and
    main copy when separate), assembled from this rank's pieces and, for the distributed
    optimizer, summed over the parameter's data-parallel group (each element is held by one
    rank, the others contribute zeros)."""
    separate = param.dtype != torch.float32            # the main copy is the parameter else
    names = ("exp_avg", "exp_avg_sq") + (("fp32_param",) if separate else ())
    whole = {name: torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
             for name in names}
    for piece in pieces:
        adam_state = native.adam.state[piece.main]
        values = {"exp_avg": adam_state["exp_avg"], "exp_avg_sq": adam_state["exp_avg_sq"],
                  "fp32_param": piece.main}
        for name in names:
            whole[name][piece.start:piece.end] = values[name].reshape(-1)
    if gather:
        group = native.buffers.buffer_of(param).group
        for tensor in whole.values():
            dist.all_reduce(tensor, group=group)
    return {name: tensor.view(param.shape) for name, tensor in whole.items()}


def _common_step(native):
    steps = {float(native.adam.state[p.main]["step"]) for p in native.pieces}
    if len(steps) > 1:
        raise ValueError(f"optimizer.sharded_state_dict: the parameters' Adam steps differ "
                         f"({sorted(steps)}); Megatron stores one common step")
    return torch.tensor(steps.pop() if steps else 0.0, dtype=torch.float32)


def _param_groups(native) -> list:
    return [{k: v for k, v in group.items() if k != "params"} for group in native.param_groups]


# --------------------------------------------------------------------------- save
def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict, is_loading: bool = False,
                                 metadata: dict | None = None, sharding_type=None) -> dict:
    """The sharded state dict of a compat optimizer, nested as its ``sharded_nesting`` says
    (layout: module docstring)."""
    native = optimizer.native
    distributed = optimizer.sharded_nesting == DISTRIBUTED_NESTING
    if distributed:
        requested = sharding_type or (metadata or {}).get("distrib_optim_sharding_type")
        if requested in _REFUSED_DISTRIBUTED_FORMATS:
            raise ValueError(f"distrib_optim_sharding_type={requested!r} is not supported by "
                             "tpfuse: its distributed optimizer writes the fully_reshardable "
                             "format (leave it unset)")
    params = list(native.model_params)
    entries = sharded_entries_of(params, model_sharded_state_dict)
    pieces = _pieces_by_position(native)
    states = {}
    for position, (param, entry) in enumerate(zip(params, entries)):
        whole = _whole_states(native, param, pieces.get(position, []),
                              gather=distributed and not is_loading)
        states[position] = {name: _as_state(entry, name, tensor)
                            for name, tensor in whole.items()}
    scaler = None if native.grad_scaler is None else native.grad_scaler.state_dict()
    step = _common_step(native)
    if distributed:
        return {"optimizer": {"param_groups": _param_groups(native),
                              "state": {"common_step": step}},
                "param_state": states, FORMAT_KEY: "fully_reshardable", "grad_scaler": scaler}
    moments = {position: {k: v for k, v in s.items() if k != "fp32_param"}
               for position, s in states.items()}
    torch_state = {"state": dict(moments, common_step=step),
                   "param_groups": _param_groups(native)}
    if optimizer.sharded_nesting == TORCH_NESTING:
        return torch_state
    groups = [[states[position]["fp32_param"] for position in group_positions]
              for group_positions in _group_positions(native)]
    return {"optimizer": torch_state, "fp32_from_fp16_params": groups, "grad_scaler": scaler}


def _group_positions(native) -> list:
    """Per param group, the positions of its parameters (in the group's order)."""
    position_of_main = {id(p.main): p.position for p in native.pieces}
    return [[position_of_main[id(main)] for main in group["params"]]
            for group in native.param_groups]


# --------------------------------------------------------------------------- load
def is_sharded_format(state_dict) -> bool:
    """Whether ``state_dict`` is the load of ``optimizer_sharded_state_dict`` (Megatron's
    nesting), not the native optimizer's ``state_dict()``."""
    return isinstance(state_dict, dict) and state_dict.get("format") is None and (
        "param_state" in state_dict or "state" in state_dict or "optimizer" in state_dict)


def _loaded_states(state_dict, native) -> tuple:
    """(per position the loaded whole states, the common step, the scaler state)."""
    if FORMAT_KEY in state_dict:
        return (state_dict["param_state"], state_dict["optimizer"]["state"]["common_step"],
                state_dict.get("grad_scaler"))
    torch_state = state_dict.get("optimizer", state_dict)
    states = {position: dict(value) for position, value in torch_state["state"].items()
              if position != "common_step"}
    for group, group_positions in zip(state_dict.get("fp32_from_fp16_params", []),
                                      _group_positions(native)):
        for fp32_param, position in zip(group, group_positions):
            states[position]["fp32_param"] = fp32_param
    return states, torch_state["state"].get("common_step"), state_dict.get("grad_scaler")


@torch.no_grad()
def load_sharded_optimizer_state(optimizer, state_dict) -> None:
    """Fill every piece this rank optimizes (moments, main copy, step) and the loss scaler from
    the loaded whole states; a parameter without a saved main copy takes its (already loaded)
    model weights."""
    native = optimizer.native
    states, step, scaler = _loaded_states(state_dict, native)
    for piece in native.pieces:
        saved = states.get(piece.position)
        if saved is None:
            raise ValueError(f"optimizer state: parameter {piece.position} is missing in the "
                             "loaded state (built from another model?)")
        adam_state = native.adam.state[piece.main]
        for name in ("exp_avg", "exp_avg_sq"):
            flat = saved[name].reshape(-1)[piece.start:piece.end]
            adam_state[name].copy_(flat.view(piece.main.shape))
        if step is not None:
            adam_state["step"] = torch.as_tensor(step, dtype=torch.float32).to(
                piece.main.device).clone()
        if piece.separate_main:
            source = saved.get("fp32_param")
            piece.main.copy_(source.reshape(-1)[piece.start:piece.end].view(piece.main.shape)
                             if source is not None else piece.model_view().float())
    if native.grad_scaler is not None and scaler is not None:
        native.grad_scaler.load_state_dict(scaler)
