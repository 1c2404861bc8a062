"""``tpfuse-generate``: text (or ids) from a checkpoint, on one process or a local TP × PP group.

    tpfuse-generate --load DIR (--prompt TEXT | --prompt-ids "1 2 3") --max-new-tokens N
        [--greedy | --temperature T --top-k K --top-p P] [--seed S] [--eos-id ID]
        [--json] [--nproc-per-node N --tensor-model-parallel-size N
        --pipeline-model-parallel-size M --expert-model-parallel-size E
        --sequence-parallel]

Text goes through the tokenizer the checkpoint records. ``--json`` prints one line
``{"prompt_ids": [...], "generated_ids": [...], "text": ...}`` (text: the continuation, null
without a tokenizer). Without sampling flags the tokens are drawn at temperature 1 (Megatron's
default); ``--greedy`` takes the argmax. Generation stops at the checkpoint's eos id (a converted
model's), else the tokenizer's end of document, unless ``--eos-id`` says otherwise (``-1``:
never stop early).

Launch: with ``--nproc-per-node 1`` (the default for tp = pp = 1) everything runs in this process
without torch.distributed; otherwise N local processes (gloo on CPU, nccl on GPUs) are started as
``tpfuse-train`` starts its ranks, N must equal tp × pp × ep, and rank 0 prints. A mixture-of-experts
checkpoint (trained at any ep) loads at any tp × pp; ``--expert-model-parallel-size E`` spreads its
experts over E data-parallel replicas that decode the same prompt together. Started by torchrun (or
that launcher), i.e. with WORLD_SIZE in the environment, the process is one of the ranks.
``--sequence-parallel`` (at tp > 1) splits the prefill's sequence over the TP ranks; decode steps
(one token, which TP cannot split) run without it (``sequence_parallel.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpfuse-generate",
                                     description="Generate from a tpfuse checkpoint.")
    parser.add_argument("--load", required=True, help="checkpoint directory (tpfuse-train --save)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    prompt.add_argument("--prompt-ids", help='prompt token ids, e.g. "1 2 3" or "1,2,3"')
    parser.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (same on all ranks)")
    parser.add_argument("--eos-id", type=int, default=None,
                        help="stop at this id (default: the checkpoint's eos id or the "
                             "tokenizer's end of document; -1: never)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="local processes (default tp × pp)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="ranks the experts of an MoE checkpoint are spread over")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the prefill's sequence over the TP ranks (tp > 1)")
    parser.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"])
    parser.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    return parser


def validate(args) -> None:
    """ValueError naming the flag, raised on every rank before anything is loaded."""
    sampling = [f for f in ("temperature", "top_k", "top_p") if getattr(args, f) is not None]
    if args.greedy and sampling:
        raise ValueError(f"--greedy cannot be combined with --{sampling[0].replace('_', '-')}")
    for name, minimum in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                          ("expert_model_parallel_size", 1), ("max_new_tokens", 0)):
        if getattr(args, name) < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got "
                             f"{getattr(args, name)}")
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.expert_model_parallel_size)
    if args.nproc_per_node is None:
        args.nproc_per_node = model_parallel
    if args.nproc_per_node != model_parallel:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node} must equal "
                         f"--tensor-model-parallel-size × --pipeline-model-parallel-size × "
                         f"--expert-model-parallel-size = {model_parallel}")


def check_experts(args) -> None:
    """ValueError before any group: --expert-model-parallel-size > 1 needs an MoE checkpoint
    whose expert count it divides."""
    ep = args.expert_model_parallel_size
    if ep == 1:
        return
    from tpfuse.checkpoint.reading import read_checkpoint_head

    experts = (read_checkpoint_head(args.load).get("model_config") or {}).get("num_moe_experts")
    if experts is None:
        raise ValueError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts "
                         f"checkpoint; {args.load} holds a dense model")
    if experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the checkpoint's "
                         f"{experts} experts")


def prompt_ids_from(args, tokenizer) -> list[int]:
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer, and checkpoint {args.load} records "
                             "none; give --prompt-ids")
        return tokenizer.tokenize(args.prompt)
    try:
        return [int(t) for t in args.prompt_ids.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids {args.prompt_ids!r}: expected integers like "
                         '"1 2 3"') from None


def sampling_kwargs(args) -> dict:
    if args.greedy:
        return {"greedy": True}
    return {"temperature": 1.0 if args.temperature is None else args.temperature,
            "top_k": args.top_k or 0, "top_p": 1.0 if args.top_p is None else args.top_p}


def default_eos_id(checkpoint_dir: str, tokenizer, vocab_size: int) -> int | None:
    """The checkpoint's recorded eos id (a converted model's), else the tokenizer's EOD."""
    from tpfuse.checkpoint.reading import read_checkpoint_head

    recorded = (read_checkpoint_head(checkpoint_dir).get("extra") or {}).get("eos_id")
    if isinstance(recorded, int) and 0 <= recorded < vocab_size:
        return recorded
    if tokenizer is not None and tokenizer.eod < vocab_size:
        return tokenizer.eod
    return None


def run(args, state=None) -> dict:
    """Load, generate; the result dict every rank computes (rank 0 prints it)."""
    from tpfuse.inference.generate import generate
    from tpfuse.checkpoint.reading import load_tokenizer
    from tpfuse.inference.loading import load_model

    tokenizer = load_tokenizer(args.load)
    prompt_ids = prompt_ids_from(args, tokenizer)
    chunks = load_model(args.load, state, sequence_parallel=args.sequence_parallel)
    eos = args.eos_id if args.eos_id is not None else default_eos_id(args.load, tokenizer,
                                                                     chunks[0].config.vocab_size)
    (generated,) = generate(chunks, [prompt_ids], args.max_new_tokens,
                            eos_id=None if eos is None or eos < 0 else eos, seed=args.seed,
                            state=state, **sampling_kwargs(args))
    text = tokenizer.detokenize(generated) if tokenizer is not None else None
    return {"prompt_ids": prompt_ids, "generated_ids": generated, "text": text}


def _print(result: dict, args) -> None:
    if args.json:
        print(json.dumps(result), flush=True)
    elif result["text"] is not None:
        print((args.prompt or "") + result["text"], flush=True)
    else:
        print(" ".join(str(t) for t in result["prompt_ids"] + result["generated_ids"]), flush=True)


def _run_as_rank(args) -> None:
    from tpfuse.parallel import parallel_state
    from tpfuse.runtime.initialize import initialize_distributed, shutdown_distributed

    initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    import torch.distributed as dist

    finished = False
    try:
        if dist.get_world_size() != args.nproc_per_node:
            raise ValueError(f"world size {dist.get_world_size()} != tensor × pipeline parallel "
                             f"size {args.nproc_per_node}")
        state = parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size)
        result = run(args, state)
        if dist.get_rank() == 0:
            _print(result, args)
        finished = True
    finally:
        shutdown_distributed(finished)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    is_rank = "WORLD_SIZE" in os.environ
    try:
        validate(args)
        check_experts(args)
        if is_rank:
            _run_as_rank(args)
        elif args.nproc_per_node == 1:
            _print(run(args), args)
        else:
            from tpfuse.runtime.launcher import run_local

            return run_local(args.nproc_per_node, argv,
                             program=[sys.executable, "-m", "tpfuse.inference.cli"])
    except (ValueError, FileNotFoundError) as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"tpfuse-generate: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
