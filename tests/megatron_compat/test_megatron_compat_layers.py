"""Each megatron_compat.tensor_parallel layer against the native layer it wraps.

On 4 gloo ranks (tp 2, dp 2; then ep 2 with etp 1 for the expert layers): the compat layer is
built with Megatron's keywords, the native one with the explicit arguments those keywords stand
for, both under the same seed. Their weights, outputs (Megatron's ``(output, bias)`` unwrapped)
and the input and weight gradients must be bitwise equal: the compat layer runs the native
forward, so any difference is a wrong translation of a keyword, not rounding.
"""
import pytest
import torch

from tpfuse.megatron_compat import parallel_state as mpu
from tpfuse.megatron_compat import tensor_parallel
from tpfuse.megatron_compat.model_parallel_config import ModelParallelConfig
from tpfuse.parallel.comm_options import CommOptions
from tpfuse.parallel.state import get_default_state
from tpfuse.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpfuse.tp_layers.init import normal_init

S, B, H, F, V = 8, 2, 16, 32, 24
INIT = normal_init(0.02)


def _input(shape, seed, state=None, split_dim=None):
    """The same full tensor on every rank; this TP rank's chunk of ``split_dim`` if given."""
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if split_dim is not None:
        full = full.chunk(state.tp_size, dim=split_dim)[state.tp_rank]
    return full.clone().requires_grad_(True)


def _unwrap(out):
    """Megatron's (output, bias) → output + bias (bias None: the output)."""
    if isinstance(out, tuple):
        y, bias = out
        return y if bias is None else y + bias
    return out


def _same_call(megatron_layer, native_layer, make_input, tag):
    """Weights, output and gradients of the two layers on the same input are identical; both
    communicate with the same options (those of the default state)."""
    assert megatron_layer.tp == native_layer.tp, tag
    assert megatron_layer.tp.options == native_layer.tp.options, tag
    for (name, a), (_, b) in zip(megatron_layer.named_parameters(),
                                 native_layer.named_parameters()):
        assert torch.equal(a, b), f"{tag}: {name} differs at construction"
    x_megatron, x_native = make_input(), make_input()
    y_megatron, y_native = _unwrap(megatron_layer(x_megatron)), _unwrap(native_layer(x_native))
    assert torch.equal(y_megatron, y_native), f"{tag}: output"
    dy = torch.randn(y_native.shape, generator=torch.Generator().manual_seed(99))
    y_megatron.backward(dy)
    y_native.backward(dy)
    if x_native.grad is not None:
        assert torch.equal(x_megatron.grad, x_native.grad), f"{tag}: input grad"
    for (name, a), (_, b) in zip(megatron_layer.named_parameters(),
                                 native_layer.named_parameters()):
        assert torch.equal(a.grad, b.grad), f"{tag}: {name} grad"


def _build(seed, make):
    torch.manual_seed(seed)
    return make()


def _dense_layers():
    state = get_default_state()
    for sp in (False, True):
        # sequence parallel: the fused comm+GEMM path forced for these small GEMMs
        state.comm_options = CommOptions(fused_min_flops=0) if sp else None
        config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp)
        x_dim = 0 if sp else None       # sequence parallel: this rank's s/tp tokens
        for bias, skip, gather in ((True, False, False), (True, True, False),
                                   (False, False, not sp)):
            tag = f"column sp={sp} bias={bias} skip_bias_add={skip} gather_output={gather}"
            megatron = _build(1, lambda: tensor_parallel.ColumnParallelLinear(
                H, F, config=config, init_method=INIT, bias=bias, skip_bias_add=skip,
                gather_output=gather))
            native = _build(1, lambda: ColumnParallelLinear(
                H, F, init_method=INIT, bias=bias, skip_bias_add=skip, gather_output=gather,
                sequence_parallel=sp, state=state))
            _same_call(megatron, native, lambda: _input((S, B, H), 2, state, x_dim), tag)
        for skip in (False, True):
            tag = f"row sp={sp} skip_bias_add={skip}"
            megatron = _build(3, lambda: tensor_parallel.RowParallelLinear(
                F, H, config=config, init_method=INIT, bias=True, input_is_parallel=True,
                skip_bias_add=skip))
            native = _build(3, lambda: RowParallelLinear(
                F, H, init_method=INIT, skip_bias_add=skip, sequence_parallel=sp, state=state))
            _same_call(megatron, native, lambda: _input((S, B, F), 4, state, -1), tag)
        tag = f"embedding reduce_scatter_embeddings={sp}"
        megatron = _build(5, lambda: tensor_parallel.VocabParallelEmbedding(
            V, H, init_method=INIT, reduce_scatter_embeddings=sp, config=config))
        native = _build(5, lambda: VocabParallelEmbedding(V, H, init_method=INIT,
                                                          sequence_parallel=sp, state=state))
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(6))
        _same_call(megatron, native, lambda: ids, tag)
    state.comm_options = None
    # perform_initialization=False: the native layer over a zero master, nothing drawn
    lazy = ModelParallelConfig(tensor_model_parallel_size=2, perform_initialization=False)
    megatron = _build(7, lambda: tensor_parallel.ColumnParallelLinear(H, F, config=lazy,
                                                                      init_method=INIT))
    native = _build(7, lambda: ColumnParallelLinear(H, F, master_weight=torch.zeros(F, H),
                                                    state=state))
    _same_call(megatron, native, lambda: _input((S, B, H), 8), "column, no initialisation")
    # tp_group= is the native group=
    megatron = _build(9, lambda: tensor_parallel.RowParallelLinear(
        F, H, config=ModelParallelConfig(tensor_model_parallel_size=2), init_method=INIT,
        bias=False, input_is_parallel=True, skip_bias_add=False, tp_group=state.tp_group))
    native = _build(9, lambda: RowParallelLinear(F, H, init_method=INIT, bias=False,
                                                 group=state.tp_group))
    _same_call(megatron, native, lambda: _input((S, B, F), 10, state, -1), "row, tp_group")
    return True


def _expert_layers():
    """is_expert=True at etp 1, ep 2: the native layers over the expert tensor-parallel group
    (of one rank); Megatron's parameters are marked ``allreduce = False``."""
    state = get_default_state()
    config = ModelParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    megatron = _build(11, lambda: tensor_parallel.ColumnParallelLinear(
        H, F, config=config, init_method=INIT, is_expert=True))
    native = _build(11, lambda: ColumnParallelLinear(H, F, init_method=INIT,
                                                     group=state.etp_group))
    _same_call(megatron, native, lambda: _input((S, B, H), 12), "expert column")
    assert megatron.weight.allreduce is False and megatron.tp.size == state.etp_size == 1
    megatron = _build(13, lambda: tensor_parallel.RowParallelLinear(
        F, H, config=config, init_method=INIT, bias=True, input_is_parallel=True,
        skip_bias_add=True, is_expert=True))
    native = _build(13, lambda: RowParallelLinear(F, H, init_method=INIT, skip_bias_add=True,
                                                  group=state.etp_group))
    _same_call(megatron, native, lambda: _input((S, B, F), 14), "expert row")
    assert megatron.bias.allreduce is False
    return True


def _compat_layers_body():
    mpu.initialize_model_parallel(2)
    try:
        assert _dense_layers()
    finally:
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    try:
        assert _expert_layers()
    finally:
        mpu.destroy_model_parallel()
    return True


def test_each_compat_layer_equals_the_native_call(run_distributed):
    assert run_distributed(4, _compat_layers_body) == [True] * 4


def test_sequence_parallel_at_tp1_is_switched_off_with_a_warning():
    """Megatron's rule, applied by the compat layer only (the native layer takes the flag)."""
    config = ModelParallelConfig(sequence_parallel=False)
    config.sequence_parallel = True          # past the config's own tp > 1 check
    with pytest.warns(UserWarning, match="sequence_parallel=True with a tensor-parallel size"):
        layer = tensor_parallel.ColumnParallelLinear(H, F, config=config, init_method=INIT)
    assert not layer.sequence_parallel
    assert ColumnParallelLinear(H, F, sequence_parallel=True).sequence_parallel
