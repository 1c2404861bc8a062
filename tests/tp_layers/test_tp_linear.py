"""Column-/row-parallel linear vs nn.Linear at tp = 1, 2, 4, sequence parallelism on and off.

One gloo world of 4 ranks; inside each job the TP size loops over 1, 2, 4 (ParallelState with
tp = 1, 2, 4 and dp = 4 / tp). Outputs, input grads and every weight grad (all-gathered from the
shards and reassembled) are compared on every rank. Tolerance: see tests/support/tp_testing.py.
"""

import torch
from torch import nn

from support.tp_testing import (assembled, assert_close_fp32, chunk_of, expect_value_error,
                         seeded_randn, tp_layouts, tp_state)
from tpfuse.parallel.comm_options import CommOptions
from tpfuse.tp_layers import ColumnParallelLinear, RowParallelLinear
from tpfuse.tp_layers.init import shard

S, B, IN, OUT = 8, 2, 12, 16


def _dense(seed, in_features, out_features, bias=True):
    torch.manual_seed(seed)
    dense = nn.Linear(in_features, out_features, bias=bias)
    if bias:  # nn.Linear's bias is tiny and uniform; make it clearly non-zero
        with torch.no_grad():
            dense.bias.normal_()
    return dense


def _dense_run(dense, x, dy):
    x = x.clone().requires_grad_()
    y = dense(x)
    y.backward(dy)
    return y.detach(), x.grad


def _column_case(state, sp, bias, gather_output, stride, activation, skip_bias_add):
    dense = _dense(11, IN, OUT, bias)
    act = {None: lambda t: t, "gelu": torch.nn.functional.gelu}[activation]
    x, dy = seeded_randn(1, S, B, IN), seeded_randn(2, S, B, OUT)
    xd = x.clone().requires_grad_()
    yd = act(dense(xd))
    yd.backward(dy)
    layer = ColumnParallelLinear.from_dense(
        dense, gather_output=gather_output, sequence_parallel=sp, stride=stride,
        activation=activation, skip_bias_add=skip_bias_add, state=state)
    x_in = (chunk_of(x, state, 0) if sp else x).clone().requires_grad_()
    out = layer(x_in)
    if skip_bias_add:
        out, out_bias = out
        assert out_bias is layer.bias
        out = out + out_bias
    tag = f"column tp={state.tp_size} sp={sp} bias={bias} gather={gather_output} stride={stride}"
    if gather_output:
        expected, dy_local = yd.detach(), dy
    else:
        rank, tp = state.tp_rank, state.tp_size
        expected, dy_local = shard(yd.detach(), -1, tp, rank, stride), shard(dy, -1, tp, rank, stride)
    assert_close_fp32(out, expected, f"{tag}: output")
    out.backward(dy_local)
    assert_close_fp32(x_in.grad, chunk_of(xd.grad, state, 0) if sp else xd.grad, f"{tag}: dx")
    assert_close_fp32(assembled(layer.weight.grad, state, 0, stride), dense.weight.grad,
                      f"{tag}: dW")
    if bias:
        assert_close_fp32(assembled(layer.bias.grad, state, 0, stride), dense.bias.grad, f"{tag}: db")


def _row_case(state, sp, bias, input_is_parallel, skip_bias_add):
    dense = _dense(12, OUT, IN, bias)  # in = 16 (split over tp), out = 12
    x, dy = seeded_randn(3, S, B, OUT), seeded_randn(4, S, B, IN)
    yd, dxd = _dense_run(dense, x, dy)
    layer = RowParallelLinear.from_dense(dense, input_is_parallel=input_is_parallel,
                                         sequence_parallel=sp, skip_bias_add=skip_bias_add,
                                         state=state)
    x_in = chunk_of(x, state, -1) if input_is_parallel else x
    x_in = x_in.clone().requires_grad_()
    out = layer(x_in)
    if skip_bias_add:
        out, out_bias = out
        out = out + out_bias if bias else out
    tag = f"row tp={state.tp_size} sp={sp} bias={bias} input_is_parallel={input_is_parallel}"
    assert_close_fp32(out, chunk_of(yd, state, 0) if sp else yd, f"{tag}: output")
    out.backward(chunk_of(dy, state, 0) if sp else dy)
    assert_close_fp32(x_in.grad, chunk_of(dxd, state, -1) if input_is_parallel else dxd,
                      f"{tag}: dx")
    assert_close_fp32(assembled(layer.weight.grad, state, 1), dense.weight.grad, f"{tag}: dW")
    if bias:  # replicated: every rank must hold the full-sequence gradient (SP all-reduces it)
        assert_close_fp32(layer.bias.grad, dense.bias.grad, f"{tag}: db")


COLUMN_CASES = (  # bias, gather_output, stride, activation, skip_bias_add
    (True, False, 1, None, False), (True, True, 1, "gelu", False), (True, False, 2, "gelu", False),
    (False, True, 2, None, False), (True, False, 1, None, True))
ROW_CASES = ((True, True, False), (False, True, False), (True, True, True))  # bias, in_parallel, skip
# SP modes: off; on with the kernels' default (small GEMMs fall back to collective + one GEMM);
# on with min FLOPs 0, which forces the ring-overlapped fused comm+GEMM path for these tiny GEMMs.
SP_MODES = ((False, None), (True, None), (True, 0))


def _linear_against_dense():
    cases = 0
    for tp, state in tp_layouts():
        for sp, min_flops in SP_MODES:
            state.comm_options = CommOptions(fused_min_flops=min_flops)   # the layers' options
            for case in COLUMN_CASES:
                _column_case(state, sp, *case)
            for case in ROW_CASES:
                _row_case(state, sp, *case)
            state.comm_options = None                                    # back to the defaults
            cases += len(COLUMN_CASES) + len(ROW_CASES)
        _row_case(state, False, True, False, False)  # scatter the input inside the layer
        cases += 1
    return cases


def test_linear_layers_match_nn_linear(run_distributed):
    assert run_distributed(4, _linear_against_dense) == [3 * 25] * 4


def _layout_independent_init():
    """After the same seed every tp holds slices of the same master draw; biases start at 0."""
    for tp, state in tp_layouts():
        torch.manual_seed(5)
        column = ColumnParallelLinear(IN, OUT, stride=2, state=state)
        row = RowParallelLinear(OUT, IN, state=state)
        torch.manual_seed(5)
        master_column = torch.empty(OUT, IN).normal_(0.0, 0.02)  # the documented default draw
        master_row = torch.empty(IN, OUT).normal_(0.0, 0.02)
        assert column.weight.shape == (OUT // tp, IN) and row.weight.shape == (IN, OUT // tp)
        torch.testing.assert_close(assembled(column.weight.data, state, 0, 2), master_column,
                                   rtol=0, atol=0)
        torch.testing.assert_close(assembled(row.weight.data, state, 1), master_row, rtol=0, atol=0)
        assert not column.bias.any() and not row.bias.any() and row.bias.shape == (IN,)
        if tp == 2:  # stride 2 at tp 2: rank 0 holds blocks 0 and 2 of 4 (4 rows each)
            blocks = master_column.chunk(4)
            mine = torch.cat([blocks[state.tp_rank], blocks[state.tp_rank + 2]])
            assert torch.equal(column.weight.data, mine)
        assert column.weight.partition_dim == 0 and column.weight.partition_stride == 2
        for sp in (False, True):  # forward(x, weight=...) (tied output layer) uses that weight
            other = _dense(13, IN, OUT, bias=False)
            tied = ColumnParallelLinear(IN, OUT, bias=False, sequence_parallel=sp, state=state)
            x = seeded_randn(1, S, B, IN)
            out = tied(chunk_of(x, state, 0) if sp else x, weight=shard(other.weight, 0, tp,
                                                                         state.tp_rank))
            assert_close_fp32(out, chunk_of(other(x), state, -1).detach(), f"tied tp={tp} sp={sp}")
        assert row.weight.tensor_model_parallel and not row.bias.tensor_model_parallel
    return True


def _bad_settings():
    with tp_state(4) as state:
        expect_value_error(lambda: ColumnParallelLinear(IN, 10, state=state), "output_size=10",
                           "tp=4")
        expect_value_error(lambda: ColumnParallelLinear(IN, 12, stride=2, state=state),
                           "output_size=12", "stride=2")
        expect_value_error(lambda: RowParallelLinear(6, IN, state=state), "input_size=6", "tp=4")
        expect_value_error(lambda: RowParallelLinear(OUT, IN, sequence_parallel=True,
                                                     input_is_parallel=False, state=state),
                           "input_is_parallel")
        expect_value_error(lambda: ColumnParallelLinear(IN, OUT, activation="tanh", state=state),
                           "tanh")
        row = RowParallelLinear(OUT, IN, sequence_parallel=True, state=state)
        # sequence length 6 cannot be reduce-scattered over 4 ranks: raised before the collective
        expect_value_error(lambda: row(torch.randn(6, B, OUT // 4)), "sequence length 6", "tp=4")
    return True


def _default_state_and_explicit_group():
    """state=None uses initialize_model_parallel's default; group= takes a raw ProcessGroup."""
    import torch.distributed as dist
    from tpfuse.parallel import parallel_state

    with_group = ColumnParallelLinear(IN, OUT, group=dist.group.WORLD)
    assert (with_group.tp.size, with_group.tp.rank) == (4, dist.get_rank())
    try:  # a distributed run without a default state must say so, not guess tp = 1
        ColumnParallelLinear(IN, OUT)
    except RuntimeError as err:
        assert "initialize_model_parallel" in str(err)
    else:
        raise AssertionError("no RuntimeError without a default state")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        layer = RowParallelLinear(OUT, IN)
        assert layer.tp.size == 2 and layer.weight.shape == (IN, OUT // 2)
        assert layer.tp.rank == parallel_state.get_tensor_model_parallel_rank()
    finally:
        parallel_state.destroy_model_parallel()
    return True


def test_layout_independent_init_and_bad_settings(run_distributed):
    assert run_distributed(4, _layout_independent_init) == [True] * 4
    assert run_distributed(4, _bad_settings) == [True] * 4
    assert run_distributed(4, _default_state_and_explicit_group) == [True] * 4


def test_single_process_without_distributed_is_tp1():
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT)
    layer = ColumnParallelLinear.from_dense(dense)
    x = torch.randn(3, 2, IN)
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-6, atol=1e-6)
    assert layer.tp.size == 1


def test_native_signatures_take_explicit_arguments_only():
    """The native layers speak tpfuse (group= / state=, explicit flags); Megatron's keywords
    (config=, is_expert=, tp_group=, reduce_scatter_embeddings=) are megatron_compat's."""
    import inspect

    from tpfuse.tp_layers import VocabParallelEmbedding

    expected = {
        ColumnParallelLinear: "input_size output_size bias gather_output sequence_parallel "
                              "skip_bias_add init_method stride params_dtype activation "
                              "master_weight master_bias group state",
        RowParallelLinear: "input_size output_size bias input_is_parallel sequence_parallel "
                           "skip_bias_add init_method stride params_dtype master_weight "
                           "master_bias group state",
        VocabParallelEmbedding: "num_embeddings embedding_dim init_method sequence_parallel "
                                "params_dtype master_weight group state",
    }
    for cls, names in expected.items():
        assert list(inspect.signature(cls.__init__).parameters)[1:] == names.split(), cls
    for megatron_keyword in ("config", "is_expert", "tp_group"):
        try:
            ColumnParallelLinear(IN, OUT, **{megatron_keyword: None})
        except TypeError as err:
            assert megatron_keyword in str(err)
        else:
            raise AssertionError(f"{megatron_keyword}= accepted by the native layer")
