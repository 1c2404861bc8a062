"""Keep the memory a CPU training step frees in the process instead of handing it back to the OS.

A training step allocates its activations (tens to hundreds of MiB) during the forward and frees
them at the end of the backward. With glibc's default malloc, large freed blocks at the top of
the heap are trimmed (returned to the OS) and blocks above the dynamic mmap threshold are
unmapped, so the next step's forward touches freshly mapped pages again: one minor page fault per
4 KiB, each zero-filled by the kernel (on the GPT of ``benchmarks/test_bench_gpt_step.py``
~15,000 faults and ~4 % of the step). Whether it happens depends on what else is alive at the top
of the heap: a trainer with persistent gradient buffers (``param.main_grad``) leaves nothing
there, a plain loop that re-creates ``param.grad`` every step happens to pin it.

:func:`keep_freed_host_memory` sets glibc's trim threshold to its maximum and the mmap threshold to
glibc's largest value (32 MiB): freed memory is reused by the next step, as a caching allocator
does on a GPU. Process-wide and idempotent; a no-op where glibc's ``mallopt`` is not available
(macOS, musl) or on CUDA (device memory has PyTorch's caching allocator; host memory is small).
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc's mallopt parameter numbers
TRIM_THRESHOLD = 2**31 - 1                       # never trim the heap
MMAP_THRESHOLD = 32 * 2**20                      # glibc's maximum (HEAP_MAX_SIZE / 2 on 64 bit)


def keep_freed_host_memory() -> bool:
    """Configure glibc malloc as described above; True when it took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and \
        bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
