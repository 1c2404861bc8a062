"""What ``sm90_report.py`` compiles: per kernel, the configurations its launcher or autotuner can
run on an H100/H200, at the specialisation of the training shapes (bf16, aligned, ragged edges).

Kernels launched with an autotuner and no spec here are compiled generically: every config, the
argument types inferred from names (``infer_signature``) and the constexprs that are not tile
sizes taken from ``GENERIC_CONSTEXPRS``. Launched kernels are the ``@triton.jit`` functions whose
name ends in ``_kernel`` (helpers do not): ``discover_kernels`` finds them in every
``tpfuse.kernels`` module.

A case is ``(report name, config text, kernel, constexprs, warps, stages, dtype, types)``:
``sm90_report.py`` compiles each one and reports what ptxas says.
"""
from __future__ import annotations

import importlib
import pkgutil

import triton

FP32_POINTERS = ("lse", "delta", "mean", "rstd", "row_max", "sum_exp", "target_logit", "global_max",
                 "global_sum", "loss", "dw_part", "db_part", "c1_", "c2_", "main_grad", "acc_")
INT_POINTERS = {"target_ptr": "*i64", "flags_ptr": "*i32", "bad_target_ptr": "*i32", "a_ptrs": "*i64", "flag_ptrs": "*i64"}
FLOAT_SCALARS = ("eps", "scale", "p", "softmax_scale", "qk_scale", "sm_scale")
RAGGED_INTS = ("seed", "epoch", "rank", "tp", "vocab_start", "ignore_index", "rows_per_program", "p",
               "first_key", "last_key")
GENERIC_CONSTEXPRS = {"DOT_IN_FP32": False, "INPUT_PRECISION": "tf32", "HAS_BIAS": True, "ACTIVATION": 1}
NUM_SMS = 132  # H100 SXM / H200


# ----------------------------------------------------------------------------- the kernels

def jit_function(kernel):
    """The ``triton.runtime.JITFunction`` under an autotuner / heuristics wrapper (or itself)."""
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


def qualified_name(kernel):
    """``<module>.<function>`` of a kernel, as the report names an uncovered one."""
    jit = jit_function(kernel)
    return f"{jit.fn.__module__.rsplit('.', 1)[-1]}.{jit.__name__}"


def discover_kernels():
    """{qualified name: kernel object} for every Triton kernel defined in tpfuse.kernels."""
    import tpfuse.kernels as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"tpfuse.kernels.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, triton.runtime.KernelInterface) and \
                    jit_function(value).__name__.endswith("_kernel") and \
                    getattr(jit_function(value).fn, "__module__", None) == module.__name__:
                found.setdefault(f"{info.name}.{jit_function(value).__name__}", value)
    return found


def autotuned_configs(kernel, example_args=None):
    """The configs an autotuned kernel can run (after its early_config_prune when given args)."""
    configs = list(kernel.configs)
    prune = getattr(kernel, "early_config_prune", None)
    if prune is not None and example_args is not None:
        configs = list(prune(configs, example_args))
    return configs


# ----------------------------------------------------------------------------- the specialisation

def argument_type(name, dtype="bf16"):
    """The Triton type of a non-constexpr argument, from its name."""
    if name in INT_POINTERS:
        return INT_POINTERS[name]
    if name.endswith(("_ptr", "_ptrs")):
        return "*fp32" if any(token in name for token in FP32_POINTERS) else f"*{dtype}"
    if name in FLOAT_SCALARS or name.endswith("_scale"):
        return "fp32"
    return "i32"


def infer_signature(kernel, constexprs, dtype="bf16", types=None):
    """Triton signature for ``kernel``: pointer / scalar types from argument names (overridden by
    ``types``), constexpr values from ``constexprs``; raises KeyError for an unknown constexpr."""
    jit = jit_function(kernel)
    types = types or {}
    signature, attrs = {}, {}
    for index, param in enumerate(jit.params):
        name = param.name
        if param.is_constexpr or name in constexprs:  # constexpr, or specialised (e.g. stride 1)
            if name not in constexprs:
                raise KeyError(f"{jit.__name__}: no value for constexpr {name}")
            signature[name] = "constexpr"
            continue
        kind = types.get(name) or argument_type(name, dtype)
        signature[name] = kind
        if kind.startswith("*") or (kind == "i32" and name not in RAGGED_INTS):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


# ----------------------------------------------------------------------------- the cases

def config_text(meta, num_warps, num_stages):
    """A case's config column: the tile sizes, then warps and stages."""
    shown = ", ".join(f"{k}={v}" for k, v in meta.items())
    return f"{shown}, warps={num_warps}, stages={num_stages}"


def _module(name):
    return importlib.import_module(f"tpfuse.kernels.{name}")


def _case(name, kernel, meta, warps, stages, extra=None, dtype="bf16", types=None, label=None):
    constexprs = dict(meta, **(extra or {}))
    text = label or config_text(meta, warps, stages)
    return (name, text, kernel, constexprs, warps, stages, dtype, types)


def matmul_cases():
    mk = _module("matmul_kernels")
    gelu_z = {"HAS_BIAS": True, "ACTIVATION": 1, "SAVE_PREACT": True}
    plain = {"HAS_BIAS": False, "ACTIVATION": 0, "SAVE_PREACT": False}
    out = []
    # pointer kernel: the linear forward (bias+gelu+z, b = wᵀ, ragged edges) for every config, and
    # the weight-gradient layout (a transposed: unit stride along M, full tiles) for every config
    for dtype, shapes, precision in (("bf16", mk.POINTER_SHAPES, "tf32"),
                                     ("fp32", mk.POINTER_SHAPES_FP32, "tf32")):
        for config in mk.make_configs(shapes):
            split = config.kwargs["BLOCK_N"] >= 256
            for label, epilogue, layout in (("fwd bias+gelu", gelu_z, {"stride_ak": 1, "stride_yn": 1,
                                                                        "stride_bk": 1, "A_ROW_MAJOR": True,
                                                                        "B_ROW_MAJOR": False,
                                                                        "EVEN_M": False, "EVEN_N": False}),
                                            ("wgrad aᵀ", plain, {"stride_am": 1, "stride_bn": 1, "stride_yn": 1,
                                                                 "A_ROW_MAJOR": False, "B_ROW_MAJOR": True,
                                                                 "EVEN_M": True, "EVEN_N": True}),
                                            ("wgrad aᵀ ragged", plain, {"stride_am": 1, "stride_bn": 1,
                                                                        "stride_yn": 1, "A_ROW_MAJOR": False,
                                                                        "B_ROW_MAJOR": True,
                                                                        "EVEN_M": False, "EVEN_N": False})):
                if dtype == "fp32" and label.startswith("wgrad"):
                    continue
                extra = dict(epilogue, **layout, INPUT_PRECISION=precision, DOT_IN_FP32=False,
                             EPILOGUE_SPLIT=split)
                text = f"{label} {dtype}: " + _tiles(config)
                out.append(_case("matmul (pointer)", mk._matmul_kernel, config.kwargs, config.num_warps,
                                 config.num_stages, extra, dtype=dtype, label=text))
    # TMA kernel: every config with the forward epilogue; every layout at the largest tile
    for index, config in enumerate(mk.make_configs(mk.TMA_SHAPES)):
        layouts = [(True, False)] if index else [(True, False), (False, True), (True, True), (False, False)]
        for a_row, b_row in layouts:
            bm, bn, bk = (config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            types = {"a_desc": f"tensordesc<bf16[{bm}, {bk}]>" if a_row else f"tensordesc<bf16[{bk}, {bm}]>",
                     "b_desc": f"tensordesc<bf16[{bk}, {bn}]>" if b_row else f"tensordesc<bf16[{bn}, {bk}]>"}
            epilogue = gelu_z if (a_row, b_row) == (True, False) else plain
            extra = dict(epilogue, A_ROW_MAJOR=a_row, B_ROW_MAJOR=b_row, DOT_IN_FP32=False, NUM_SMS=NUM_SMS,
                         EPILOGUE_SPLIT=bn >= 256, stride_yn=1)
            kind = "bias+gelu" if epilogue is gelu_z else "plain"
            text = f"a {'row' if a_row else 'col'}-major, b {'row' if b_row else 'col'}-major, {kind}: " + _tiles(config)
            out.append(_case("matmul (TMA, persistent)", mk._matmul_tma_kernel, config.kwargs, config.num_warps,
                             config.num_stages, extra, types=types, label=text))
    for act in (1, 2, 3):
        out.append(_case("matmul activation grad", mk._activation_grad_kernel, {"ACTIVATION": act, "BLOCK": 1024},
                         4, 3))
    return out


def _tiles(config):
    k = config.kwargs
    return (f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']}, warps={config.num_warps}, "
            f"stages={config.num_stages}")


def norm_cases():
    out = []
    ln, rms = _module("layer_norm"), _module("rms_norm")
    for width in (1024, 4096, 8192, 16384, 65536):
        fwd = ln.row_launch_params(width, 2, is_cuda=True)
        bwd = ln.row_launch_params(width, 2, is_cuda=True, backward=True)
        one_fwd, one_bwd = fwd["BLOCK_N"] >= width, bwd["BLOCK_N"] >= width
        meta_f = {"BLOCK_N": fwd["BLOCK_N"], "ONE_BLOCK": one_fwd}
        meta_b = {"BLOCK_N": bwd["BLOCK_N"], "NUM_STAGES": bwd["NUM_STAGES"]}
        tag = f"width {width}"
        for name, module, prefix, has_bias in (("layer_norm", ln, "_layer_norm", {"HAS_BIAS": True}),
                                               ("rms_norm", rms, "_rms_norm", {})):
            out.append(_case(f"{name} fwd", getattr(module, f"{prefix}_fwd_kernel"), meta_f, fwd["num_warps"], 3,
                             dict(has_bias), label=f"{tag}: BLOCK_N={meta_f['BLOCK_N']}, one block={one_fwd}, "
                                                   f"warps={fwd['num_warps']}"))
            kernels = ([f"{prefix}_bwd_kernel"] if one_bwd else
                       [f"{prefix}_bwd_row_sums_kernel", f"{prefix}_bwd_chunk_kernel"])
            for kernel in kernels:
                out.append(_case(f"{name} {kernel.replace(prefix + '_', '').replace('_kernel', '')}",
                                 getattr(module, kernel), meta_b, bwd["num_warps"], 3,
                                 label=f"{tag}: BLOCK_N={meta_b['BLOCK_N']}, warps={bwd['num_warps']}, "
                                       f"row stages={meta_b['NUM_STAGES']}"))
    return out


def elementwise_cases():
    out = []
    ce = _module("cross_entropy")
    for kernel, extra in ((ce._shard_stats_kernel, {"WRITE_LOSS": True}), (ce._shard_grad_kernel, None)):
        for config in kernel.configs:
            out.append(_case(f"cross_entropy {kernel.fn.__name__}", kernel, config.kwargs, config.num_warps,
                             config.num_stages, extra))
    bda = _module("bias_dropout_add")
    tile = bda.tile_params(4096, is_cuda=True)
    meta = {"BLOCK_R": tile["BLOCK_R"], "BLOCK_Q": tile["BLOCK_Q"]}
    coords = {"pos_ptr": "*i32", "sample_ptr": "*i32", "key": "i64"}
    for layout_invariant in (False, True):   # seeded by element index / by global coordinates
        label = f"{'coordinates' if layout_invariant else 'seed'}: BLOCK_R={meta['BLOCK_R']}, BLOCK_Q={meta['BLOCK_Q']}"
        out.append(_case("bias_dropout_add fwd", bda._bias_dropout_add_fwd_kernel, meta, tile["num_warps"], 3,
                         {"HAS_BIAS": True, "DROPOUT": True, "COORDS": layout_invariant}, types=coords,
                         label=label))
        out.append(_case("bias_dropout_add bwd", bda._dropout_bwd_kernel, meta, tile["num_warps"], 3,
                         {"COORDS": layout_invariant}, types=coords, label=label))
    return out


def _example_args(kernel, constexprs):
    """Named arguments an ``early_config_prune`` may read: bf16 / fp32 one-element tensors for
    pointers (dtype only), training-size integers, the constexprs."""
    import torch

    args = {}
    for name in kernel.fn.arg_names:
        kind = argument_type(name)
        if kind.startswith("*"):
            dtype = {"*fp32": torch.float32, "*i64": torch.int64, "*i32": torch.int32}.get(kind, torch.bfloat16)
            args[name] = torch.empty(1, dtype=dtype)
        else:
            args[name] = constexprs.get(name, 4096)
    return args


def generic_cases(covered):
    """Autotuned kernels without a spec above: every config that survives the kernel's own
    ``early_config_prune`` (if any), GENERIC_CONSTEXPRS for the rest."""
    out = []
    for name, kernel in sorted(discover_kernels().items()):
        if name in covered or not isinstance(kernel, triton.runtime.Autotuner):
            continue
        extra = {k: v for k, v in GENERIC_CONSTEXPRS.items() if k in kernel.fn.arg_names}
        for config in autotuned_configs(kernel, _example_args(kernel, extra)):
            out.append(_case(name, kernel, config.kwargs, config.num_warps, config.num_stages,
                             {k: v for k, v in extra.items() if k not in config.kwargs}))
    return out


def attention_cases():
    """flash attention (bf16), every config the kernels' early_config_prune keeps: all kernels through
    TMA descriptors (Hopper, aligned strides) with the causal mask at d = 128; the forward and the dK/dV
    kernel (the most registers) with every mask rule on (documents + window) and through pointer loads
    (unaligned strides) at d = 128, and the dK/dV kernel at d = 64 (where its 64×128 tiles fit)."""
    import torch

    fwd, bwd = _module("flash_attention_fwd"), _module("flash_attention_bwd")
    ids = {name: "*i32" for name in ("q_ids_ptr", "k_ids_ptr", "start_ptr", "end_ptr", "exact_ptr")}
    kernels = (("flash_attention fwd", fwd._attn_fwd_kernel, {}, fwd.FWD_TMA_ROWS),
               ("flash_attention bwd dK/dV + atomic dQ", bwd._attn_bwd_dkdv_kernel, {"ATOMIC_DQ": True},
                bwd.BWD_TMA_ROWS),
               ("flash_attention bwd dK/dV (deterministic)", bwd._attn_bwd_dkdv_kernel, {"ATOMIC_DQ": False},
                bwd.BWD_TMA_ROWS),
               ("flash_attention bwd dQ (deterministic)", bwd._attn_bwd_dq_kernel, {}, bwd.BWD_TMA_ROWS))
    causal = {"CAUSAL": True, "WINDOW": False, "DOCS": False}
    every_rule = {"CAUSAL": True, "WINDOW": True, "DOCS": True}
    out = []
    dropout = dict(causal, DROPOUT=True)
    for label, masks, tma, head_dim, which in (("causal, TMA", causal, True, 128, kernels),
                                               ("causal, TMA", causal, True, 64, kernels[1:2]),
                                               ("documents+window, TMA", every_rule, True, 128, kernels[:2]),
                                               ("causal, pointers", causal, False, 128, kernels[:2]),
                                               ("causal + dropout, TMA", dropout, True, 128, kernels)):
        for name, kernel, extra, tma_rows in which:
            constexprs = dict({"DROPOUT": False}, **masks, **extra, HEAD_DIM=head_dim, BLOCK_D=head_dim,
                              DOT_PRECISION=0, USE_TMA=tma)
            example = {"q_ptr": torch.empty(1, dtype=torch.bfloat16)}
            for config in kernel.early_config_prune(kernel.configs, example, **constexprs):
                types = dict(ids, dq_ptr="*fp32" if extra.get("ATOMIC_DQ") else "*bf16", drop_key="i64")
                if tma:
                    types.update({arg: f"tensordesc<bf16[1, 1, {config.kwargs[rows]}, {head_dim}]>"
                                  for arg, rows in tma_rows.items()})
                tiles = f"BLOCK_M={config.kwargs['BLOCK_M']}, BLOCK_N={config.kwargs['BLOCK_N']}"
                out.append(_case(name, kernel, config.kwargs, config.num_warps, config.num_stages, constexprs,
                                 types=types, label=f"{label}, d={head_dim}: {tiles}, warps={config.num_warps}, "
                                                    f"stages={config.num_stages}"))
    out.append(_case("flash_attention bwd δ = rowsum(dO ⊙ O)", bwd._attn_bwd_delta_kernel,
                     {"BLOCK_M": 64, "BLOCK_D": 128, "HEAD_DIM": 128}, 4, 3))
    return out


def decode_cases():
    """Flash-decoding (bf16, pointer loads, the launcher's GPU tile): the split kernel at d = 64 and 128
    with the causal mask and with every rule, with the smallest and the largest head tile (16 and
    MAX_BLOCK_H rows); the merge kernel at its largest split count."""
    dec = _module("flash_attention_decode")
    meta = {k: v for k, v in dec.GPU_META.items() if k.startswith("BLOCK")}
    warps, stages = dec.GPU_META["num_warps"], dec.GPU_META["num_stages"]
    ids = {name: "*i32" for name in ("q_ids_ptr", "k_ids_ptr", "start_ptr", "end_ptr")}
    out = []
    for label, masks in (("causal", {"CAUSAL": True, "WINDOW": False, "DOCS": False}),
                         ("documents+window", {"CAUSAL": True, "WINDOW": True, "DOCS": True})):
        for head_dim in (64, 128):
            for block_h in (16, dec.MAX_BLOCK_H):
                constexprs = dict(masks, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_H=block_h, DOT_PRECISION=0)
                out.append(_case("flash_attention decode split", dec._attn_decode_split_kernel, meta, warps,
                                 stages, constexprs, types=dict(ids, o_part_ptr="*fp32"),
                                 label=f"{label}, d={head_dim}: BLOCK_H={block_h}, BLOCK_N={meta['BLOCK_N']}, "
                                       f"warps={warps}, stages={stages}"))
    merge = {"HEAD_DIM": 128, "BLOCK_S": dec.MAX_SPLITS, "BLOCK_D": 128}
    out.append(_case("flash_attention decode merge", dec._attn_decode_merge_kernel, merge, 4, 3,
                     types={"o_part_ptr": "*fp32"}))
    return out


def special_cases():
    """Kernels launched with fixed meta-parameters by their launchers."""
    out = attention_cases()
    out.extend(decode_cases())
    out.extend(symm_mem_cases())
    out.extend(wgrad_cases())
    out.extend(moe_cases())
    return out


EDGES = (("full tiles", True), ("ragged edges", False))   # EVEN_* of tile_indices: both can run


def _even(dims, even):
    return {f"EVEN_{d}": even for d in dims}


def wgrad_cases():
    """The fp32 weight-gradient accumulation into main_grad (bf16 g and x, fp32 out), every config
    with full and with ragged (n, k) tiles."""
    wg = _module("wgrad")
    kernel = wg._wgrad_accumulate_kernel
    units = {"stride_gn": 1, "stride_xk": 1, "stride_ok": 1}
    return [_case("wgrad accumulate into fp32 main_grad", kernel, config.kwargs, config.num_warps,
                  config.num_stages, dict(units, INPUT_PRECISION="tf32", DOT_IN_FP32=False,
                                          **_even("NK", even)),
                  types={"out_ptr": "*fp32"}, label=f"{edges}: " + config_text_of(config))
            for config in kernel.configs for edges, even in EDGES]


def config_text_of(config):
    return config_text(config.kwargs, config.num_warps, config.num_stages)


def moe_cases():
    """Grouped GEMM (forward, the dgrad layout on one config, wgrad) and token permutation at the
    MoE training shapes (int32 group offsets, int64 row maps from torch.topk, fp32 probabilities,
    top-8 routing)."""
    gg, mp = _module("grouped_gemm"), _module("moe_permute")
    precision = {"INPUT_PRECISION": "tf32", "DOT_IN_FP32": False}
    ints = {"offsets_ptr": "*i32"}
    out = []
    fwd = {"stride_xk": 1, "stride_wn": 1, "stride_yn": 1}
    for index, config in enumerate(gg._grouped_gemm_kernel.configs):
        layouts = [(f"fwd, {edges}", fwd, even) for edges, even in EDGES]
        if index == 0:
            layouts.append(("dgrad wᵀ", {"stride_xk": 1, "stride_wk": 1, "stride_yn": 1}, True))
        for label, units, even in layouts:
            out.append(_case("grouped_gemm", gg._grouped_gemm_kernel, config.kwargs,
                             config.num_warps, config.num_stages,
                             dict(units, **precision, **_even("N", even)),
                             types=ints, label=f"{label}: " + _tiles(config)))
    for config in gg._grouped_wgrad_kernel.configs:
        for edges, even in EDGES:
            out.append(_case("grouped_gemm wgrad", gg._grouped_wgrad_kernel, config.kwargs,
                             config.num_warps, config.num_stages,
                             dict({"stride_xk": 1, "stride_dn": 1, "stride_wn": 1}, **precision,
                                  **_even("NK", even)),
                             types=ints, label=f"{edges}: " + config_text_of(config)))
    rows = {"map_ptr": "*i64", "probs_ptr": "*fp32", "dprobs_ptr": "*fp32"}
    meta = {"TOPK": 8, "BLOCK_H": mp.GPU_BLOCK_H}
    out.append(_case("moe_permute permute", mp._permute_kernel, meta, 4, 3, types=rows))
    out.append(_case("moe_permute unpermute", mp._unpermute_kernel, meta, 4, 3,
                     {"HAS_PROBS": True}, types=rows))
    out.append(_case("moe_permute unpermute bwd", mp._unpermute_backward_kernel, meta, 4, 3,
                     types=rows))
    return out


def symm_mem_cases():
    symm = _module("symm_mem_ag_matmul")
    meta = {"BLOCK_M": symm.BLOCK_M, "BLOCK_N": symm.BLOCK_N, "BLOCK_K": symm.BLOCK_K}
    return [_case("symm_mem_ag_matmul staged gemm", symm._staged_ag_matmul_kernel, meta, symm.NUM_WARPS,
                  symm.NUM_STAGES, {"HAS_BIAS": True, "ACTIVATION": 1, "SAVE_PREACT": True,
                                    "INPUT_PRECISION": "tf32", "stride_wk": 1},
                  types={"ready_ptr": "*u32"})]


def all_cases():
    specific = matmul_cases() + norm_cases() + elementwise_cases() + special_cases()
    covered = {qualified_name(c[2]) for c in specific}
    return specific + generic_cases(covered)
