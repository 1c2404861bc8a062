"""The docs stay true to the code: README.md, docs/*.md and benchmarks/*.md are read as data.

Three checks, each failing with ``FILE:LINE: what is wrong``:

- Flags. A flag in a command (a ``bash`` block line or an inline code span starting with a
  console script such as ``tpfuse-generate``, or with ``python -m tpfuse.pretrain_gpt`` /
  ``torchrun ... -m tpfuse.pretrain_gpt``) must be one that command's parser accepts; a flag named
  anywhere else in the prose must be accepted by at least one tpfuse command. The parsers are the
  ones the commands themselves build: each console script of setup.py is called with ``--help``
  and the parser that prints the help is captured (``tpfuse-train``: its launcher's parser and
  the trainer's, ``python -m tpfuse.pretrain_gpt --help``).
- Signatures. A fully qualified call shape, ``tpfuse.pkg.module.name(params)``, in a
  ```` ```python signature ```` block (one entry per line, continued while parentheses are open) or
  as a whole inline code span, must match ``inspect.signature`` of the object it names: the same
  parameters in the same order, of the same kind (positional / keyword-only / ``*args`` /
  ``**kwargs``) and with the same defaults. An inline quote may end in ``...`` (the parameters
  quoted must then be the first ones); ``(...)`` only checks that the object exists and is
  callable. ``-> annotation`` after the parameters is prose, not checked.
- Snippets. Every other ```` ```python ```` block runs, each in a fresh namespace, all of them in
  one subprocess (world size 1, CPU). A block tagged ```` ```python no-run ```` is shown, not run.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_files() -> list[str]:
    docs = [os.path.join(ROOT, "README.md")]
    for folder in ("docs", "benchmarks"):
        path = os.path.join(ROOT, folder)
        docs += sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".md"))
    return docs


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


# ------------------------------------------------------------------------------- markdown
@dataclass
class Block:
    """A fenced code block: info string (``python signature``), first content line, lines."""
    info: str
    line: int
    lines: list[str]

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def tags(self) -> list[str]:
        return self.info.split()[1:]


@dataclass
class Doc:
    path: str
    blocks: list[Block] = field(default_factory=list)
    prose: list[tuple[int, str]] = field(default_factory=list)   # (line number, text)


FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")


def parse_doc(path: str) -> Doc:
    doc = Doc(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    open_fence, block = None, None
    for number, line in enumerate(lines, start=1):
        match = FENCE.match(line)
        if open_fence is None and match:
            open_fence, block = match.group(1), Block(match.group(2).strip(), number + 1, [])
            continue
        if open_fence is not None:
            if line.strip().startswith(open_fence) and line.strip().strip(open_fence[0]) == "":
                doc.blocks.append(block)
                open_fence, block = None, None
            else:
                block.lines.append(line)
            continue
        doc.prose.append((number, line))
    assert open_fence is None, f"{rel(path)}: a code fence opened at line {block.line - 1} never closes"
    return doc


INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def inline_spans(doc: Doc):
    """(line, text of the span) for every inline code span of the prose."""
    for number, line in doc.prose:
        for match in INLINE_CODE.finditer(line):
            yield number, match.group(2).strip()


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return [parse_doc(p) for p in doc_files()]


# ------------------------------------------------------------------------------- parsers
class _Captured(BaseException):
    """Raised from ``print_help`` to carry the parser out of a command's ``main``."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def captured_parsers(main, argv) -> list[argparse.ArgumentParser]:
    """The parser that prints the help when ``main(argv)`` runs (argv asks for help)."""
    original = argparse.ArgumentParser.print_help

    def capture(self, file=None):
        raise _Captured(self)

    argparse.ArgumentParser.print_help = capture
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(argv)
    except _Captured as captured:
        return [captured.parser]
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.print_help = original
    raise AssertionError(f"{main.__module__}.{main.__name__}({argv}) printed no argparse help: "
                         f"test_docs.py finds a command's flags through its --help")


def console_scripts() -> dict[str, str]:
    """``{"tpfuse-train": "tpfuse.training.launcher:main", ...}`` from setup.py."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        text = f.read()
    found = dict(re.findall(r'"(tpfuse-[\w-]+)\s*=\s*([\w.]+:\w+)"', text))
    assert found, "setup.py names no tpfuse-* console script"
    return found


def _entry_point(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


TRAINER = "python -m tpfuse.pretrain_gpt"


def _flags_of(parsers) -> set[str]:
    return {s for p in parsers for a in p._actions for s in a.option_strings if s.startswith("--")}


@pytest.fixture(scope="module")
def flag_choices() -> dict[str, set[str]]:
    """Every tpfuse command's flags that take a fixed set of values: flag -> the values."""
    from tpfuse import pretrain_gpt

    parsers = captured_parsers(pretrain_gpt.main, ["--help"])
    for target in console_scripts().values():
        parsers += captured_parsers(_entry_point(target), ["--help"])
    return {flag: {str(c) for c in action.choices} for p in parsers for action in p._actions
            if action.choices is not None for flag in action.option_strings}


CHOICE_LIST = re.compile(r"(--[a-z][a-z0-9-]*) ([\w.-]+(?:\|[\w.-]+)+)")


def choice_problems(doc: Doc, choices: dict[str, set[str]]) -> list[str]:
    """`--flag a|b|c` in a doc: every value named is one the flag accepts."""
    problems = []
    lines = list(doc.prose) + [(b.line + i, l) for b in doc.blocks for i, l in enumerate(b.lines)]
    for number, text in lines:
        for flag, values in CHOICE_LIST.findall(text.replace("\\|", "|")):
            unknown = [v for v in values.split("|") if flag in choices and v not in choices[flag]]
            if unknown:
                problems.append(f"{rel(doc.path)}:{number}: {flag} does not accept {unknown} "
                                f"(it takes {sorted(choices[flag])})")
    return problems


def test_value_check_catches_drift(tmp_path, flag_choices):
    page = tmp_path / "page.md"
    page.write_text("`--pipeline-schedule 1f1b|gpipe` and `--cp-comm-type p2p|a2a`\n")
    problems = choice_problems(parse_doc(str(page)), flag_choices)
    assert len(problems) == 1 and "['gpipe']" in problems[0] and ":1:" in problems[0], problems


def test_every_flag_value_named_is_accepted(docs, flag_choices):
    problems = [p for doc in docs for p in choice_problems(doc, flag_choices)]
    assert not problems, "docs name values the flags refuse:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def command_flags() -> dict[str, set[str]]:
    """Every command's accepted long flags."""
    from tpfuse import pretrain_gpt

    trainer = _flags_of(captured_parsers(pretrain_gpt.main, ["--help"]))
    flags = {TRAINER: trainer}
    for script, target in console_scripts().items():
        flags[script] = _flags_of(captured_parsers(_entry_point(target), ["--help"]))
    flags["tpfuse-train"] |= trainer       # the launcher passes every other flag on
    for script in sorted(os.listdir(os.path.join(ROOT, "benchmarks"))):
        if script.endswith(".py") and not script.startswith("test_"):
            flags[f"benchmarks/{script}"] = script_flags(os.path.join(ROOT, "benchmarks", script))
    for module, path in MODULE_TOOLS.items():
        flags[module] = script_flags(os.path.join(ROOT, path))
    return flags


# Library modules run as tools (``python3 -m <module>``), read like the benchmark scripts.
MODULE_TOOLS = {"tpfuse.kernels.sm90_report": "kernels/sm90_report.py",
                "tpfuse.tp_layers.activation_memory": "tp_layers/activation_memory.py"}


def script_flags(path: str) -> set[str]:
    """The ``--flags`` a script's ``add_argument`` calls declare, read from its source (the
    benchmark scripts are not imported: some need a GPU)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


# Flags of other programs the docs use: pip's, pytest-benchmark's, torchrun's.
FOREIGN_FLAGS = {"--index-url", "--benchmark-enable", "--benchmark-disable", "--benchmark-columns",
                 "--benchmark-sort",
                 "--nproc-per-node", "--nproc_per_node", "--no-deps", "--help"}
FLAG = re.compile(r"(?<![\w\-/])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")


def _command_of(words: list[str], scripts) -> tuple[str | None, int]:
    """(the command these words run, index of its first argument): a console script, the
    trainer module (python -m / torchrun -m) or a benchmarks/ script; None for another
    program."""
    i = 0
    while i < len(words) and re.match(r"^[A-Z_][A-Z0-9_]*=", words[i]):
        i += 1                                                   # VAR=value prefixes
    words = words[i:]
    if not words:
        return None, 0
    if words[0] in scripts:
        return words[0], i + 1
    if words[0] in ("python", "python3", "torchrun"):
        for j, word in enumerate(words[1:], start=1):
            if word in scripts:                                  # python3 benchmarks/x.py
                return word, i + j + 1
            if word == "-m":
                module = words[j + 1] if j + 1 < len(words) else None
                if module == "tpfuse.pretrain_gpt":
                    return TRAINER, i + j + 2
                return (module, i + j + 2) if module in scripts else (None, 0)
            if not word.startswith("-") and words[0] != "torchrun":
                break
    return None, 0


def _shell_commands(block: Block):
    """(line, command text) per command of a bash block: continuations joined, comments
    dropped, split at && ; | ."""
    text, start = "", None
    for offset, line in enumerate(block.lines):
        line = re.sub(r"(^|\s)#.*$", "", line)
        start = block.line + offset if start is None else start
        if line.rstrip().endswith("\\"):
            text += line.rstrip()[:-1] + " "
            continue
        for command in re.split(r"&&|;|\|\|?", text + line):
            yield start, command
        text, start = "", None


def flag_problems(doc: Doc, flags: dict[str, set[str]]) -> list[str]:
    scripts = set(flags) - {TRAINER}
    every = set().union(*flags.values())
    problems = []

    def check_command(line, command):
        words = command.split()
        name, first = _command_of(words, scripts)
        if name is None:
            return True
        for flag in FLAG.findall(" ".join(words[first:])):
            if flag not in flags[name]:
                problems.append(f"{rel(doc.path)}:{line}: `{name}` has no flag {flag}")
        return True

    for block in doc.blocks:
        if block.language in ("bash", "sh", "shell", "console"):
            for line, command in _shell_commands(block):
                check_command(line, command)
    for number, text in doc.prose:
        spans = [m.group(2).strip() for m in INLINE_CODE.finditer(text)]
        in_commands = set()
        for span in spans:
            words = span.split()
            name, _ = _command_of(words, scripts)
            if name is not None or (words and words[0] in ("python", "python3", "pip", "pytest",
                                                            "torchrun", "bash")):
                check_command(number, span)
                in_commands |= set(FLAG.findall(span))
        for flag in FLAG.findall(text):
            if flag in in_commands or flag in every or flag in FOREIGN_FLAGS:
                continue
            problems.append(f"{rel(doc.path)}:{number}: no tpfuse command has the flag {flag}")
    return problems


def test_every_flag_named_exists(docs, command_flags):
    problems = [p for doc in docs for p in flag_problems(doc, command_flags)]
    assert not problems, "docs name flags the parsers do not have:\n" + "\n".join(problems)


def test_flag_scan_sees_the_commands(docs, command_flags):
    """The scan above is not vacuous: the README's commands are found and parsed."""
    readme = next(d for d in docs if rel(d.path) == "README.md")
    commands = [c for b in readme.blocks if b.language == "bash" for _, c in _shell_commands(b)]
    names = {_command_of(c.split(), set(command_flags))[0] for c in commands}
    assert "tpfuse-train" in names
    assert {"--tensor-model-parallel-size", "--help-trainer", "--list"} <= set().union(
        *command_flags.values())


def test_flag_check_catches_drift(tmp_path, command_flags):
    """A flag of another command, a flag no command has, and a command's own flag."""
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        ```bash
        tpfuse-generate --load ckpt --max-new-tokens 4 \\
                        --no-such-flag 3     # a comment --not-checked
        ```
        Then `tpfuse-layout --world-size 8 --tp 2 --greedy` and `--bogus-flag`, but `--bf16`.
        `torchrun --nproc-per-node 8 -m tpfuse.pretrain_gpt --num-layers 2 --num-layer 2`
        """))
    problems = flag_problems(parse_doc(str(page)), command_flags)
    where = rel(str(page))
    assert problems == [
        f"{where}:2: `tpfuse-generate` has no flag --no-such-flag",
        f"{where}:5: `tpfuse-layout` has no flag --greedy",
        f"{where}:5: no tpfuse command has the flag --bogus-flag",
        f"{where}:6: `python -m tpfuse.pretrain_gpt` has no flag --num-layer",
    ], problems


# ---------------------------------------------------------------------------- signatures
@dataclass
class QuotedSignature:
    path: str
    line: int
    name: str           # tpfuse.pkg.module.obj[.attr]
    params: str | None  # None: "(...)", existence only
    partial: bool       # ends with "...": a prefix of the parameters


def _split_call(text: str) -> tuple[str, str, str] | None:
    """"tpfuse.x.f(a, b=(1, 2)) -> T" -> ("tpfuse.x.f", "a, b=(1, 2)", rest); None if the
    parentheses do not close."""
    match = re.match(r"\s*(tpfuse(?:\.\w+)+)\(", text)
    if not match:
        return None
    depth, quote = 0, None
    for i in range(match.end() - 1, len(text)):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return match.group(1), text[match.end():i], text[i + 1:]
    return None


def _quoted(path, line, name, params) -> QuotedSignature:
    params = " ".join(params.split())
    if params == "...":
        return QuotedSignature(path, line, name, None, True)
    partial = bool(re.search(r"(^|,)\s*\.\.\.\s*$", params))
    if partial:
        params = re.sub(r"(^|,)\s*\.\.\.\s*$", "", params)
    return QuotedSignature(path, line, name, params, partial)


def quoted_signatures(doc: Doc) -> tuple[list[QuotedSignature], list[str]]:
    found, problems = [], []
    for block in doc.blocks:
        if block.language != "python" or "signature" not in block.tags:
            continue
        pending, start = "", None
        for offset, line in enumerate(block.lines):
            if not pending and (not line.strip() or line.strip().startswith("#")):
                continue
            start = block.line + offset if not pending else start
            pending += " " + line
            split = _split_call(pending)
            if split is None and pending.count("(") > pending.count(")"):
                continue
            if split is None:
                problems.append(f"{rel(doc.path)}:{start}: not a `tpfuse.module.name(params)` "
                                f"signature line: {pending.strip()}")
            else:
                found.append(_quoted(doc.path, start, split[0], split[1]))
            pending = ""
        if pending:
            problems.append(f"{rel(doc.path)}:{start}: unclosed signature: {pending.strip()}")
    for number, span in inline_spans(doc):
        split = _split_call(span)
        if split is not None and re.fullmatch(r"\s*(->.*)?", split[2]):
            found.append(_quoted(doc.path, number, split[0], split[1]))
    return found, problems


def resolve(name: str):
    """The object a dotted name names, as ``from a.b import c`` finds it: inner names are modules
    where such a module exists (``tpfuse.pipeline.simulate.simulate``), the last one an attribute
    when the package has one (``tpfuse.kernels.matmul`` is the function the package exports, not
    the module of the same name)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        dotted, last = ".".join(parts[:i + 1]), i == len(parts) - 1
        if inspect.ismodule(obj) and not (last and hasattr(obj, part)):
            try:
                obj = importlib.import_module(dotted)
                continue
            except ModuleNotFoundError as error:
                if error.name != dotted:
                    raise
        if not hasattr(obj, part):
            raise AttributeError(f"{'.'.join(parts[:i])} has no attribute {part}")
        obj = getattr(obj, part)
    return obj


KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional-only",
         inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
         inspect.Parameter.VAR_POSITIONAL: "*args",
         inspect.Parameter.KEYWORD_ONLY: "keyword-only",
         inspect.Parameter.VAR_KEYWORD: "**kwargs"}


def doc_parameters(params: str) -> list[tuple[str, str, str | None]]:
    """[(name, kind, default source or None)] of a quoted parameter list."""
    fn = ast.parse(f"def f({params}):\n    pass").body[0].args
    out = [(a.arg, "positional-only", None) for a in fn.posonlyargs]
    out += [(a.arg, "positional", None) for a in fn.args]
    defaults = [ast.unparse(d) for d in fn.defaults]
    positional = out
    for i, d in enumerate(defaults):
        j = len(positional) - len(defaults) + i
        positional[j] = (positional[j][0], positional[j][1], d)
    if fn.vararg:
        out.append((fn.vararg.arg, "*args", None))
    for a, d in zip(fn.kwonlyargs, fn.kw_defaults):
        out.append((a.arg, "keyword-only", None if d is None else ast.unparse(d)))
    if fn.kwarg:
        out.append((fn.kwarg.arg, "**kwargs", None))
    return out


def _same_default(source: str, real) -> bool:
    import torch

    try:
        value = eval(source, {"torch": torch, "math": math, "inf": math.inf})  # noqa: S307
    except Exception:  # noqa: BLE001 — a name the namespace lacks: compare the text
        return source == repr(real)
    if isinstance(value, float) and isinstance(real, float) and math.isnan(value):
        return math.isnan(real)
    if isinstance(value, (list, tuple)) and isinstance(real, (list, tuple)):
        value, real = list(value), list(real)
    numbers = (int, float)
    if type(value) is not type(real) and not (
            isinstance(value, numbers) and isinstance(real, numbers)
            and not isinstance(value, bool) and not isinstance(real, bool)):
        return False
    try:
        return bool(value == real)
    except Exception:  # noqa: BLE001 — tensors and other values without a truth value
        return repr(value) == repr(real)


def signature_problem(quote: QuotedSignature) -> str | None:
    where = f"{rel(quote.path)}:{quote.line}: {quote.name}"
    try:
        obj = resolve(quote.name)
    except (ImportError, AttributeError) as error:
        return f"{where}: no such object ({type(error).__name__}: {error})"
    if not callable(obj):
        return f"{where}: not callable"
    if quote.params is None:
        return None
    try:
        quoted = doc_parameters(quote.params)
    except SyntaxError:
        return f"{where}: `({quote.params})` is not a parameter list"
    try:
        real = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError) as error:
        return f"{where}: inspect.signature fails: {error}"
    if real and real[0].name in ("self", "cls") and (not quoted or quoted[0][0] != real[0].name):
        real = real[1:]
    shown = f"({quote.params}{', ...' if quote.partial else ''})"
    actual = f"{inspect.signature(obj)}"
    if quote.partial:
        real = real[:len(quoted)]
    if len(quoted) != len(real):
        return f"{where}: quoted {shown}, the code has {actual}"
    for (name, kind, default), param in zip(quoted, real):
        if name != param.name or kind != KINDS[param.kind]:
            return (f"{where}: parameter `{name}` ({kind}) is `{param.name}` "
                    f"({KINDS[param.kind]}) in the code: quoted {shown}, the code has {actual}")
        has_default = param.default is not inspect.Parameter.empty
        if (default is None) == has_default:
            return (f"{where}: parameter `{name}` {'has no' if has_default else 'has a'} "
                    f"default in the quote: quoted {shown}, the code has {actual}")
        if default is not None and not _same_default(default, param.default):
            return (f"{where}: default of `{name}` is {param.default!r} in the code, "
                    f"quoted {default}")
    return None


def test_every_quoted_signature_matches_the_code(docs):
    problems, count = [], 0
    for doc in docs:
        quotes, malformed = quoted_signatures(doc)
        problems += malformed
        count += len(quotes)
        problems += [p for p in map(signature_problem, quotes) if p]
    assert not problems, "quoted signatures do not match the code:\n" + "\n".join(problems)
    assert count >= 40, f"only {count} signatures quoted: is the scan finding them?"


def test_signature_check_catches_drift(tmp_path):
    """A wrong default, a missing parameter and a moved object are all reported."""
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        ```python signature
        tpfuse.parallel.microbatches.bubble_fraction(pp, num_microbatches, vpp=2)
        tpfuse.parallel.microbatches.bubble_fraction(pp, num_microbatches)
        tpfuse.parallel.nowhere.bubble_fraction(pp, num_microbatches, vpp=1)
        ```
        `tpfuse.parallel.microbatches.bubble_fraction(pp, ...)` is fine.
        """))
    doc = parse_doc(str(page))
    quotes, malformed = quoted_signatures(doc)
    assert not malformed and len(quotes) == 4
    problems = [signature_problem(q) for q in quotes]
    assert "default of `vpp`" in problems[0] and ":2:" in problems[0]
    assert "quoted (pp, num_microbatches)" in problems[1]
    assert "no such object" in problems[2]
    assert problems[3] is None


# ------------------------------------------------------------------------------ snippets
RUNNER = r"""
import json, sys, traceback
results = []
for snippet in json.loads(sys.stdin.read()):
    print("START " + snippet["where"] + ":" + str(snippet["line"]), flush=True)
    try:
        exec(compile(snippet["code"], snippet["where"], "exec"), {"__name__": "__doc_snippet__"})
        results.append(None)
    except BaseException:
        results.append(traceback.format_exc(limit=-3))
    finally:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
print("RESULTS " + json.dumps(results))
"""


def runnable_snippets(docs) -> list[dict]:
    snippets = []
    for doc in docs:
        for block in doc.blocks:
            if block.language == "python" and not ({"signature", "no-run"} & set(block.tags)):
                # blank lines pad the code so that tracebacks give the doc's own line numbers
                code = "\n" * (block.line - 1) + "\n".join(block.lines) + "\n"
                snippets.append({"where": rel(doc.path), "line": block.line, "code": code})
    return snippets


def snippet_failures(snippets: list[dict]) -> list[str]:
    """Run the snippets in one fresh interpreter; ``FILE:LINE: the snippet fails: traceback`` for
    each that raises."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    try:
        # run outside the checkout: its tpfuse/ folder must not shadow the installed package
        done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(snippets),
                              env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired as timeout:
        out = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else timeout.stdout or ""
        started = [l[len("START "):] for l in out.splitlines() if l.startswith("START ")]
        return [f"{started[-1] if started else 'the first snippet'}: the snippet did not finish "
                f"within 120 s"]
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULTS ")]
    if not lines:
        return [f"the snippet runner crashed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"]
    errors = json.loads(lines[-1][len("RESULTS "):])
    return [f"{s['where']}:{s['line']}: the snippet fails:\n{e}"
            for s, e in zip(snippets, errors) if e]


def test_every_python_snippet_runs(docs):
    snippets = runnable_snippets(docs)
    assert snippets, "no runnable ```python snippet found"
    failed = snippet_failures(snippets)
    assert not failed, "\n".join(failed)


def test_snippet_check_catches_drift(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nx = 1\nprint(no_such_name)\n```\n"
                    "```python no-run\nraise SystemExit(3)\n```\n")
    snippets = runnable_snippets([parse_doc(str(page))])
    failed = snippet_failures(snippets)
    assert len(snippets) == 1 and len(failed) == 1, failed
    assert f"{rel(str(page))}:4: the snippet fails" in failed[0] and "no_such_name" in failed[0]
    assert "line 5" in failed[0], failed[0]                     # the doc's own line number


def test_no_run_is_rare(docs):
    """Snippets are meant to run; `no-run` is for the few that need a GPU or a real job."""
    marked = [f"{rel(d.path)}:{b.line}" for d in docs for b in d.blocks
              if b.language == "python" and "no-run" in b.tags]
    assert len(marked) <= 4, f"too many `python no-run` blocks: {marked}"


# --------------------------------------------------------------------------------- links
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(doc: Doc) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped,
    spaces to -."""
    anchors = set()
    for _, line in doc.prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            text = re.sub(r"[`*]", "", match.group(1)).strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def test_every_relative_link_resolves(docs):
    by_path = {os.path.normpath(d.path): d for d in docs}
    problems = []
    for doc in docs:
        for number, line in doc.prose:
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue                                     # http:, https:, mailto:
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(os.path.dirname(doc.path), path)) \
                    if path else os.path.normpath(doc.path)
                if not os.path.exists(full):
                    problems.append(f"{rel(doc.path)}:{number}: link to missing {target}")
                elif anchor and full in by_path and anchor not in heading_anchors(by_path[full]):
                    problems.append(f"{rel(doc.path)}:{number}: no heading #{anchor} in "
                                    f"{rel(full)}")
    assert not problems, "broken links:\n" + "\n".join(problems)


PATH_SPAN = re.compile(r"^(?:[\w.-]+/)+[\w.-]*\.(?:py|sh|md|png|txt|ini)$|^(?:[\w.-]+/)+$")


def test_every_repository_path_named_exists(docs):
    """An inline code span that is a repository path (`training/pretrain.py`, `benchmarks/`)
    names a file or folder that exists."""
    problems = []
    for doc in docs:
        for number, span in inline_spans(doc):
            if PATH_SPAN.match(span) and not span.startswith(("/", "~", "./", "data/")) \
                    and not os.path.exists(os.path.join(ROOT, span)):
                problems.append(f"{rel(doc.path)}:{number}: no such path `{span}`")
    assert not problems, "docs name paths that do not exist:\n" + "\n".join(problems)


README_COMMANDS = (
    "```bash\npython3 -m pip install torch==2.13.0 && python3 -m pip install -e . && tpfuse-train\n```",
    "```bash\npython3 -m pip install torch==2.13.0 && python3 -m pip install -e \".[test]\" && "
    "python3 -m pytest -q\n```",
)


def test_readme_keeps_the_main_job_and_test_commands():
    """CI and users run these two commands as written: they stay byte for byte."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for command in README_COMMANDS:
        assert command in readme, f"README.md no longer holds the command block\n{command}"
