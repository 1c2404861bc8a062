"""One-command smoke test of everything around the kernels on one GPU: the trainer in each precision
and optimizer mode, activation recompute, MoE, checkpoint save → resume, and generation from the
saved checkpoint. Each item is a fresh process (world size 1, NCCL) with its own timeout and one
``PASS`` / ``FAIL`` / ``SKIP`` line; a failure prints the last lines of the command's output.

    python3 benchmarks/gpu_smoke.py          # one GPU (torch + triton present, tpfuse importable)
    python3 benchmarks/gpu_smoke.py --cpu    # the same items, tiny, on gloo: checks this script
    python3 benchmarks/gpu_smoke.py --only bf16,generate --keep   # a subset; keep the work dir

Run it from any directory (it writes only under a temporary folder). The tools are invoked as
``python3 -m tpfuse.training.launcher`` / ``python3 -m tpfuse.inference.cli`` (console scripts may
be missing). On the GPU the first item is the ``stdlib-demo`` preset at GPT-2 small size (12 layers,
hidden 768, seq 1024, micro-batch 8, global batch 32) — the job that first ran on an H200 — and
the others use 2 layers of the same width, so the Triton kernels compiled by the first item are
reused from the on-disk cache. The whole run is held to ``--budget-s`` (default 230 s): an item
gets at most what is left, and none starts with less than 20 s left (it is reported as SKIP).

What each item checks (every training item: exit status 0, the metrics file reaches the last
iteration, every logged loss finite):

- ``bf16``: the preset job in bf16, evaluation at start, the trained model's greedy sample;
- ``fp16``: dynamic loss scaling from 2^16 (a loss scale logged every iteration, at least one
  step applied);
- ``distributed-optimizer``: ``--use-distributed-optimizer`` (one data-parallel rank), with the
  per-rank timers (``--timing-log-level 2``: CUDA synchronisation and their gather);
- ``recompute-full`` / ``recompute-selective``: activation recompute (the latter with the
  SIGTERM / duration exit agreements, a flag all-reduced every iteration);
- ``save``, ``async-save``, ``resume``: 3 iterations saved at the end; an uninterrupted run of 6
  with ``--async-save`` every 2; a run ``--load``ing the first checkpoint must log iterations
  4..6 only, with losses within 2 % of the uninterrupted run's (bf16 and non-deterministic kernel
  reductions differ in the last bits; a wrong data position, lr or optimizer state moves them by
  more);
- ``generate``: ``tpfuse-generate`` greedy from the saved checkpoint (its byte tokenizer), JSON out;
- ``moe``: 4 experts, top-2, with the load-balancing loss;
- ``zero-bubble``: skipped, the zb-h1 schedule needs pipeline_model_parallel_size > 1.

Exit status 0 when nothing failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

TAIL_LINES = 40
MIN_ITEM_S = 20.0                # no item starts with less time left than this
RESUME_TOLERANCE = 2e-2          # relative, per iteration (see the module docstring)

# the H200 job (the integrator's first command, fewer iterations)
GPU_MODEL = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
             "--seq-length", "1024", "--max-position-embeddings", "1024",
             "--micro-batch-size", "8", "--global-batch-size", "32"]
CPU_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64",
             "--micro-batch-size", "2", "--global-batch-size", "4"]
LAYOUT = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
          "--no-sequence-parallel"]


@dataclass
class Item:
    name: str
    flags: list = field(default_factory=list)   # trainer flags on top of the common ones
    iters: int = 4
    timeout_s: float = 75.0
    layers: int | None = 2                       # None: the full model's
    kind: str = "train"                          # train | resume | generate | skip
    why: str = ""                                # a skip's reason


ITEMS = [
    Item("bf16", ["--bf16", "--eval-at-start", "--sample-prompt", "def ",
                  "--sample-max-new-tokens", "8"], iters=6, timeout_s=150.0, layers=None),
    # save at 3 (generate reads it); an uninterrupted run to 6 saving asynchronously; resume 3 -> 6
    Item("save", ["--bf16", "--lr-decay-iters", "6", "--save", "{work}/checkpoint"], iters=3),
    Item("generate", kind="generate", timeout_s=60.0),
    Item("async-save", ["--bf16", "--lr-decay-iters", "6", "--save", "{work}/checkpoint-async",
                        "--save-interval", "2", "--async-save"], iters=6),
    Item("resume", ["--bf16", "--lr-decay-iters", "6", "--load", "{work}/checkpoint",
                    "--exit-on-missing-checkpoint"], iters=6, kind="resume"),
    Item("fp16", ["--fp16", "--initial-loss-scale", "65536"], iters=6),
    Item("distributed-optimizer", ["--bf16", "--use-distributed-optimizer",
                                   "--timing-log-level", "2"]),
    Item("moe", ["--bf16", "--num-experts", "4", "--moe-router-topk", "2",
                 "--moe-aux-loss-coeff", "1e-2"]),
    Item("recompute-full", ["--bf16", "--recompute-granularity", "full", "--recompute-method",
                            "uniform", "--recompute-num-layers", "1"]),
    Item("recompute-selective", ["--bf16", "--recompute-granularity", "selective",
                                 "--exit-duration-in-mins", "100", "--exit-signal-handler"]),
    Item("zero-bubble", kind="skip",
         why="--pipeline-schedule zb-h1 needs pipeline_model_parallel_size > 1 (one GPU here)"),
]


class Failure(Exception):
    """An item's check failed (its message says which)."""


# ---------------------------------------------------------------------------- commands
def _layers(item: Item, model: list) -> list:
    if item.layers is None:
        return list(model)
    out = list(model)
    out[out.index("--num-layers") + 1] = str(item.layers)
    return out


def train_command(item: Item, cpu: bool, work: str) -> list:
    model = _layers(item, CPU_MODEL if cpu else GPU_MODEL)
    layers = model[model.index("--num-layers") + 1]
    flags = ["--preset", "stdlib-demo", "--nproc-per-node", "1", *LAYOUT, *model,
             # one model chunk (vpp 1): valid with or without the preset's interleaving
             "--num-layers-per-virtual-pipeline-stage", layers,
             "--train-iters", str(item.iters), "--lr-warmup-iters", "2", "--log-interval", "1",
             "--eval-interval", "1000", "--eval-iters", "1", "--no-progress-bar",
             "--metrics-file", os.path.join(work, f"{item.name}.jsonl")]
    if "--sample-prompt" not in item.flags:
        flags += ["--sample-prompt", ""]        # the preset's sample only where asked for
    flags += [flag.format(work=work) for flag in item.flags]
    if cpu:
        flags += ["--distributed-backend", "gloo"]
    return [sys.executable, "-m", "tpfuse.training.launcher", *flags]


def generate_command(cpu: bool, work: str) -> list:
    command = [sys.executable, "-m", "tpfuse.inference.cli", "--load",
               os.path.join(work, "checkpoint"), "--prompt", "def ", "--max-new-tokens", "16",
               "--greedy", "--eos-id", "-1", "--json"]
    return command + (["--distributed-backend", "gloo"] if cpu else [])


def run(command: list, timeout_s: float, cwd: str, env: dict) -> tuple[int | None, str]:
    """(exit status or None on timeout, combined output); the whole process group is killed on
    timeout (the launcher's ranks die with it)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output


# ---------------------------------------------------------------------------- checks
def read_losses(path: str) -> dict:
    """{iteration: record} of the training iterations in a metrics file."""
    if not os.path.exists(path):
        raise Failure(f"no metrics file {path}")
    records = {}
    with open(path) as handle:
        for line in handle:
            record = json.loads(line)
            if "loss" in record and "iteration" in record:
                records[record["iteration"]] = record
    return records


def check_training(item: Item, work: str) -> str:
    records = read_losses(os.path.join(work, f"{item.name}.jsonl"))
    if not records or max(records) != item.iters:
        raise Failure(f"iterations logged: {sorted(records)}, expected up to {item.iters}")
    losses = [records[i]["loss"] for i in sorted(records)]
    if not all(isinstance(v, float) and math.isfinite(v) for v in losses):
        raise Failure(f"non-finite loss: {losses}")
    detail = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    if "--fp16" in item.flags:
        scales = [records[i].get("loss_scale") for i in sorted(records)]
        skipped = sum(bool(records[i].get("skipped")) for i in records)
        if any(s is None for s in scales):
            raise Failure(f"fp16 without a logged loss scale: {scales}")
        if skipped == len(records):
            raise Failure(f"every fp16 step was skipped (loss scales {scales})")
        detail += f", loss scale {scales[0]:g} -> {scales[-1]:g}, {skipped} step(s) skipped"
    if "--num-experts" in item.flags:
        balance = [records[i].get("load_balancing_loss") for i in sorted(records)]
        if any(b is None or not math.isfinite(b) for b in balance):
            raise Failure(f"MoE load_balancing_loss not logged or not finite: {balance}")
        detail += f", load balancing loss {balance[-1]:.4f}"
    return detail


def check_resume(item: Item, work: str) -> str:
    resumed = read_losses(os.path.join(work, f"{item.name}.jsonl"))
    uninterrupted = read_losses(os.path.join(work, "async-save.jsonl"))
    if sorted(resumed) != [4, 5, 6]:
        raise Failure(f"resumed run logged iterations {sorted(resumed)}, expected [4, 5, 6] "
                      "(the checkpoint of iteration 3)")
    worst = 0.0
    for i in resumed:
        a, b = resumed[i]["loss"], uninterrupted[i]["loss"]
        worst = max(worst, abs(a - b) / abs(b))
    pairs = ", ".join(f"{resumed[i]['loss']:.4f}/{uninterrupted[i]['loss']:.4f}" for i in resumed)
    if not worst <= RESUME_TOLERANCE:
        raise Failure(f"resumed / uninterrupted losses {pairs}: relative difference {worst:.2e} "
                      f"> {RESUME_TOLERANCE:g}")
    return f"resumed at 4; losses resumed/uninterrupted {pairs} (max rel. diff {worst:.1e})"


def check_generate(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if not lines:
        raise Failure("no JSON line in the output")
    result = json.loads(lines[-1])
    if len(result["generated_ids"]) != 16 or result["text"] is None:
        raise Failure(f"expected 16 generated ids and text, got {result}")
    return f"16 tokens: {result['text']!r}"


# ---------------------------------------------------------------------------- the run
def run_item(item: Item, cpu: bool, work: str, env: dict, timeout_s: float) -> str:
    """The item's detail line on success; raises Failure (with the output's tail) otherwise."""
    if item.kind == "generate":
        command = generate_command(cpu, work)
    else:
        command = train_command(item, cpu, work)
    code, output = run(command, timeout_s, cwd=work, env=env)
    try:
        if code is None:
            raise Failure(f"timed out after {timeout_s:.0f} s")
        if code != 0:
            raise Failure(f"exit status {code}")
        if item.kind == "generate":
            return check_generate(output)
        return check_resume(item, work) if item.kind == "resume" else check_training(item, work)
    except Failure as failure:
        tail = "\n".join("    | " + line for line in output.splitlines()[-TAIL_LINES:])
        raise Failure(f"{failure}\n    command: {shlex.join(command)}\n{tail}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny model on gloo (no GPU needed)")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated items ({', '.join(i.name for i in ITEMS)})")
    parser.add_argument("--budget-s", type=float, default=230.0,
                        help="the whole run's limit: an item gets at most what is left of it, "
                             f"and none starts with less than {MIN_ITEM_S:.0f} s left")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    names = [item.name for item in ITEMS]
    only = names if args.only is None else args.only.split(",")
    unknown = sorted(set(only) - set(names))
    if unknown:
        parser.error(f"--only: unknown items {unknown}; the items are {names}")
    chosen = [item for item in ITEMS if item.name in only]
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("gpu_smoke: no CUDA device (use --cpu to check the script itself)")
            return 1
    work = tempfile.mkdtemp(prefix="tpfuse-gpu-smoke-")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start, failed = time.perf_counter(), []
    print(f"gpu_smoke: {'CPU (gloo)' if args.cpu else 'GPU (nccl)'}, work folder {work}",
          flush=True)
    try:
        for item in chosen:
            began = time.perf_counter()
            if item.kind == "skip":
                print(f"SKIP  {item.name}: {item.why}", flush=True)
                continue
            left = args.budget_s - (began - start)
            if left < MIN_ITEM_S:
                print(f"SKIP  {item.name}: the {args.budget_s:.0f} s budget is spent (run it "
                      f"with --only {item.name}, with its dependencies save / async-save)",
                      flush=True)
                continue
            try:
                detail = run_item(item, args.cpu, work, env, min(item.timeout_s, left))
                print(f"PASS  {item.name} ({time.perf_counter() - began:.1f} s): {detail}",
                      flush=True)
            except Failure as failure:
                failed.append(item.name)
                print(f"FAIL  {item.name} ({time.perf_counter() - began:.1f} s): {failure}",
                      flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - start
    print(f"gpu_smoke: {len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''} "
          f"in {total:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
