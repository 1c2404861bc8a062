"""The README's main job: a small GPT trained on the Python standard library's own source files.

``prepare_default_data(argv)``: when the trainer's flags name no data (neither ``--data-path`` nor
``--mock-data``), tokenize the standard library's ``*.py`` files once with the byte tokenizer into
``<cache>/stdlib_byte.{bin,idx}`` (cache: ``--data-cache-path``, else ``$TPFUSE_CACHE``, else
``~/.cache/tpfuse``) and return the flags with ``--data-path`` and ``--data-cache-path`` added.
"""
from __future__ import annotations

import os
import sysconfig

CORPUS_NAME = "stdlib_byte"


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, item in enumerate(argv):
        if item == flag and i + 1 < len(argv):
            return argv[i + 1]
        if item.startswith(flag + "="):
            return item.split("=", 1)[1]
    return None


def default_cache_dir(argv: list[str]) -> str:
    return (_flag_value(argv, "--data-cache-path") or os.environ.get("TPFUSE_CACHE")
            or os.path.join(os.path.expanduser("~"), ".cache", "tpfuse"))


def stdlib_source_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def prepare_default_data(argv: list[str]) -> list[str]:
    names_data = any(a == "--mock-data" or a.startswith("--data-path") for a in argv)
    if names_data or any(a in ("-h", "--help") for a in argv):
        return argv
    cache = default_cache_dir(argv)
    prefix = os.path.join(cache, CORPUS_NAME)
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        from tpfuse.data.preprocess import main as preprocess

        os.makedirs(cache, exist_ok=True)
        print(f"> preparing the default corpus: the standard library's *.py files under "
              f"{stdlib_source_dir()} -> {prefix}.bin/.idx (byte tokenizer)", flush=True)
        code = preprocess(["--input", stdlib_source_dir(), "--output-prefix", prefix,
                           "--tokenizer", "byte", "--pattern", "*.py", "--append-eod"])
        if code:
            raise SystemExit(code)
    extra = ["--data-path", prefix]
    if _flag_value(argv, "--data-cache-path") is None:
        extra += ["--data-cache-path", cache]
    return list(argv) + extra
