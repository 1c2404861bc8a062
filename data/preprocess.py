"""tpfuse-preprocess: text files / directories / JSONL → an indexed ``.bin`` + ``.idx`` token file pair.

    tpfuse-preprocess --input DIR_OR_FILE [...] --output-prefix data/stdlib --tokenizer byte --append-eod
    tpfuse-preprocess --input docs.jsonl --output-prefix data/docs --append-eod \
                      --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json \
                      --merge-file merges.txt

Inputs, in the order given (each expanded in sorted order, so the output is reproducible):

- a file ending in ``.jsonl`` or ``.json``: JSON lines, each line one document, its text under
  ``--json-key`` (default ``text``); blank lines are skipped.
- any other file: one document (the whole file). With the byte tokenizer the raw bytes are the
  ids (no decoding); other tokenizers read UTF-8 (undecodable bytes replaced).
- a directory: walked recursively; files whose name matches one of ``--pattern``'s comma-separated
  globs (default ``*.py,*.txt,*.md,*.rst``: text-like files) become documents. Hidden entries,
  ``__pycache__``, ``site-packages`` and ``dist-packages`` are always skipped (the standard library
  folder holds the installed packages under ``site-packages``); ``--exclude`` adds globs matched
  against each entry's name and its path relative to the directory (e.g. ``--exclude 'test*'``).

The tokenizer is either ``--tokenizer SPEC`` (``byte``, the default; a ``tokenizer.json``) or
Megatron's tokenizer flags (``--tokenizer-type`` with ``--vocab-file`` / ``--merge-file`` /
``--tokenizer-model`` / ``--vocab-size`` / ``--tiktoken-*``, as ``tpfuse-train`` takes them; see
``tokenizer_options.py``), never both.

Empty documents are skipped. ``--append-eod`` ends each document with the tokenizer's EOD id (needed
for ``eod_mask_loss`` / ``reset_position_ids`` to see document boundaries). ``--workers N``
tokenizes in N processes (useful for BPE; the byte tokenizer is I/O-bound). The two output files
appear only when complete (temporary names, then ``os.replace``).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import multiprocessing
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from .indexed import IndexedDatasetWriter, bin_path, idx_path
from .tokenizer import build_tokenizer
from .tokenizer_builtin import ByteTokenizer
from .tokenizer_options import TokenizerOptions, add_tokenizer_arguments, build_megatron_tokenizer

DEFAULT_PATTERN = "*.py,*.txt,*.md,*.rst"
ALWAYS_SKIPPED = ("__pycache__", "site-packages", "dist-packages")
JSON_SUFFIXES = (".jsonl", ".json")


# --------------------------------------------------------------------------------- input discovery
def _matches(name: str, globs) -> bool:
    return any(fnmatch.fnmatch(name, g) for g in globs)


def _skipped(name: str, rel: str, exclude) -> bool:
    return name.startswith(".") or name in ALWAYS_SKIPPED or _matches(name, exclude) or _matches(rel, exclude)


def walk_directory(root: str, pattern, exclude) -> list[str]:
    """Files under ``root`` whose name matches ``pattern``, recursively, sorted, minus exclusions."""
    found = []
    for directory, subdirs, files in os.walk(root):
        rel_dir = os.path.relpath(directory, root)
        subdirs[:] = sorted(d for d in subdirs if not _skipped(d, os.path.normpath(os.path.join(rel_dir, d)), exclude))
        for name in sorted(files):
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if _matches(name, pattern) and not _skipped(name, rel, exclude):
                found.append(os.path.join(directory, name))
    return found


def collect_sources(inputs, pattern, exclude) -> list[str]:
    """Every input file, directories expanded; raises ValueError for a missing input or no files."""
    sources = []
    for item in inputs:
        if os.path.isdir(item):
            sources.extend(walk_directory(item, pattern, exclude))
        elif os.path.isfile(item):
            sources.append(item)
        else:
            raise ValueError(f"--input {item!r}: no such file or directory")
    if not sources:
        raise ValueError(f"--input {inputs}: no files matched --pattern {','.join(pattern)!r}")
    return sources


# --------------------------------------------------------------------------------- tokenizing
_WORKER_TOKENIZER = None


def tokenizer_of(spec, eod_token=None):
    """``spec``: a ``build_tokenizer`` spec string, or Megatron's flags (TokenizerOptions)."""
    if isinstance(spec, TokenizerOptions):
        if eod_token is not None:
            raise ValueError("--eod-token applies to --tokenizer TOKENIZER_JSON only (Megatron's "
                             "--tokenizer-type defines its own end of document)")
        return build_megatron_tokenizer(spec)
    return build_tokenizer(spec, eod_token)


def _init_worker(spec, eod_token):
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer_of(spec, eod_token)


def encode(tokenizer, text, append_eod: bool) -> np.ndarray:
    """One document's ids (int64), EOD appended when asked; empty when the text is empty."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = tokenizer.tokenize_array(text)
    else:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = np.asarray(tokenizer.tokenize(text), dtype=np.int64)
    if ids.size == 0:
        return ids.astype(np.int64)
    if append_eod:
        return np.append(ids.astype(np.int64), tokenizer.eod)
    return ids.astype(np.int64)


def _encode_in_worker(job):
    text, append_eod = job
    return encode(_WORKER_TOKENIZER, text, append_eod)


def _jsonl_texts(path: str, key: str):
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_number}: not valid JSON ({err.msg})") from None
                text = record.get(key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{line_number}: no string under --json-key {key!r}")
                yield text, len(line)


def iter_texts(sources, json_key: str):
    """(document text or bytes, input bytes it stands for) for every document of every source."""
    for path in sources:
        if path.endswith(JSON_SUFFIXES):
            yield from _jsonl_texts(path, json_key)
        else:
            with open(path, "rb") as f:
                data = f.read()
            yield data, len(data)


# --------------------------------------------------------------------------------- the job
def preprocess(sources, output_prefix, tokenizer_spec="byte", json_key="text", append_eod=False,
               workers=1, eod_token=None, progress=True) -> dict:
    """Tokenizes every document of ``sources`` into ``output_prefix.bin/.idx``; returns a summary.
    ``tokenizer_spec``: as ``tokenizer_of`` takes it."""
    tokenizer = tokenizer_of(tokenizer_spec, eod_token)
    total_bytes = sum(os.path.getsize(p) for p in sources)
    start, documents, tokens = time.perf_counter(), 0, 0
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    texts = iter_texts(sources, json_key)
    sizes = []

    def jobs():
        for text, size in texts:
            sizes.append(size)
            yield text, append_eod

    # "spawn": a forked child of a process holding torch / gloo threads can deadlock
    pool = (multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer_spec, eod_token))
            if workers > 1 else None)
    try:
        encoded = (pool.imap(_encode_in_worker, jobs(), chunksize=16) if pool
                   else (encode(tokenizer, text, eod) for text, eod in jobs()))
        with IndexedDatasetWriter(output_prefix, vocab_size=tokenizer.vocab_size) as writer:
            for i, ids in enumerate(encoded):
                bar.update(sizes[i])
                if ids.size:
                    writer.add_document(ids)
                    documents, tokens = documents + 1, tokens + int(ids.size)
            if documents == 0:    # raised inside the writer: it aborts, publishes nothing
                raise ValueError("no text to tokenize (every document is empty); nothing was "
                                 f"written (an existing {output_prefix}.bin/.idx is kept)")
            bar.set_postfix_str(f"{documents} documents, {tokens} tokens")
    finally:
        bar.close()
        if pool:
            pool.close()
            pool.join()
    return {"documents": documents, "tokens": tokens, "files": len(sources), "bytes": total_bytes,
            "seconds": time.perf_counter() - start, "bin": bin_path(output_prefix), "idx": idx_path(output_prefix),
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod}


def _globs(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpfuse-preprocess",
        description="Tokenize text files, directories or JSONL into an indexed .bin/.idx pair.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_DIR_OR_JSONL",
                        help="text files (one document each), directories (walked recursively) or "
                             ".jsonl/.json files (one document per line)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default=None,
                        help="'byte' (built in: bytes 0..255, EOD 256; the default) or a "
                             "HuggingFace tokenizer.json; or give Megatron's --tokenizer-type")
    parser.add_argument("--json-key", default="text", help="key of the text in each JSON line")
    parser.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    parser.add_argument("--pattern", default=DEFAULT_PATTERN,
                        help=f"comma-separated file-name globs taken from directories (default {DEFAULT_PATTERN!r})")
    parser.add_argument("--exclude", default="",
                        help="comma-separated globs of names or relative paths skipped in directories "
                             f"(always skipped: hidden entries, {', '.join(ALWAYS_SKIPPED)})")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument("--eod-token", default=None, help="EOD token of a tokenizer.json (default: guessed)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_tokenizer_arguments(parser)
    return parser


def tokenizer_spec_of(args):
    """``--tokenizer`` (default ``byte``) or the TokenizerOptions of Megatron's flags."""
    options = TokenizerOptions.from_values(vars(args))
    if args.tokenizer_type is None:
        given = [name for name in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size")
                 if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --tokenizer-type")
        return args.tokenizer or "byte"
    if args.tokenizer is not None:
        raise ValueError(f"give --tokenizer {args.tokenizer} or --tokenizer-type "
                         f"{args.tokenizer_type}, not both")
    return options


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    try:
        spec = tokenizer_spec_of(args)
        sources = collect_sources(args.input, _globs(args.pattern), _globs(args.exclude))
        try:
            summary = preprocess(sources, args.output_prefix, spec, args.json_key,
                                 args.append_eod, args.workers, args.eod_token,
                                 progress=not args.quiet)
        except ValueError as err:
            if str(err).startswith("no text to tokenize"):
                raise ValueError(f"--input {' '.join(args.input)}: {err}") from None
            raise
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    print(f"tpfuse-preprocess: {summary['documents']} documents, {summary['tokens']} tokens "
          f"(vocab {summary['vocab_size']}, eod {summary['eod']}) from {summary['files']} files in "
          f"{summary['seconds']:.2f} s -> {summary['bin']}, {summary['idx']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
