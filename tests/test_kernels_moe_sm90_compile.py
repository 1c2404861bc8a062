"""The GPU path of the MoE kernels (grouped GEMM forward/dgrad and wgrad, token permutation),
compiled ahead of time for Hopper (sm_90) on this CPU machine, as test_kernels_sm90_compile.py
does for the dense kernels: the interpreter tests check the arithmetic, these check that the
compiled path builds (the group walk with its early return, runtime-bounded loops over a group's
rows, int64 row offsets) and that the grouped GEMM's Hopper configs use warp-group MMA.
"""
import pytest

from test_kernels_sm90_compile import compile_sm90
from tpfuse.kernels import grouped_gemm as gg
from tpfuse.kernels import moe_permute as mp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # triton's FP-fusion default notice


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    """Compile from source (a cached kernel would skip the front end)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        yield


def _ints(*names):
    return {n: "i32" for n in names}


def test_grouped_gemm_kernel_compiles_with_wgmma():
    config = gg._hopper_configs()[0]
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offsets_ptr": "*i32"}
    ints = _ints("G", "N", "K", "stride_xm", "stride_wg", "stride_wk", "stride_ym")
    constexprs = {"stride_xk": 1, "stride_wn": 1, "stride_yn": 1, "INPUT_PRECISION": "tf32",
                  "DOT_IN_FP32": False, **config.kwargs}
    ptx, _ = compile_sm90(gg._grouped_gemm_kernel, {**pointers, **ints}, constexprs,
                          div16=list(pointers) + ["N", "K", "stride_xm", "stride_wg",
                                                  "stride_wk", "stride_ym"],
                          num_warps=config.num_warps, num_stages=config.num_stages)
    assert "wgmma.mma_async" in ptx


def test_grouped_gemm_kernel_compiles_on_a_transposed_weight():
    """dgrad passes w.transpose(1, 2): the unit stride is on K, not N."""
    config = gg._hopper_configs()[1]
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offsets_ptr": "*i32",
             **_ints("G", "N", "K", "stride_xm", "stride_wg", "stride_wn", "stride_ym")}
    constexprs = {"stride_xk": 1, "stride_wk": 1, "stride_yn": 1, "INPUT_PRECISION": "tf32",
                  "DOT_IN_FP32": False, **config.kwargs}
    ptx, _ = compile_sm90(gg._grouped_gemm_kernel, types, constexprs,
                          num_warps=config.num_warps, num_stages=config.num_stages)
    assert "wgmma.mma_async" in ptx


def test_grouped_wgrad_kernel_compiles():
    config = gg._hopper_wgrad_configs()[0]
    types = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "dw_ptr": "*bf16", "offsets_ptr": "*i32",
             **_ints("N", "K", "stride_xm", "stride_dm", "stride_wg", "stride_wk")}
    constexprs = {"stride_xk": 1, "stride_dn": 1, "stride_wn": 1, "INPUT_PRECISION": "tf32",
                  "DOT_IN_FP32": False, **config.kwargs}
    ptx, _ = compile_sm90(gg._grouped_wgrad_kernel, types, constexprs,
                          div16=["x_ptr", "dy_ptr", "dw_ptr", "N", "K"],
                          num_warps=config.num_warps, num_stages=config.num_stages)
    assert "st.global" in ptx and "mma" in ptx


def test_permute_kernels_compile():
    topk = 2
    rows = {"rows_ptr": "*bf16", "map_ptr": "*i32"}
    common = {"TOPK": topk, "BLOCK_H": mp.GPU_BLOCK_H}
    permute, _ = compile_sm90(mp._permute_kernel,
                              {"x_ptr": "*bf16", **rows, **_ints("H", "stride_x", "stride_rows")},
                              common)
    unpermute, _ = compile_sm90(mp._unpermute_kernel,
                                {**rows, "probs_ptr": "*fp32", "y_ptr": "*bf16",
                                 **_ints("H", "stride_rows", "stride_y")},
                                {"HAS_PROBS": True, **common})
    backward, _ = compile_sm90(mp._unpermute_backward_kernel,
                               {"dy_ptr": "*bf16", **rows, "probs_ptr": "*fp32",
                                "drows_ptr": "*bf16", "dprobs_ptr": "*fp32",
                                **_ints("H", "stride_dy", "stride_rows")}, common)
    for ptx in (permute, unpermute, backward):
        assert "st.global" in ptx

