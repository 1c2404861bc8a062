"""``tpfuse-schedule``: print a pipeline schedule, simulate it, draw it.

    tpfuse-schedule --pp 4 --vpp 2 --microbatches 8 [--group-size G] [--json] [--png FILE]
                    [--forward-cost 1 --backward-cost 2]

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
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--png", metavar="FILE", default=None, help="write a Gantt chart PNG")
    return parser


def _table(schedule) -> str:
    width = max(len(str(a)) for actions in schedule for a in actions)
    lines = []
    for rank, actions in enumerate(schedule):
        lines.append(f"rank {rank}: " + " ".join(str(a).ljust(width) for a in actions).rstrip())
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        schedule = build_schedule(args.pp, args.microbatches, args.vpp, args.group_size)
        result = simulate(schedule, args.microbatches, args.vpp, forward_cost=args.forward_cost,
                          backward_cost=args.backward_cost)
    except ValueError as error:
        parser.error(str(error))   # prints usage + message, exits with status 2
    formula = bubble_fraction_formula(args.pp, args.microbatches, args.vpp)
    if args.json:
        print(json.dumps({
            "pp": args.pp, "vpp": args.vpp, "microbatches": args.microbatches,
            "group_size": (args.group_size or args.pp) if args.vpp > 1 else None,
            "ranks": [[str(a) for a in actions] for actions in schedule],
            "forward_cost": args.forward_cost, "backward_cost": args.backward_cost,
            "makespan": result.makespan, "deadlocked": result.deadlocked,
            "simulated_bubble_fraction": result.bubble_fraction,
            "formula_bubble_fraction": formula}))
    else:
        kind = "interleaved" if args.vpp > 1 else "1F1B"
        print(f"{kind} schedule, pp={args.pp} vpp={args.vpp} microbatches={args.microbatches}"
              + (f" group_size={args.group_size or args.pp}" if args.vpp > 1 else ""))
        print(_table(schedule))
        print(f"bubble fraction: simulated {result.bubble_fraction:.4f} "
              f"(F cost {args.forward_cost:g}, B cost {args.backward_cost:g}, makespan "
              f"{result.makespan:g}); formula (p-1)/(v*m+p-1) = {formula:.4f}")
    if args.png:
        from .gantt import save_gantt

        title = (f"pp={args.pp} vpp={args.vpp} m={args.microbatches}: bubble "
                 f"{result.bubble_fraction:.3f} simulated, {formula:.3f} formula")
        save_gantt(result, args.png, title)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
