"""CommOptions: how tensor-parallel communication runs, one explicit object passed down.

    state.comm_options = CommOptions(fused_min_flops=0)       # Python: on the ParallelState
    tpfuse-train ... --fused-comm-min-flops 0                  # the trainer's flags (below)

Three settings, each with the trainer flag that sets it:

    reduce_scatter    "native": ``reduce_scatter_tensor`` (gloo in torch >= 2 and nccl have it);
                      "all_reduce": all-reduce, then keep this rank's slice (a fallback for
                      backends without it). ``--reduce-scatter-strategy``
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
uses the defaults. The communication functions (``parallel.mappings``, the fused comm+GEMM
kernels, ``moe.comm``) take ``options=`` (None: the defaults). Nothing is read from the
environment and no module global holds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tpfuse.parallel.checks import is_real

REDUCE_SCATTER_STRATEGIES = ("native", "all_reduce")


@dataclass(frozen=True)
class CommOptions:
    """The communication settings of the module docstring; ValueError naming a bad one."""
    reduce_scatter: str = "native"
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

