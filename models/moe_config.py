"""The mixture-of-experts part of TransformerConfig: choices, the layer pattern, validation.

Megatron-core's names and defaults (``--num-experts`` ↔ ``num_moe_experts``, top-2 softmax routing,
the all-gather dispatcher, dropless unless ``moe_expert_capacity_factor`` is set). Every check
raises ValueError naming the fields and values, at config construction — before any process group
exists.

``moe_layer_freq``: an int N puts an MoE layer at every global layer i with i % N == 0 (N = 1: all
layers); a list gives one 0/1 per layer. On the command line the list may be written as Megatron's
expression, e.g. ``"([0]+[1]*3)*2"`` (lists of 0/1, ``+`` and ``*`` by an int only).
"""
from __future__ import annotations

import ast

from tpfuse.parallel.checks import is_int, is_real, require_choice, require_positive

MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
MOE_TOKEN_DROP_POLICIES = ("probs", "position")
MOE_TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall")
MOE_ROUTER_DTYPES = ("fp32", "fp64")


def _evaluate(node):
    """Lists of ints combined with + (concatenation) and * (repetition by an int)."""
    if isinstance(node, ast.List):
        return [_evaluate(item) for item in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported element {ast.dump(node)}")


def parse_moe_layer_freq(text):
    """``"2"`` → 2; ``"[1,0,1,0]"`` or ``"([1]+[0])*2"`` → [1, 0, 1, 0]."""
    if isinstance(text, (int, list)):
        return text
    try:
        value = _evaluate(ast.parse(str(text).strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as error:
        raise ValueError(f"moe_layer_freq={text!r} must be an int or a list expression such as "
                         f"'([0]+[1]*3)*2': {error}") from None
    return value


def moe_layer_pattern(config) -> tuple[bool, ...]:
    """For every global layer: is it an MoE layer? (all False without experts)."""
    n = config.num_layers
    if config.num_moe_experts is None:
        return (False,) * n
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(n))
    return tuple(bool(x) for x in freq)


def is_moe_layer(config, index: int) -> bool:
    """Is global layer ``index`` an MoE layer? The multi-token-prediction layers (index ≥
    num_layers) take the last decoder layer's kind, as Megatron's MTP block spec takes the
    decoder's last layer spec (DeepSeek-V3: MoE)."""
    pattern = moe_layer_pattern(config)
    return pattern[min(index, len(pattern) - 1)] if pattern else False


def validate_moe(config) -> None:
    """ValueError naming the fields of the first invalid MoE setting."""
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    if experts is None:
        if ep > 1:
            raise ValueError(f"expert_model_parallel_size={ep} needs num_moe_experts "
                             "(--num-experts)")
        return
    for name in ("num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk"):
        require_positive(config, name)
    for name, choices in (("moe_router_score_function", MOE_SCORE_FUNCTIONS),
                          ("moe_router_load_balancing_type", MOE_LOAD_BALANCING_TYPES),
                          ("moe_token_drop_policy", MOE_TOKEN_DROP_POLICIES),
                          ("moe_token_dispatcher_type", MOE_TOKEN_DISPATCHER_TYPES),
                          ("moe_router_dtype", MOE_ROUTER_DTYPES + (None,))):
        require_choice(config, name, choices)
    if experts % ep:
        raise ValueError(f"num_moe_experts={experts} is not divisible by "
                         f"expert_model_parallel_size={ep}")
    if config.moe_router_topk > experts:
        raise ValueError(f"moe_router_topk={config.moe_router_topk} exceeds "
                         f"num_moe_experts={experts}")
    _validate_parallel_sizes(config)
    _validate_capacity(config)
    _validate_losses(config)
    _validate_group_routing(config)
    _validate_layer_freq(config)
    _validate_expert_bias(config)
    _validate_shared_expert_overlap(config)


def _validate_parallel_sizes(config):
    tp = config.tensor_model_parallel_size
    etp = config.expert_tensor_parallel_size or tp
    if tp > 1 and not config.sequence_parallel:
        raise ValueError(f"num_moe_experts with tensor_model_parallel_size={tp} needs "
                         "sequence_parallel=True (--sequence-parallel), as in Megatron-core")
    if config.moe_ffn_hidden_size % etp:
        raise ValueError(f"moe_ffn_hidden_size={config.moe_ffn_hidden_size} is not divisible by "
                         f"expert_tensor_parallel_size={etp}")
    shared = config.moe_shared_expert_intermediate_size
    if config.moe_shared_expert_gate and shared is None:
        raise ValueError("moe_shared_expert_gate=True needs moe_shared_expert_intermediate_size "
                         "(a shared expert to gate)")
    if shared is not None:
        require_positive(config, "moe_shared_expert_intermediate_size")
        if shared % tp:
            raise ValueError(f"moe_shared_expert_intermediate_size={shared} is not divisible by "
                             f"tensor_model_parallel_size={tp}")


def _validate_capacity(config):
    factor = config.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ValueError(f"moe_expert_capacity_factor={factor} must be > 0 (None: dropless)")
    if config.moe_pad_expert_input_to_capacity:
        if factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity=True needs "
                             "moe_expert_capacity_factor")
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError("moe_pad_expert_input_to_capacity=True needs "
                             "moe_token_dispatcher_type='alltoall' (got "
                             f"{config.moe_token_dispatcher_type!r})")


def _validate_losses(config):
    if not config.moe_aux_loss_coeff >= 0:
        raise ValueError(f"moe_aux_loss_coeff={config.moe_aux_loss_coeff} must be >= 0")
    if config.moe_z_loss_coeff is not None and not config.moe_z_loss_coeff >= 0:
        raise ValueError(f"moe_z_loss_coeff={config.moe_z_loss_coeff} must be >= 0 (or None)")
    scaling = config.moe_router_topk_scaling_factor
    if scaling is not None and not scaling > 0:
        raise ValueError(f"moe_router_topk_scaling_factor={scaling} must be > 0 (or None)")


def _validate_group_routing(config):
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        raise ValueError(f"moe_router_num_groups={groups} and moe_router_group_topk={group_topk} "
                         "must be set together")
    require_positive(config, "moe_router_num_groups")
    require_positive(config, "moe_router_group_topk")
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if experts % groups:
        raise ValueError(f"num_moe_experts={experts} is not divisible by "
                         f"moe_router_num_groups={groups}")
    if group_topk > groups:
        raise ValueError(f"moe_router_group_topk={group_topk} exceeds "
                         f"moe_router_num_groups={groups}")
    if topk % group_topk or topk > group_topk * (experts // groups):
        raise ValueError(f"moe_router_topk={topk} must be a multiple of moe_router_group_topk="
                         f"{group_topk} and fit in the selected groups "
                         f"({group_topk} × {experts // groups} experts)")


def _validate_layer_freq(config):
    freq = config.moe_layer_freq
    if not (is_int(freq) or isinstance(freq, list)):
        raise ValueError(f"moe_layer_freq={freq!r} must be an int or a list of 0/1")
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq} must be >= 1")
        return
    if len(freq) != config.num_layers or any(x not in (0, 1) for x in freq):
        raise ValueError(f"moe_layer_freq={freq} must hold one 0/1 per layer "
                         f"(num_layers={config.num_layers})")


def _validate_expert_bias(config):
    """Megatron's check: the aux-loss-free bias is defined on sigmoid scores only."""
    rate = config.moe_router_bias_update_rate
    if not (is_real(rate) and rate >= 0):
        raise ValueError(f"moe_router_bias_update_rate={rate!r} must be a number >= 0")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ValueError("moe_router_enable_expert_bias=True (--moe-router-enable-expert-bias): "
                         "expert bias for aux-loss-free routing only supports the sigmoid score "
                         "function; set moe_router_score_function='sigmoid' "
                         f"(--moe-router-score-function sigmoid), got "
                         f"{config.moe_router_score_function!r}")


def _validate_shared_expert_overlap(config):
    """Megatron's check: the overlap exists for the alltoall dispatcher only (with a shared
    expert; without one the flag has no effect)."""
    if not config.moe_shared_expert_overlap or config.moe_shared_expert_intermediate_size is None:
        return
    if config.moe_token_dispatcher_type != "alltoall":
        raise ValueError("moe_shared_expert_overlap=True (--moe-shared-expert-overlap) only works "
                         "with the alltoall token dispatcher (moe_token_dispatcher_type="
                         f"'alltoall'), got {config.moe_token_dispatcher_type!r}")
