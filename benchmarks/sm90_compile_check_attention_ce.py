"""Compile the attention and cross-entropy kernels for Hopper (sm_90) on a machine without a GPU.

The interpreter tests run the kernels' Python; they cannot see what only the compiler checks (types
of loop-carried values, layouts of tl.trans / tl.dot operands, shared-memory size). This script runs
Triton's full pipeline (TTIR → TTGIR → LLVM → PTX → cubin with the bundled ptxas) for one config of
each kernel per dtype path and prints the shared memory each needs. It checks compilation only,
not numerics or speed (benchmarks/gpu_check.py does those on a GPU).

    python3 benchmarks/sm90_compile_check_attention_ce.py     # minutes on 2 cores; cached reruns take seconds
"""
import importlib
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tpfuse.kernels import flash_attention_bwd as bwd
from tpfuse.kernels import flash_attention_fwd as fwd

ce = importlib.import_module("tpfuse.kernels.cross_entropy")  # the package binds the op's name
HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(kernel, pointer_types, constexprs, **options):
    """Compile ``kernel`` (jit or autotuned) with the given pointer / float argument types; ints default."""
    jit = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    signature = {name: "constexpr" if name in constexprs else pointer_types.get(name, "i32")
                 for name in jit.arg_names}
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn=jit, signature=signature, constexprs=constexprs),
                              target=HOPPER, options=options)
    print(f"{jit.__name__:24s} {str(constexprs):90s} {options} ok in {time.perf_counter() - start:4.1f}s, "
          f"shared memory {compiled.metadata.shared} B")


def attention_kernels(dtype, dot_f32, block_d, causal_values=(True, False)):
    io = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr",
                                         "dv_ptr")}
    io.update(lse_ptr="*fp32", delta_ptr="*fp32", qk_scale="fp32", softmax_scale="fp32")
    for causal in causal_values:
        common = dict(BLOCK_D=block_d, CAUSAL=causal, DOT_F32=dot_f32)
        compile_for_hopper(fwd._attn_fwd_kernel, io, dict(BLOCK_M=128, BLOCK_N=64, **common),
                           num_warps=8, num_stages=3)
        compile_for_hopper(bwd._attn_bwd_dkdv_kernel, io, dict(BLOCK_M=32, BLOCK_N=128, **common),
                           num_warps=4, num_stages=3)
        compile_for_hopper(bwd._attn_bwd_dq_kernel, io, dict(BLOCK_M=128, BLOCK_N=32, **common),
                           num_warps=4, num_stages=3)
    compile_for_hopper(bwd._attn_bwd_delta_kernel, {"o_ptr": f"*{dtype}", "do_ptr": f"*{dtype}",
                                                    "delta_ptr": "*fp32"}, dict(BLOCK_M=128, BLOCK_D=block_d),
                       num_warps=4)


def cross_entropy_kernels(dtype):
    io = {"logits_ptr": f"*{dtype}", "dlogits_ptr": f"*{dtype}", "target_ptr": "*i64"}
    io.update({name: "*fp32" for name in ("row_max_ptr", "sum_exp_ptr", "target_logit_ptr",
                                          "global_max_ptr", "global_sum_ptr", "grad_loss_ptr")})
    compile_for_hopper(ce._shard_stats_kernel, io, dict(BLOCK_V=2048), num_warps=8)
    compile_for_hopper(ce._shard_grad_kernel, io, dict(BLOCK_V=2048), num_warps=8)


if __name__ == "__main__":
    attention_kernels("bf16", dot_f32=False, block_d=128)
    attention_kernels("fp16", dot_f32=False, block_d=64, causal_values=(True,))
    # fp32 takes the ieee-dot path; at d = 128 it needs ~213-230 KB of shared memory (H100/H200 have
    # 228 KB per block; the autotuner prunes configs that do not fit) and compiles for minutes.
    attention_kernels("fp32", dot_f32=True, block_d=64, causal_values=(True,))
    for dtype in ("bf16", "fp32"):
        cross_entropy_kernels(dtype)
