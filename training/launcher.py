"""``tpfuse-train``: runs ``python -m tpfuse.pretrain_gpt`` on N local processes.

The local job itself (torchrun's environment per rank, signal forwarding, one traceback per job,
ranks that die with their launcher) is ``tpfuse.runtime.launcher.run_local``; this module is the
command: its own flags, ``--help-trainer``, and the presets. Without any trainer flag it runs the
``stdlib-demo`` preset (the README's main job, ``training/presets.py``); a preset's corpus is
prepared and the trainer's flags are validated here, once, before the ranks start. Multi-node
runs are torchrun's job: ``torchrun --nproc-per-node N -m tpfuse.pretrain_gpt <flags>``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from tpfuse.runtime.launcher import run_local

TRAINER = [sys.executable, "-m", "tpfuse.pretrain_gpt"]


def _launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpfuse-train", add_help=False, allow_abbrev=False,
        description="Run tpfuse.pretrain_gpt on N local processes (gloo on CPU, nccl on GPUs). "
                    "Every other flag goes to the trainer; see `tpfuse-train --help-trainer`.")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="number of processes (the world size); default 1 (torchrun's), or "
                             "the preset's (stdlib-demo: 8)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address the rendezvous listens on (default: loopback only)")
    parser.add_argument("--master-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--help", "-h", action="store_true", help="show this help")
    parser.add_argument("--help-trainer", action="store_true", help="show the trainer's flags")
    return parser


def _trainer_flag_error(trainer_argv: list) -> str | None:
    """The trainer's own validation of ``trainer_argv`` (``arguments.parse_args``; it depends on
    no rank or world size), run once here so that a bad setting is one line before any rank
    starts: its message, or None. An unknown flag exits through argparse (status 2)."""
    from tpfuse.training.arguments import parse_args

    try:
        parse_args(trainer_argv)
    except ValueError as error:
        return str(error)
    return None


def main(argv=None) -> int:
    parser = _launcher_parser()
    args, trainer_argv = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        return 0
    if args.help_trainer:
        return subprocess.call([*TRAINER, "--help"])
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    from tpfuse.training.presets import launcher_plan

    trainer_argv, nproc, preset = launcher_plan(trainer_argv, args.nproc_per_node)
    error = _trainer_flag_error(trainer_argv)
    if error is not None:
        print(f"tpfuse-train: error: {error}", file=sys.stderr)
        return 2
    if preset is not None:
        print(f"tpfuse-train: preset {preset.name} ({preset.description}) on {nproc} processes; "
              f"flags given override it", flush=True)
    return run_local(nproc, trainer_argv, args.master_addr, args.master_port, program=TRAINER)


if __name__ == "__main__":
    sys.exit(main())
