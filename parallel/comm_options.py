"""CommOptions: how the model's communication runs, one explicit object passed down.

    state.comm_options = CommOptions(fused_min_flops=0)       # Python: on the ParallelState
    tpfuse-train ... --fused-comm-min-flops 0                  # the trainer's flags (below)

Three settings, each with the trainer flag that sets it:

    reduce_scatter    how every reduce-scatter runs (``parallel.reduce_scatter``: TP / SP,
                      the MoE dispatchers, the data-parallel buckets, FSDP on the host):
                      "native" ``reduce_scatter_tensor``; "all_reduce": all-reduce the whole
                      input, then keep this rank's block (the same sums); "auto" (default):
                      by the group's backend (``resolve_reduce_scatter``).
                      ``--reduce-scatter-strategy``
    fused_min_flops   per-rank forward GEMM FLOPs from which the fused comm+GEMM ops
                      (``kernels.ag_matmul`` / ``kernels.matmul_rs``) run their ring-overlapped
                      pipeline instead of one collective + one GEMM; 0 = always, ``inf`` = never,
                      None = the kernels' per-device defaults
                      (``kernels.comm_gemm_common.DEFAULT_MIN_FLOPS``). ``--fused-comm-min-flops``
    symm_mem          the symmetric-memory Triton forward of ``all_gather_matmul`` on CUDA
                      (``kernels.symm_mem_ag_matmul``; only where every rank of the group is on
                      this node). ``--symm-mem-all-gather-matmul``

Where it lives: on the ``ParallelState`` (``state.comm_options``, default ``CommOptions()``;
``ParallelState.initialize(..., comm_options=...)``), which every layer already receives. A TP
layer's ``TPGroup`` / ``CPGroup`` reads the options of the state it was resolved from at each
call (so changing ``state.comm_options`` takes effect at the next forward; an MoE layer's
``MoEGroups`` reads them once, when the layer is built); a layer built from a bare ``group=``
uses the defaults. The data-parallel buffers (``training/data_parallel.py``) and FSDP
(``training/fsdp.py``) read ``reduce_scatter`` from the state they are built on, once. The
communication functions (``parallel.mappings``, ``parallel.reduce_scatter``, the fused comm+GEMM
kernels, ``moe.comm``) take ``options=`` (None: the defaults). Nothing is read from the
environment and no module global holds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tpfuse.parallel.checks import is_real
from tpfuse.parallel.host_staging import backend_family

REDUCE_SCATTER_STRATEGIES = ("auto", "native", "all_reduce")


def resolve_reduce_scatter(strategy: str, backend: str) -> str:
    """The reduce-scatter ``strategy`` ("auto", "native" or "all_reduce") run on a group of
    ``backend`` (a ``dist.get_backend`` name): "native" and "all_reduce" as given; "auto" is
    "all_reduce" on gloo (the host-staged gloo groups included) and "native" on nccl and any
    other backend. Measured: gloo's reduce-scatter is about twice as slow as its ring all-reduce
    (a data-parallel bucket of 1.6 M fp32 over 2 CPU ranks: 8.8 ms vs 4.1 ms; at 8 MB over tp 2
    and 4 the two were equal within noise, benchmarks/FUSED_COMM_RESULTS.md), and the
    all-reduce gives the same sums (a rank's block is Σ_ranks of that block either way); NCCL's
    reduce-scatter moves half an all-reduce's traffic."""
    if strategy not in REDUCE_SCATTER_STRATEGIES:
        raise ValueError(f"reduce-scatter strategy must be one of "
                         f"{REDUCE_SCATTER_STRATEGIES}, got {strategy!r}")
    if strategy != "auto":
        return strategy
    return "all_reduce" if backend_family(backend) == "gloo" else "native"


@dataclass(frozen=True)
class CommOptions:
    """The communication settings of the module docstring; ValueError naming a bad one."""
    reduce_scatter: str = "auto"
    fused_min_flops: float | None = None
    symm_mem: bool = False

    def __post_init__(self):
        if self.reduce_scatter not in REDUCE_SCATTER_STRATEGIES:
            raise ValueError(f"reduce-scatter strategy must be one of "
                             f"{REDUCE_SCATTER_STRATEGIES}, got {self.reduce_scatter!r}")
        flops = self.fused_min_flops
        if flops is not None:
            if not is_real(flops) or math.isnan(flops) or flops < 0:
                raise ValueError(f"fused_min_flops must be a number >= 0 or None, got {flops!r}")
            object.__setattr__(self, "fused_min_flops", float(flops))
        if not isinstance(self.symm_mem, bool):
            raise ValueError(f"symm_mem must be a bool, got {self.symm_mem!r}")


DEFAULT_COMM_OPTIONS = CommOptions()


def options_or_default(options: CommOptions | None) -> CommOptions:
    """``options``, else ``CommOptions()``; ValueError for anything else."""
    if options is None:
        return DEFAULT_COMM_OPTIONS
    if not isinstance(options, CommOptions):
        raise ValueError(f"options must be a CommOptions or None, got {type(options).__name__}")
    return options

