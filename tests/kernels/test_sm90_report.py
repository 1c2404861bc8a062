"""Every tile configuration of every GPU kernel compiles for Hopper (sm_90a) without register
spills and within one block's shared memory (kernels/sm90_report.py: Triton lowers each kernel
to PTX with its bundled ptxas, no GPU needed). A config that spills or does not fit cannot win the
autotuner (or, pinned, would run slow), so it must be pruned from the kernel's list, not kept.

Also checks that the report covers every launched kernel of ``tpfuse.kernels`` (a new kernel needs
an entry in kernels/sm90_specs.py or an autotuner the report can read), and that the Hopper
GEMMs really use warp-group MMA and, for the persistent kernel, TMA.
"""

import pytest


from tpfuse.kernels import sm90_report

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # triton 3.9's FP-fusion notice


@pytest.fixture(scope="module")
def rows():
    """The report's rows, compiled in 2 processes (Triton's cache makes reruns take seconds)."""
    return sm90_report.collect(jobs=2)


def _where(rows, prefix):
    selected = [r for r in rows if r["kernel"].startswith(prefix)]
    assert selected, f"no report rows for {prefix}"
    return selected


def _describe(bad):
    return "\n".join(f"{r['kernel']} [{r['config']}]: " + (r.get("error") or
                     f"{r['spill_bytes']} spill bytes, {r['shared_bytes']} B shared") for r in bad)


FAMILIES = ["matmul", "layer_norm", "rms_norm", "cross_entropy", "bias_dropout_add", "symm_mem",
            "flash_attention"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_config_compiles_without_spills_and_fits(rows, family):
    bad = sm90_report.problems(_where(rows, family))
    assert not bad, "configs that cannot win must be pruned:\n" + _describe(bad)


def test_every_launched_kernel_is_covered(rows):
    uncovered = [r["kernel"] for r in rows if r.get("error", "").startswith("no spec")]
    assert not uncovered, f"kernels the report cannot compile (add them to sm90_specs.py): {uncovered}"
    others = [r for r in rows if not any(r["kernel"].startswith(f) for f in FAMILIES)]
    assert not sm90_report.problems(others), _describe(sm90_report.problems(others))


def test_hopper_gemms_use_wgmma_and_the_persistent_one_tma(rows):
    tma = _where(rows, "matmul (TMA")
    assert all(r["tma"] and r["wgmma"] for r in tma)
    pointer = [r for r in _where(rows, "matmul (pointer)") if "64x64x32" not in r["config"]]
    assert all(r["wgmma"] and not r["tma"] for r in pointer)  # (2-warp tiles are below a warp group)
    assert all(r["wgmma"] for r in _where(rows, "grouped_gemm"))   # MoE: fwd, dgrad, wgrad


def test_flash_attention_uses_wgmma_and_tma_where_it_claims(rows):
    # (δ and the decode merge: row reductions; the decode split kernel's 16-row tiles are below a warp
    # group's 64-row wgmma, and it reads the KV cache through pointers)
    tiled = [r for r in _where(rows, "flash_attention") if "δ" not in r["kernel"] and "decode" not in r["kernel"]]
    assert all(r["wgmma"] for r in tiled)
    assert all(r["tma"] == ("TMA" in r["config"]) for r in tiled)
    assert not any(r["tma"] for r in _where(rows, "flash_attention decode"))


def test_json_rows_have_the_documented_fields(rows):
    for row in rows:
        assert {"kernel", "config", "registers", "spill_bytes", "shared_bytes", "tma", "wgmma"} <= set(row)


def test_autotuned_pointer_matmul_prunes_configs_over_shared_memory(rows):
    """The autotuned pointer GEMM's early_config_prune estimates shared memory as stages ×
    (BLOCK_M·BLOCK_K + BLOCK_K·BLOCK_N) × element size: that estimate equals Triton's figure for
    every compiled bf16 wgmma pointer config and bounds it for the others (the 2-warp mma.sync
    pipeline keeps one buffer fewer), and with fp32 operands the prune drops exactly the configs
    over the limit (128×256×64 at 3 stages would need 294,912 B) and keeps the others."""
    import re

    import torch

    from tpfuse.kernels import matmul_kernels as mk

    def estimate(bm, bn, bk, stages, size):
        return stages * size * bk * (bm + bn)

    compiled = [r for r in rows if r["kernel"] == "matmul (pointer)" and " bf16: " in r["config"]]
    assert compiled
    for r in compiled:
        bm, bn, bk, stages = map(int, re.search(r"(\d+)x(\d+)x(\d+), warps=\d+, stages=(\d+)", r["config"]).groups())
        if r["wgmma"]:
            assert estimate(bm, bn, bk, stages, 2) == r["shared_bytes"], r
        assert estimate(bm, bn, bk, stages, 2) >= r["shared_bytes"], r
    configs = mk.matmul_kernel_autotuned.configs
    for dtype in (torch.bfloat16, torch.float32):
        kept = mk.fits_shared_memory(configs, {"a_ptr": torch.empty(1, dtype=dtype)})
        sizes = {id(c): estimate(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages,
                                 dtype.itemsize) for c in configs}
        assert [id(c) for c in kept] == [id(c) for c in configs if sizes[id(c)] <= sm90_report.SHARED_LIMIT]
        assert kept
    assert len(mk.fits_shared_memory(configs, {"a_ptr": torch.empty(1)})) < len(configs)
