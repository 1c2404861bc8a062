"""``tpfuse-convert``: HuggingFace GPT-2 / Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE / Qwen3 /
Qwen3-MoE checkpoints to tpfuse and back.

    tpfuse-convert --from-hf HF_DIR --save DIR [--tensor-model-parallel-size N
                   --pipeline-model-parallel-size M] [--make-vocab-size-divisible-by 128]
                   [--params-dtype float32|bfloat16|float16]
    tpfuse-convert --to-hf --load DIR --save HF_DIR
    tpfuse-convert --verify DIR
    tpfuse-convert --ckpt-convert-format torch_dist|tpfuse --load DIR --save OUT

``--from-hf`` reads ``config.json`` + safetensors (no ``transformers`` needed) and writes a tpfuse
checkpoint for that layout (``tpfuse-generate --load DIR`` and ``load_model`` read it at any
layout); ``--to-hf`` writes ``config.json`` + ``model.safetensors`` that
``AutoModelForCausalLM.from_pretrained`` loads. Errors name the problem (exit code 2); nothing
is left half-written. Every conversion writes ``certificate.json`` into the folder it wrote: the
max |Δ logit| between transformers and tpfuse on a fixed prompt and its derived tolerance
(``certificate.py``); above the tolerance the conversion is refused. ``--verify DIR`` recomputes
a written folder's certificate. ``--ckpt-convert-format`` (Megatron's flag name) rewrites a
training checkpoint — model, optimizer, scheduler, iteration — in the other checkpoint format
(``torch_dist_io.py``).
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpfuse-convert",
                                     description="Convert HuggingFace GPT-2 / Llama / Mistral / "
                                                 "Qwen2 / Mixtral / Qwen2-MoE / Qwen3 / "
                                                 "Qwen3-MoE checkpoints.")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR", help="HuggingFace model directory")
    direction.add_argument("--to-hf", action="store_true", help="export --load to --save")
    direction.add_argument("--verify", metavar="DIR",
                           help="recompute the logit certificate of a converted folder")
    direction.add_argument("--ckpt-convert-format", choices=["tpfuse", "torch_dist"],
                           help="rewrite the training checkpoint --load in this format to --save")
    parser.add_argument("--load", help="tpfuse checkpoint directory (with --to-hf)")
    parser.add_argument("--save", help="directory to write (new or empty)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this × tp (Megatron's)")
    parser.add_argument("--params-dtype", choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype (default: the HF weights' dtype)")
    return parser


def main(argv=None) -> int:
    from tpfuse.models.config import DTYPES

    from . import certificate
    from .hf import export_hf, import_hf

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.verify:
            _print_certificate(certificate.verify(args.verify), args.verify)
            return 0
        if args.ckpt_convert_format:
            _convert_format(args)
            return 0
        if not args.save:
            raise ValueError("--from-hf and --to-hf need --save DIR")
        if args.to_hf:
            if not args.load:
                raise ValueError("--to-hf needs --load DIR (the tpfuse checkpoint)")
            hf = export_hf(args.load, args.save)
            print(f"> wrote {hf['architectures'][0]} to {args.save}", flush=True)
            _print_certificate(certificate.certify(args.save, args.load, args.save), args.save)
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
            _print_certificate(certificate.certify(args.save, args.save, args.from_hf),
                               args.save)
    except (ValueError, FileNotFoundError) as error:
        print(f"tpfuse-convert: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def _convert_format(args) -> None:
    from .torch_dist_io import torch_dist_to_tpfuse, tpfuse_to_torch_dist

    if not (args.load and args.save):
        raise ValueError("--ckpt-convert-format needs --load DIR (the checkpoint to rewrite) "
                         "and --save OUT")
    convert = tpfuse_to_torch_dist if args.ckpt_convert_format == "torch_dist" \
        else torch_dist_to_tpfuse
    final = convert(args.load, args.save)
    print(f"> wrote {final} ({args.ckpt_convert_format} format)", flush=True)


def _print_certificate(result: dict, folder: str) -> None:
    if not result["computed"]:
        print(f"> {folder}: no logit certificate ({result['reason']})", flush=True)
        return
    print(f"> {folder}: max |logit difference| vs transformers {result['max_abs_logit_diff']:.3e} "
          f"<= tolerance {result['tolerance']:.3e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
