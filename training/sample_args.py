"""The sample printed at the end of training (``--sample-prompt``): its flags and checks.

Decoding is greedy unless a sampling flag is given; then it samples as ``tpfuse-generate`` does
(temperature → top-k → top-p, one draw per token from a generator seeded with ``--sample-seed``,
the same on every rank), so a run prints the same sample each time. A small model decoded
greedily tends to fall into its most frequent continuation (for source code: runs of spaces);
sampling shows what it has learnt instead.
"""
from __future__ import annotations

SAMPLING_FLAGS = ("sample_temperature", "sample_top_k", "sample_top_p")


def add_sample_arguments(parser) -> None:
    sample = parser.add_argument_group("sample at the end of training")
    sample.add_argument("--sample-prompt", default=None,
                        help="print this prompt's continuation by the trained model (text for "
                             "--tokenizer-type; default: no sample)")
    sample.add_argument("--sample-max-new-tokens", type=int, default=64,
                        help="length of that continuation in tokens")
    sample.add_argument("--sample-temperature", type=float, default=None,
                        help="sample at this temperature (default: greedy decoding unless a "
                             "--sample-* sampling flag is given, then 1.0)")
    sample.add_argument("--sample-top-k", type=int, default=None,
                        help="sample among the k likeliest tokens (0: all)")
    sample.add_argument("--sample-top-p", type=float, default=None,
                        help="sample from the smallest set of tokens holding this probability "
                             "mass (1: all)")
    sample.add_argument("--sample-seed", type=int, default=1234,
                        help="seed of the sampling generator (the same on every rank)")


def is_greedy(args) -> bool:
    return all(getattr(args, name) is None for name in SAMPLING_FLAGS)


def sampling_kwargs(args) -> dict:
    """``generate``'s decoding keywords for the trainer's sample."""
    if is_greedy(args):
        return {"greedy": True}
    return {"temperature": 1.0 if args.sample_temperature is None else args.sample_temperature,
            "top_k": args.sample_top_k or 0,
            "top_p": 1.0 if args.sample_top_p is None else args.sample_top_p,
            "seed": args.sample_seed}


def describe_sampling(args) -> str:
    """How the sample was decoded, for its header line."""
    if is_greedy(args):
        return "greedy"
    chosen = sampling_kwargs(args)
    return (f"temperature {chosen['temperature']:g}, top-k {chosen['top_k']}, "
            f"top-p {chosen['top_p']:g}, seed {chosen['seed']}")


def check_sample_arguments(args) -> None:
    """The prompt must be text the tokenizer takes and the sampling settings valid (checked
    before any training, on every rank)."""
    if not args.sample_prompt:
        return
    try:
        ids = args.tokenizer.tokenize(args.sample_prompt)
    except ValueError:
        ids = []
    if not ids:
        raise ValueError(f"--sample-prompt {args.sample_prompt!r} gives no tokens with "
                         f"{args.tokenizer!r} (NullTokenizer takes ids: \"1 2 3\")")
    temperature, top_k, top_p = (getattr(args, name) for name in SAMPLING_FLAGS)
    if temperature is not None and not temperature > 0:
        raise ValueError(f"--sample-temperature must be > 0, got {temperature} (omit the "
                         "sampling flags for greedy decoding)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"--sample-top-k must be >= 0 (0: all tokens), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"--sample-top-p must be in (0, 1], got {top_p}")
