"""``tpfuse-plan``: the per-rank memory and communication of a layout, from tpfuse-train's flags.

    tpfuse-plan <tpfuse-train's flags> --world-size N [--json]
    tpfuse-plan <tpfuse-train's flags> --world-size N --search --gpu-memory-gib 80 [--png F]

The model, parallel, precision and batch flags are tpfuse-train's own (``training/arguments.py``
parses them, so the plan takes exactly what the trainer takes and rejects what it rejects); the
flags below are the plan's. Nothing is built: no model, no process group.
"""
from __future__ import annotations

import argparse
import json
import sys


def build_plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpfuse-plan", add_help=False, allow_abbrev=False,
        description="Per-rank memory and communication of a layout (tpfuse-train's flags).")
    group = parser.add_argument_group("plan")
    group.add_argument("--world-size", type=int, required=True, help="ranks of the job")
    group.add_argument("--json", action="store_true", help="print the plan as JSON")
    group.add_argument("--search", action="store_true",
                       help="rank every valid layout of the world size that fits")
    group.add_argument("--gpu-memory-gib", type=float, default=None,
                       help="--search: memory of one device (GiB)")
    group.add_argument("--gpus-per-node", type=int, default=8,
                       help="--search: devices per node (tp stays inside one)")
    group.add_argument("--intra-node-gbps", type=float, default=450.0,
                       help="--search: GB/s per device inside a node")
    group.add_argument("--inter-node-gbps", type=float, default=50.0,
                       help="--search: GB/s per device across nodes")
    group.add_argument("--mfu", type=float, default=0.5,
                       help="--search: share of the peak FLOP/s the compute reaches")
    group.add_argument("--top", type=int, default=10, help="--search: layouts shown")
    group.add_argument("--png", default=None,
                       help="--search: write the top layouts' memory by kind to this PNG")
    return parser


def _cluster(plan_args, settings):
    from tpfuse.models.flops import H200_BF16_DENSE_TFLOPS

    from .search import Cluster

    if plan_args.gpu_memory_gib is None or not plan_args.gpu_memory_gib > 0:
        raise ValueError("--search needs --gpu-memory-gib M (> 0, the memory of one device)")
    for name in ("gpus_per_node", "top"):
        if getattr(plan_args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("intra_node_gbps", "inter_node_gbps"):
        if not getattr(plan_args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if not 0 < plan_args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {plan_args.mfu}")
    peak = settings.observability.peak_tflops or H200_BF16_DENSE_TFLOPS
    return Cluster(plan_args.gpu_memory_gib, plan_args.gpus_per_node, plan_args.intra_node_gbps,
                   plan_args.inter_node_gbps, peak, plan_args.mfu)


def _without_config(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "config"}


def main(argv=None) -> int:
    from ..arguments import parse_args
    from .report import format_plan, plan_layout

    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        from ..arguments import build_parser

        # the plan's flags and every tpfuse-train flag, in one help
        argparse.ArgumentParser(prog="tpfuse-plan", add_help=False, conflict_handler="resolve",
                                parents=[build_plan_parser(), build_parser()]).print_help()
        return 0
    plan_args, train_argv = build_plan_parser().parse_known_args(argv)
    if plan_args.world_size < 1:
        raise SystemExit("tpfuse-plan: --world-size must be >= 1")
    try:
        config, settings = parse_args(train_argv)
        if plan_args.search:
            from .search import format_search, save_png, search

            cluster = _cluster(plan_args, settings)
            results = search(config, settings, plan_args.world_size, cluster)
            if plan_args.json:
                print(json.dumps([_without_config(r) for r in results[:plan_args.top]],
                                 indent=1))
            else:
                print(format_search(results, cluster, plan_args.top))
            if plan_args.png and results:
                save_png(results, plan_args.png, plan_args.top)
            return 0 if results else 1
        plan = plan_layout(config, settings, plan_args.world_size)
    except ValueError as error:
        raise SystemExit(f"tpfuse-plan: {error}")
    print(json.dumps(plan, indent=1) if plan_args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
