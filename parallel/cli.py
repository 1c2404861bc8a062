"""``tpfuse-layout``: show which global rank sits in which parallel group.

    tpfuse-layout --world-size 8 --tp 2 --pp 2
    tpfuse-layout --world-size 8 --tp 2 --pp 2 --rank 3
    tpfuse-layout --world-size 16 --tp 2 --pp 4 --vpp 2 --global-batch-size 64 --micro-batch-size 2
    tpfuse-layout --world-size 8 --tp 2 --ep 2 --etp 1 --json
    tpfuse-layout --world-size 8 --tp 2 --pp 2 --png layout.png

Pure arithmetic (no processes are started). Invalid settings print one line naming the setting
and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from .layout import DEFAULT_ORDER, RankLayout, check_vpp
from .report import (draw_rank_grid, format_batch, format_layout_table, format_rank,
                     format_summary)

__all__ = ["main", "build_parser", "format_layout_table"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpfuse-layout",
        description="Print the rank layout of a tensor/pipeline/data/context/expert-parallel "
                    "configuration: every rank's coordinates and groups (Megatron-core "
                    "compatible), and optionally the micro-batch arithmetic.")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert tensor-parallel size (default: --tp)")
    parser.add_argument("--vpp", type=int, default=None,
                        help="virtual pipeline size: model chunks per rank (interleaved 1F1B)")
    parser.add_argument("--order", default=DEFAULT_ORDER,
                        help=f"dimension order, fastest-varying first (default {DEFAULT_ORDER})")
    parser.add_argument("--rank", type=int, default=None,
                        help="show one global rank in detail instead of the whole table")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="global batch size: also print micro-batches per step and bubble")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="micro-batch size (default 1 when --global-batch-size is given)")
    parser.add_argument("--json", action="store_true",
                        help="print the layout as JSON (RankLayout.to_dict()) instead")
    parser.add_argument("--png", metavar="FILE", default=None,
                        help="also draw the rank grid into this PNG file")
    return parser


def _layout_and_checks(args) -> RankLayout:
    """Build the layout; every invalid setting raises ValueError naming it."""
    layout = RankLayout(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                        etp=args.etp, order=args.order)
    check_vpp(args.vpp, layout.pp)
    if args.rank is not None and not 0 <= args.rank < layout.world_size:
        raise ValueError(f"--rank must be in [0, {layout.world_size}), got {args.rank}")
    if args.micro_batch_size is not None and args.global_batch_size is None:
        raise ValueError("--micro-batch-size needs --global-batch-size")
    if args.global_batch_size is not None:
        args.micro_batch_size = 1 if args.micro_batch_size is None else args.micro_batch_size
        for flag, value in (("--global-batch-size", args.global_batch_size),
                            ("--micro-batch-size", args.micro_batch_size)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        unit = args.micro_batch_size * layout.dp
        if args.global_batch_size % unit:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} is not divisible by "
                f"--micro-batch-size {args.micro_batch_size} × dp {layout.dp} = {unit}")
    return layout


def _report(layout: RankLayout, args) -> str:
    if args.json:
        data = layout.to_dict()
        if args.vpp is not None:
            data["vpp"] = args.vpp
        if args.global_batch_size is not None:
            from .microbatches import MicrobatchCalculator, bubble_fraction

            m = MicrobatchCalculator(args.global_batch_size, args.micro_batch_size,
                                     layout.dp).num_microbatches
            data["batch"] = {"global_batch_size": args.global_batch_size,
                             "micro_batch_size": args.micro_batch_size, "num_microbatches": m,
                             "bubble_fraction": bubble_fraction(layout.pp, m, args.vpp or 1)}
        return json.dumps(data, indent=1)
    if args.rank is not None:
        parts = [format_summary(layout, args.vpp), "", format_rank(layout, args.rank, args.vpp)]
    else:
        parts = [format_layout_table(layout, args.vpp)]
    if args.global_batch_size is not None:
        parts += ["", format_batch(layout, args.global_batch_size, args.micro_batch_size,
                                   args.vpp)]
    return "\n".join(parts)


def main(argv=None) -> int:
    """Console entry point; returns the exit status (0 ok, 2 invalid settings)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage + error (or --help)
        return int(exit_.code or 0)
    try:
        layout = _layout_and_checks(args)
    except ValueError as error:
        print(f"tpfuse-layout: error: {error}", file=sys.stderr)
        return 2
    report = _report(layout, args)
    if args.png:
        try:
            draw_rank_grid(layout, args.png, args.vpp)
        except OSError as error:
            print(f"tpfuse-layout: error: cannot write --png {args.png}: {error}",
                  file=sys.stderr)
            return 2
        if not args.json:
            report += f"\n\nrank grid written to {args.png}"
    print(report)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
