"""Gradient-accumulation fusion: the wgrad kernel / torch path vs float64, accumulation into
``main_grad`` over several micro-batches (plain linear layers and the ring comm-GEMMs), and what
autograd is handed.

Tolerance (fp32 accumulation of K products, standard GEMM bound): |fl(Σ) − Σ| ≤ K·u32·Σ|g||x|
per GEMM, plus for a 16-bit accumulator one rounding u16·|out| per accumulation; the bound below
doubles that. bf16/fp16 *operands* are exact in fp32, so the reference multiplies the same 16-bit
values in float64.
"""
import pytest
import torch
import torch.distributed as dist

from tpfuse.kernels.wgrad import (accumulate_wgrad, linear_with_grad_accumulation, new_wgrad,
                                  weight_grad, wgrad_reference)

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _bound(g, x, out_dtype, expected, accumulations=1):
    magnitude = wgrad_reference(g.abs(), x.abs())
    rows = g.reshape(-1, g.shape[-1]).shape[0]
    term = rows * U[torch.float32] * magnitude * accumulations
    if out_dtype != torch.float32:
        term = term + accumulations * U[out_dtype] * expected.abs()
    return 2 * term + 1e-30


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32),
                                              (torch.float16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_accumulate_wgrad_adds_g_transpose_x_to_out(backend, dtype, out_dtype):
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(3, 13, 37, generator=gen).to(dtype)          # (s, b, n), rows 39
    x = torch.randn(3, 13, 29, generator=gen).to(dtype)          # (s, b, k)
    out = torch.randn(37, 29, generator=gen).to(out_dtype)       # what main_grad held before
    expected = out.double() + wgrad_reference(g, x)
    accumulate_wgrad(out, g, x, backend=backend)
    err = (out.double() - expected).abs()
    assert (err <= _bound(g, x, out_dtype, expected)).all(), err.max()


def test_accumulate_wgrad_reads_transposed_operands_through_strides():
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(37, 40, generator=gen).t()                   # (40, 37) non-contiguous
    x = torch.randn(29, 40, generator=gen).t()                   # (40, 29) non-contiguous
    for backend in ("torch", "triton"):
        out = torch.zeros(37, 29)
        accumulate_wgrad(out, g, x, backend=backend)
        torch.testing.assert_close(out.double(), wgrad_reference(g, x), rtol=0, atol=1e-4)


@pytest.mark.parametrize("n, k", [(32, 64), (32, 29), (37, 64)])
@pytest.mark.parametrize("transposed", [False, True])
def test_accumulate_wgrad_whole_and_ragged_tiles(n, k, transposed):
    """The kernel's (n, k) tiles whole (indices with contiguity hints) or ragged (clamped) in each
    dim, interpreter tiles BLOCK_N 16, BLOCK_K 32; operands row-major or read through transposes."""
    gen = torch.Generator().manual_seed(3)
    rows = 40
    if transposed:
        g = torch.randn(n, rows, generator=gen).bfloat16().t()      # (rows, n), unit stride along rows
        x = torch.randn(k, rows, generator=gen).bfloat16().t()
    else:
        g = torch.randn(rows, n, generator=gen).bfloat16()
        x = torch.randn(rows, k, generator=gen).bfloat16()
    out = torch.randn(n, k, generator=gen)
    expected = out.double() + wgrad_reference(g, x)
    accumulate_wgrad(out, g, x, backend="triton")
    err = (out.double() - expected).abs()
    assert (err <= _bound(g, x, torch.float32, expected)).all(), err.max()


def test_accumulate_wgrad_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="accumulate_wgrad"):
        accumulate_wgrad(torch.zeros(5, 4), torch.zeros(3, 5), torch.zeros(3, 7))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_wgrad_is_g_transpose_x_in_fp32(backend, dtype):
    """Without a buffer to accumulate into: a new fp32 (n, k), the fp64 gᵀ·x within one
    accumulation's bound (the torch path's single mm and the kernel's zero-started sum alike)."""
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(3, 13, 37, generator=gen).to(dtype)          # (s, b, n), rows 39
    x = torch.randn(3, 13, 29, generator=gen).to(dtype)          # (s, b, k)
    expected = wgrad_reference(g, x)
    dw = new_wgrad(g, x, backend=backend)
    assert dw.dtype == torch.float32 and dw.shape == (37, 29)
    err = (dw.double() - expected).abs()
    assert (err <= _bound(g, x, torch.float32, expected)).all(), err.max()
    with pytest.raises(ValueError, match="new_wgrad"):
        new_wgrad(g, x[:2], backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grad_equals_fp64_sum_over_micro_batches(backend, dtype):
    """Four micro-batches through one linear layer accumulate into an fp32 main_grad: equal to the
    float64 sum of dyᵀx (bound: the sum of the four GEMM bounds); autograd receives None for the
    weight (no 16-bit wgrad tensor), yet the weight's AccumulateGrad node runs once per backward
    (what the data-parallel hooks count)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=gen).to(dtype))
    bias = torch.nn.Parameter(torch.zeros(24).to(dtype))
    weight.main_grad = torch.zeros(24, 16)
    node = weight.expand_as(weight).grad_fn.next_functions[0][0]
    fired = []
    node.register_hook(lambda *unused: fired.append(weight.grad))
    expected = torch.zeros(24, 16, dtype=torch.float64)
    bound = torch.zeros(24, 16, dtype=torch.float64)
    for _ in range(4):
        x = torch.randn(5, 3, 16, generator=gen).to(dtype).requires_grad_()
        dy = torch.randn(5, 3, 24, generator=gen).to(dtype)
        linear_with_grad_accumulation(x, weight, bias, backend=backend).backward(dy)
        step = wgrad_reference(dy, x.detach())
        expected += step
        bound += _bound(dy, x.detach(), torch.float32, step)
    assert fired == [None] * 4 and weight.grad is None
    assert bias.grad is not None                     # the bias still goes through autograd
    err = (weight.main_grad.double() - expected).abs()
    assert (err <= bound).all(), err.max()


@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh", "relu"])
def test_linear_matches_matmul_without_main_grad(activation):
    """Without main_grad the op is ``matmul(x, wᵀ, bias, act)``: same forward paths, and the
    gradients agree (the weight gradient summed in fp32 either way)."""
    from tpfuse.kernels import matmul
    gen = torch.Generator().manual_seed(6)
    leaves = [torch.randn(4, 3, 16, generator=gen), torch.randn(8, 16, generator=gen),
              torch.randn(8, generator=gen)]
    leaves = [t.requires_grad_() for t in leaves]
    dy = torch.randn(4, 3, 8, generator=gen)
    ours = linear_with_grad_accumulation(*leaves, activation)
    theirs = matmul(leaves[0], leaves[1].t(), leaves[2], activation)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(ours, leaves, dy), torch.autograd.grad(theirs, leaves, dy)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_without_main_grad_autograd_gets_the_weight_gradient_in_its_dtype():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 8, generator=gen)
    weight = torch.randn(5, 8, generator=gen)
    g = torch.randn(6, 5, generator=gen)
    dw = weight_grad(weight.to(torch.bfloat16), g.to(torch.bfloat16), x.to(torch.bfloat16))
    assert dw.dtype == torch.bfloat16
    reference = wgrad_reference(g.to(torch.bfloat16), x.to(torch.bfloat16))
    torch.testing.assert_close(dw.double(), reference, rtol=2**-8, atol=1e-3)


# ----------------------------------------------------------------------------- ring comm-GEMMs
def ring_worker():
    """Both fused ring paths (forced with min FLOPs 0) accumulate their chunk-wise weight
    gradients into main_grad over two micro-batches; reference: fp64 gᵀ·x_full per micro-batch."""
    from tpfuse.kernels import all_gather_matmul, matmul_reduce_scatter
    from tpfuse.parallel.comm_options import CommOptions

    group, tp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(5)                        # same tensors on every rank
    w_ag = torch.nn.Parameter(torch.randn(6, 8, generator=gen))   # (n_local, h)
    w_rs = torch.nn.Parameter(torch.randn(8, 6, generator=gen))   # (n, k_local)
    for w in (w_ag, w_rs):
        w.main_grad = torch.zeros(w.shape)
    expected_ag = torch.zeros(6, 8, dtype=torch.float64)
    expected_rs = torch.zeros(8, 6, dtype=torch.float64)
    fused = CommOptions(fused_min_flops=0)
    for _ in range(2):
        x_full = torch.randn(4 * tp, 2, 8, generator=gen)      # (s, b, h)
        dy = torch.randn(4 * tp, 2, 6, generator=gen)
        x_shard = x_full[rank * 4:(rank + 1) * 4].clone().requires_grad_()
        all_gather_matmul(x_shard, w_ag, group, options=fused).backward(dy)
        expected_ag += wgrad_reference(dy, x_full)
        x_rs = torch.randn(4 * tp, 2, 6, generator=gen).requires_grad_()
        dy_full = torch.randn(4 * tp, 2, 8, generator=gen)
        matmul_reduce_scatter(x_rs, w_rs, group, options=fused).backward(
            dy_full[rank * 4:(rank + 1) * 4])
        expected_rs += wgrad_reference(dy_full, x_rs.detach())
    return [(w.grad is None, (w.main_grad.double() - e).abs().max().item())
            for w, e in ((w_ag, expected_ag), (w_rs, expected_rs))]


def test_ring_comm_gemms_accumulate_into_main_grad(run_distributed):
    for rank_result in run_distributed(2, ring_worker):
        for grad_is_none, err in rank_result:
            assert grad_is_none
            assert err < 1e-4       # 2 micro-batches of 16-row fp32 GEMMs of O(1) values


@pytest.mark.filterwarnings("ignore::UserWarning")     # triton 3.9's FP-fusion default notice
def test_wgrad_kernel_compiles_for_sm90():
    triton = pytest.importorskip("triton")
    from tpfuse.kernels.sm90_report import compile_sm90

    from tpfuse.kernels import wgrad
    config = wgrad._hopper_configs()[0]
    constexprs = dict(stride_gn=1, stride_xk=1, stride_ok=1, INPUT_PRECISION="tf32",
                      DOT_IN_FP32=False, EVEN_N=False, EVEN_K=False, **config.kwargs)
    ptx, _ = compile_sm90(wgrad._wgrad_accumulate_kernel, constexprs, config.num_warps,
                          config.num_stages, types={"out_ptr": "*fp32"})
    assert triton is not None and "wgmma.mma_async" in ptx and "ld.global" in ptx
