"""Compile every tile configuration of every tpfuse GPU kernel for Hopper (sm_90a) on a machine
without a GPU, and report what ptxas says about each: registers per thread, spill bytes, shared
memory, and whether the kernel uses TMA (``cp.async.bulk.tensor``) and warp-group MMA (``wgmma``).

    python -m tpfuse.kernels.sm90_report            # a table
    python -m tpfuse.kernels.sm90_report --json     # [{"kernel", "config", "registers", "spill_bytes",
                                                #   "shared_bytes", "tma", "wgmma"}, ...]

Which kernels: every ``@triton.jit`` / ``@triton.autotune`` kernel defined in a ``tpfuse.kernels``
module. Which configurations: an autotuned kernel's configs (after its ``early_config_prune``, if it
has one); for kernels launched with pinned configs or launcher-chosen blocks, the set the launcher
can choose (``sm90_specs.py``). A kernel found in ``tpfuse.kernels`` with no spec there and whose
arguments cannot be inferred is listed with an error: give it an entry in ``sm90_specs.py``.

Arguments are specialised as Triton's JIT does for the training shapes on a GPU: bf16 data (fp32
statistics), 16-byte aligned pointers, integers that are multiples of 16 marked so, unit column
strides as constants. Shared memory is Triton's figure (``metadata.shared``); H100/H200 allow
232448 bytes per block (``SHARED_LIMIT``). ptxas runs with ``-v`` on Triton's PTX (the same ptxas
Triton bundles). Compiles are cached in Triton's cache, and ptxas results next to them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import sm90_specs

SM90 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448          # bytes of shared memory one block may use on sm_90 (227 KB)


# ----------------------------------------------------------------------------- compiling

def compile_sm90(kernel, constexprs, num_warps, num_stages, dtype="bf16", types=None):
    """(PTX, Triton metadata) of one kernel specialisation for sm_90a."""
    jit = sm90_specs.jit_function(kernel)
    signature, attrs = sm90_specs.infer_signature(jit, constexprs, dtype, types)
    consts = {(jit.arg_names.index(n),): v for n, v in constexprs.items() if n in jit.arg_names}
    source = ASTSource(fn=jit, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(source, target=SM90,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"], compiled.metadata


def _ptxas_path():
    """The ptxas Triton itself uses for sm_90 (3.9 bundles a newer one for its newer PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(90).path


def ptxas_usage(ptx: str) -> dict:
    """registers, spill bytes (stores + loads) of the PTX's kernel per ``ptxas -v``; cached."""
    cache_dir = os.path.join(os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache")),
                             "tpfuse_ptxas")
    os.makedirs(cache_dir, exist_ok=True)
    key = os.path.join(cache_dir, hashlib.sha256(ptx.encode()).hexdigest() + ".json")
    if os.path.exists(key):
        with open(key) as f:
            return json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([_ptxas_path(), "-v", "--gpu-name", "sm_90a", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True)
    text = log.stdout + log.stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    usage = {"registers": registers, "spill_bytes": spills}
    with open(key, "w") as f:
        json.dump(usage, f)
    return usage


def report_row(name, config_text, kernel, constexprs, num_warps, num_stages, dtype="bf16", types=None):
    try:
        ptx, meta = compile_sm90(kernel, constexprs, num_warps, num_stages, dtype, types)
        usage = ptxas_usage(ptx)
    except Exception as exc:  # one broken kernel must not hide the others' rows
        return {"kernel": name, "config": config_text, "registers": None, "spill_bytes": None,
                "shared_bytes": None, "tma": None, "wgmma": None,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return {"kernel": name, "config": config_text, "registers": usage["registers"],
            "spill_bytes": usage["spill_bytes"], "shared_bytes": meta.shared,
            "tma": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma.mma_async" in ptx}


def cases():
    """(report name, config text, kernel, constexprs, warps, stages, dtype, types) per compile."""
    return sm90_specs.all_cases()


def _compile_case(index):
    name, text, kernel, constexprs, warps, stages, dtype, types = cases()[index]
    return report_row(name, text, kernel, constexprs, warps, stages, dtype, types)


def collect(only=None, jobs=1):
    """Report rows of every case (``jobs`` compiler processes), then an error row for every
    discovered kernel that no case covers."""
    all_cases = cases()
    covered = {sm90_specs.qualified_name(c[2]) for c in all_cases}
    chosen = [i for i, c in enumerate(all_cases) if not only or only in c[0]]
    if jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            rows = pool.map(_compile_case, chosen, chunksize=1)
    else:
        rows = [_compile_case(i) for i in chosen]
    for qualified in sorted(set(sm90_specs.discover_kernels()) - covered):
        if not only or only in qualified:
            rows.append({"kernel": qualified, "config": "-", "registers": None, "spill_bytes": None,
                         "shared_bytes": None, "tma": None, "wgmma": None,
                         "error": "no spec in kernels/sm90_specs.py"})
    return rows


def problems(rows):
    """The rows that fail the bar: a compile error, spills, or more shared memory than a block gets."""
    return [r for r in rows if r.get("error") or r["spill_bytes"] or r["shared_bytes"] > SHARED_LIMIT]


def print_table(rows):
    cols = ("kernel", "config", "registers", "spill_bytes", "shared_bytes", "tma", "wgmma")
    table = [cols] + [tuple(str(r.get(c)) if not r.get("error") or c in ("kernel", "config")
                            else ("ERROR " + r["error"] if c == "registers" else "")
                            for c in cols) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--only", default=None, help="only kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    args = parser.parse_args(argv)
    rows = collect(args.only, args.jobs)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"tpfuse kernels compiled for sm_90a with Triton {triton.__version__} "
              f"(shared-memory limit {SHARED_LIMIT} B per block)")
        print_table(rows)
    return 1 if problems(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
