"""``tpfuse-convert``: HuggingFace GPT-2 / Llama / Mixtral checkpoints to tpfuse and back.

    tpfuse-convert --from-hf HF_DIR --save DIR [--tensor-model-parallel-size N
                   --pipeline-model-parallel-size M] [--make-vocab-size-divisible-by 128]
                   [--params-dtype float32|bfloat16|float16]
    tpfuse-convert --to-hf --load DIR --save HF_DIR

``--from-hf`` reads ``config.json`` + safetensors (no ``transformers`` needed) and writes a tpfuse
checkpoint for that layout (``tpfuse-generate --load DIR`` and ``load_model`` read it at any
layout); ``--to-hf`` writes ``config.json`` + ``model.safetensors`` that
``AutoModelForCausalLM.from_pretrained`` loads. Errors name the problem (exit code 2); nothing
is left half-written.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpfuse-convert",
                                     description="Convert HuggingFace GPT-2 / Llama / Mixtral "
                                                 "checkpoints.")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR", help="HuggingFace model directory")
    direction.add_argument("--to-hf", action="store_true", help="export --load to --save")
    parser.add_argument("--load", help="tpfuse checkpoint directory (with --to-hf)")
    parser.add_argument("--save", required=True, help="directory to write (new or empty)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this × tp (Megatron's)")
    parser.add_argument("--params-dtype", choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype (default: the HF weights' dtype)")
    return parser


def main(argv=None) -> int:
    from tpfuse.models.config import DTYPES

    from .hf import export_hf, import_hf

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.to_hf:
            if not args.load:
                raise ValueError("--to-hf needs --load DIR (the tpfuse checkpoint)")
            hf = export_hf(args.load, args.save)
            print(f"> wrote {hf['architectures'][0]} to {args.save}", flush=True)
        else:
            if args.load:
                raise ValueError("--load belongs to --to-hf; --from-hf reads HF_DIR")
            config = import_hf(
                args.from_hf, args.save,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                params_dtype=DTYPES[args.params_dtype] if args.params_dtype else None)
            print(f"> wrote a tpfuse checkpoint ({config.num_layers} layers, tp="
                  f"{config.tensor_model_parallel_size} pp={config.pipeline_model_parallel_size}, "
                  f"padded vocab {config.padded_vocab_size}) to {args.save}", flush=True)
    except (ValueError, FileNotFoundError) as error:
        print(f"tpfuse-convert: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
