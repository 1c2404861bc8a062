"""``tpfuse-schedule``: print a pipeline schedule, simulate it, draw it.

    tpfuse-schedule --pp 4 --vpp 2 --microbatches 8 [--group-size G] [--json] [--png FILE]
                    [--forward-cost 1 --backward-cost 2] [--zb-h1]

Prints each pipeline rank's action list (``F3.1`` = forward of micro-batch 3 through chunk 1),
then the simulated bubble fraction next to the formula (p − 1)/(v·m + p − 1). Invalid settings
print a message naming them and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from .schedules import bubble_fraction_formula, build_schedule
from .simulate import simulate
from .zero_bubble import build_zb_h1_schedule, zb_h1_bubble_formula


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpfuse-schedule",
        description="Per-rank pipeline schedule (1F1B or Megatron's interleaved order), its "
                    "simulated bubble fraction next to the formula, and a Gantt chart.")
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank v (default 1)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    parser.add_argument("--group-size", type=int, default=None,
                        help="interleaved micro-batch group size g (default p)")
    parser.add_argument("--forward-cost", type=float, default=1.0, help="cost of one F action")
    parser.add_argument("--backward-cost", type=float, default=2.0, help="cost of one B action")
    parser.add_argument("--zb-h1", action="store_true",
                        help="zero-bubble ZB-H1 (vpp 1): backward split into I and W, each "
                             "costing half of --backward-cost")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--png", metavar="FILE", default=None, help="write a Gantt chart PNG")
    return parser


def _table(schedule) -> str:
    width = max(len(str(a)) for actions in schedule for a in actions)
    lines = []
    for rank, actions in enumerate(schedule):
        lines.append(f"rank {rank}: " + " ".join(str(a).ljust(width) for a in actions).rstrip())
    return "\n".join(lines)


def _build_and_simulate(args):
    """(schedule, simulation result, formula bubble fraction) for the parsed arguments."""
    if args.zb_h1:
        if args.vpp != 1:
            raise ValueError(f"--zb-h1 is a one-chunk schedule, got --vpp {args.vpp}")
        half = args.backward_cost / 2
        schedule = build_zb_h1_schedule(args.pp, args.microbatches, args.forward_cost, half, half)
        formula = zb_h1_bubble_formula(args.pp, args.microbatches, args.forward_cost, half, half)
    else:
        schedule = build_schedule(args.pp, args.microbatches, args.vpp, args.group_size)
        formula = bubble_fraction_formula(args.pp, args.microbatches, args.vpp)
    result = simulate(schedule, args.microbatches, args.vpp, forward_cost=args.forward_cost,
                      backward_cost=args.backward_cost)
    return schedule, result, formula


def _formula_text(args) -> str:
    if args.zb_h1:
        return "(p-1)(F+I-W)/(m(F+I+W)+(p-1)(F+I-W))"
    return "(p-1)/(v*m+p-1)"


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        schedule, result, formula = _build_and_simulate(args)
    except ValueError as error:
        parser.error(str(error))   # prints usage + message, exits with status 2
    if args.json:
        print(json.dumps({
            "schedule": "zb-h1" if args.zb_h1 else "interleaved" if args.vpp > 1 else "1f1b",
            "pp": args.pp, "vpp": args.vpp, "microbatches": args.microbatches,
            "group_size": (args.group_size or args.pp) if args.vpp > 1 else None,
            "ranks": [[str(a) for a in actions] for actions in schedule],
            "forward_cost": args.forward_cost, "backward_cost": args.backward_cost,
            "makespan": result.makespan, "deadlocked": result.deadlocked,
            "simulated_bubble_fraction": result.bubble_fraction,
            "formula_bubble_fraction": formula}))
    else:
        kind = "ZB-H1" if args.zb_h1 else "interleaved" if args.vpp > 1 else "1F1B"
        print(f"{kind} schedule, pp={args.pp} vpp={args.vpp} microbatches={args.microbatches}"
              + (f" group_size={args.group_size or args.pp}" if args.vpp > 1 else ""))
        print(_table(schedule))
        print(f"bubble fraction: simulated {result.bubble_fraction:.4f} "
              f"(F cost {args.forward_cost:g}, B cost {args.backward_cost:g}, makespan "
              f"{result.makespan:g}); formula {_formula_text(args)} = {formula:.4f}")
    if args.png:
        from .gantt import save_gantt

        title = (f"pp={args.pp} vpp={args.vpp} m={args.microbatches}: bubble "
                 f"{result.bubble_fraction:.3f} simulated, {formula:.3f} formula")
        save_gantt(result, args.png, title)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
