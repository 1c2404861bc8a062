"""``tpfuse-train``: a local launcher that runs ``python -m tpfuse.pretrain_gpt`` on N processes.

It sets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) for each
process, streams their output, and when one process fails it stops the others and exits with that
process's code, so a dead rank ends the job instead of leaving the rest blocked in a collective
(the collectives also carry a timeout, ``--distributed-timeout-minutes``).

Multi-node runs are torchrun's job: ``torchrun --nproc-per-node N -m tpfuse.pretrain_gpt <flags>``.

Without any trainer flag it runs the ``stdlib-demo`` preset (the README's main job: 8 processes
training on the Python standard library's own source files, ``training/presets.py``); a preset's
corpus is prepared here once, before the ranks start.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from tpfuse.parallel.launch import free_port


def _launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpfuse-train", add_help=False,
        description="Run tpfuse.pretrain_gpt on N local processes (gloo on CPU, nccl on GPUs). "
                    "Every other flag goes to the trainer; see `tpfuse-train --help-trainer`.")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="number of processes (the world size); default 1 (torchrun's), or "
                             "the preset's (stdlib-demo: 8)")
    parser.add_argument("--help", "-h", action="store_true", help="show this help")
    parser.add_argument("--help-trainer", action="store_true", help="show the trainer's flags")
    return parser


def _stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def run_local(nproc: int, trainer_argv: list[str]) -> int:
    """Start ``nproc`` trainer processes and wait; returns the job's exit code."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tpfuse.pretrain_gpt", *trainer_argv], env=env))
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"tpfuse-train: rank {rank} exited with code {code}; stopping the other "
                      f"ranks", file=sys.stderr, flush=True)
                _stop(procs)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def main(argv=None) -> int:
    parser = _launcher_parser()
    args, trainer_argv = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        return 0
    if args.help_trainer:
        return subprocess.call([sys.executable, "-m", "tpfuse.pretrain_gpt", "--help"])
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    from tpfuse.training.presets import launcher_plan

    trainer_argv, nproc, preset = launcher_plan(trainer_argv, args.nproc_per_node)
    if preset is not None:
        print(f"tpfuse-train: preset {preset.name} ({preset.description}) on {nproc} processes; "
              f"flags given override it", flush=True)
    return run_local(nproc, trainer_argv)


if __name__ == "__main__":
    sys.exit(main())
