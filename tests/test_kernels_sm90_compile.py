"""The GPU path of matmul / layer_norm / rms_norm / bias_dropout_add, compiled ahead of time for
Hopper (sm_90) on this CPU machine: Triton lowers each kernel to PTX and assembles it with its
bundled ptxas, no GPU needed. The interpreter tests check the arithmetic; these check that the
compiled path builds (types, int64 offsets, loops with runtime bounds, epilogue branches) and that
the Hopper GEMM config really is what it claims: warp-group MMA (wgmma) and a software-pipelined
main loop whose shared memory holds ``num_stages`` copies of the A and B tiles.

Arguments are specialised as Triton's JIT does on a GPU: 16-byte aligned pointers, integers that are
multiples of 16 marked so, unit strides as constants.
"""
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tpfuse.kernels  # noqa: F401  (binds the ops; the modules are read from sys.modules)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),  # triton 3.9's FP-fusion default notice
              pytest.mark.filterwarnings("ignore:overflow encountered in exp")]  # interpreted σ(2u) → 0
SM90 = GPUTarget("cuda", 90, 32)


@pytest.fixture(scope="module", autouse=True)
def fresh_cache_after_interpreted_kernels(tmp_path_factory):
    """Compile from source (an empty Triton cache: a cached kernel would skip the front end), after
    interpreted launches in the same process whose nested @triton.jit helpers (ours and tl.rand /
    tl.sigmoid / tl.cdiv) must leave triton.language fit for compiling."""
    import torch

    from tpfuse.kernels import bias_dropout_add, matmul
    x = torch.randn(5, 16)
    matmul(x, torch.randn(16, 7), torch.randn(7), "gelu_tanh", backend="triton")
    bias_dropout_add(x, None, x, 0.5, True, seed=1, backend="triton")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        yield


def _module(name):
    return sys.modules[f"tpfuse.kernels.{name}"]


def compile_sm90(kernel, types, constexprs, div16=(), num_warps=4, num_stages=3):
    """PTX and metadata of ``kernel`` (a @triton.jit or @triton.autotune kernel) for sm_90."""
    jit = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    names = jit.arg_names
    assert set(types) | set(constexprs) == set(names), set(names) ^ (set(types) | set(constexprs))
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    source = ASTSource(fn=jit, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
    compiled = triton.compile(source, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"], compiled.metadata


def _matmul(activation, has_bias, a_transposed, config):
    mm = _module("matmul")
    pointers = {n: "*bf16" for n in ("a_ptr", "b_ptr", "bias_ptr", "y_ptr", "z_ptr")}
    ints = {n: "i32" for n in ("M", "N", "K", "stride_bk", "stride_ym", "stride_ak" if a_transposed else "stride_am")}
    unit = {"stride_am" if a_transposed else "stride_ak": 1, "stride_bn": 1, "stride_yn": 1}
    constexprs = dict(unit, HAS_BIAS=has_bias, ACTIVATION=activation, SAVE_PREACT=activation in (1, 2),
                      INPUT_PRECISION="tf32", DOT_IN_FP32=False, **config.kwargs)
    return compile_sm90(mm._matmul_kernel, {**pointers, **ints}, constexprs, div16=list(pointers) + list(ints),
                        num_warps=config.num_warps, num_stages=config.num_stages)


def test_matmul_hopper_config_uses_wgmma_and_a_pipelined_main_loop():
    mm = _module("matmul")
    config = mm._hopper_configs()[0]
    block_m, block_n, block_k = (config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    assert (block_m, block_n, block_k, config.num_warps) == (128, 256, 64, 8) and config.num_stages in (3, 4)
    ptx, meta = _matmul(activation=0, has_bias=False, a_transposed=False, config=config)
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    tile_bytes = (block_m * block_k + block_k * block_n) * 2  # bf16 A and B tiles
    assert meta.shared == config.num_stages * tile_bytes


@pytest.mark.parametrize("activation,has_bias,a_transposed", [(1, True, True), (2, True, False), (3, False, False)])
def test_matmul_epilogues_and_transposed_operand_compile(activation, has_bias, a_transposed):
    ptx, _ = _matmul(activation, has_bias, a_transposed, _module("matmul")._hopper_configs()[3])
    assert "wgmma.mma_async" in ptx


@pytest.mark.parametrize("activation", [1, 2, 3])
def test_activation_grad_kernel_compiles(activation):
    ptx, _ = compile_sm90(_module("matmul")._activation_grad_kernel,
                          {"dy_ptr": "*bf16", "saved_ptr": "*bf16", "g_ptr": "*bf16", "n_elements": "i32"},
                          {"ACTIVATION": activation, "BLOCK": 1024}, div16=["dy_ptr", "saved_ptr", "g_ptr"])
    assert "st.global" in ptx


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_kernels_compile(kind):
    module = _module(kind)
    prefix = "_layer_norm" if kind == "layer_norm" else "_rms_norm"
    launch = module.row_launch_params(4096, 2, is_cuda=True)  # (rows, 4096) bf16
    fwd_types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32",
                 "stride_x": "i32", "stride_y": "i32", "N": "i32", "eps": "fp32"}
    bwd_types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "dy_ptr": "*bf16", "dx_ptr": "*bf16", "rstd_ptr": "*fp32",
                 "dw_part_ptr": "*fp32", "stride_x": "i32", "stride_dy": "i32", "stride_dx": "i32", "M": "i32",
                 "N": "i32", "rows_per_program": "i32"}
    fwd_const = {"BLOCK_N": launch["BLOCK_N"], "ONE_BLOCK": True}
    if kind == "layer_norm":
        fwd_types.update(b_ptr="*bf16", mean_ptr="*fp32")
        bwd_types.update(mean_ptr="*fp32", db_part_ptr="*fp32")
        fwd_const["HAS_BIAS"] = True
    fwd_ptx, _ = compile_sm90(getattr(module, f"{prefix}_fwd_kernel"), fwd_types, fwd_const,
                              div16=[n for n in fwd_types if n.endswith("_ptr")], num_warps=launch["num_warps"])
    bwd_ptx, _ = compile_sm90(getattr(module, f"{prefix}_bwd_kernel"), bwd_types, {"BLOCK_N": launch["BLOCK_N"]},
                              div16=[n for n in bwd_types if n.endswith("_ptr")], num_warps=launch["num_warps"])
    assert "st.global" in fwd_ptx and "st.global" in bwd_ptx


def test_bias_dropout_add_kernels_compile():
    module = _module("bias_dropout_add")
    tile = module.tile_params(4096, is_cuda=True)
    consts = {"BLOCK_R": tile["BLOCK_R"], "BLOCK_Q": tile["BLOCK_Q"]}
    fwd_ptx, _ = compile_sm90(module._bias_dropout_add_fwd_kernel,
                              {"x_ptr": "*bf16", "bias_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
                               "n_rows": "i32", "hidden": "i32", "stride_x": "i32", "stride_res": "i32",
                               "stride_out": "i32", "p": "fp32", "scale": "fp32", "seed": "i32"},
                              {"HAS_BIAS": True, "DROPOUT": True, **consts},
                              div16=["x_ptr", "bias_ptr", "res_ptr", "out_ptr", "hidden", "stride_x",
                                     "stride_res", "stride_out"], num_warps=tile["num_warps"])
    bwd_ptx, _ = compile_sm90(module._dropout_bwd_kernel,
                              {"dy_ptr": "*bf16", "dx_ptr": "*bf16", "n_rows": "i32", "hidden": "i32",
                               "stride_dy": "i32", "stride_dx": "i32", "p": "fp32", "scale": "fp32", "seed": "i32"},
                              consts, div16=["dy_ptr", "dx_ptr", "hidden", "stride_dy", "stride_dx"],
                              num_warps=tile["num_warps"])
    assert "st.global" in fwd_ptx and "st.global" in bwd_ptx
