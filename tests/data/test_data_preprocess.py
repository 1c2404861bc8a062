"""tpfuse-preprocess on a temporary tree of text files and on JSONL: the documents read back equal
the inputs' bytes (byte tokenizer, by hand); directory walking rules; errors; atomic output."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tpfuse.data import ByteTokenizer, IndexedDataset, NullTokenizer, build_tokenizer
from tpfuse.data.preprocess import main

EOD = 256


def _docs(prefix):
    ds = IndexedDataset(prefix, vocab_size=257)
    return [ds[i].tolist() for i in range(len(ds))]


def _bytes(text):
    return list(text.encode("utf-8"))


@pytest.fixture
def tree(tmp_path):
    files = {"b.py": "print('b')\n", "a.txt": "héllo\n", "sub/c.py": "x = 1\n", "sub/deeper/d.md": "# d",
             "empty.py": "", "image.bin": "\x00\x01", "__pycache__/x.py": "cached",
             ".hidden/y.py": "hidden", "site-packages/pkg.py": "installed", "tests/t.py": "test"}
    for rel, text in files.items():
        path = tmp_path / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


def test_directory_input(tree):
    out = str(tree / "out" / "corpus")
    assert main(["--input", str(tree / "src"), "--output-prefix", out, "--append-eod", "--quiet"]) == 0
    # sorted walk, default pattern (*.py,*.txt,*.md,*.rst), empty file skipped, __pycache__, hidden
    # entries and site-packages skipped; every document ends with EOD
    expected = ["héllo\n", "print('b')\n", "x = 1\n", "# d", "test"]
    assert _docs(out) == [_bytes(t) + [EOD] for t in expected]
    assert main(["--input", str(tree / "src"), "--output-prefix", out, "--pattern", "*.py",
                 "--exclude", "tests,deeper", "--quiet"]) == 0
    assert _docs(out) == [_bytes("print('b')\n"), _bytes("x = 1\n")]
    assert sorted(os.listdir(tree / "out")) == ["corpus.bin", "corpus.idx"]  # no temporary files left


def test_jsonl_and_files_in_given_order(tree):
    jsonl = tree / "docs.jsonl"
    records = [{"text": "first → doc"}, {"text": ""}, {"text": "third", "other": 1}]
    jsonl.write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n" + json.dumps(records[2]) + "\n")
    out = str(tree / "corpus")
    main(["--input", str(jsonl), str(tree / "src" / "b.py"), "--output-prefix", out, "--append-eod", "--quiet"])
    assert _docs(out) == [_bytes("first → doc") + [EOD], _bytes("third") + [EOD], _bytes("print('b')\n") + [EOD]]
    keyed = tree / "keyed.jsonl"
    keyed.write_text(json.dumps({"content": "abc"}) + "\n")
    main(["--input", str(keyed), "--output-prefix", out, "--json-key", "content", "--quiet"])
    assert _docs(out) == [[97, 98, 99]]


def test_workers_give_the_same_output(tree):
    one, two = str(tree / "one"), str(tree / "two")
    main(["--input", str(tree / "src"), "--output-prefix", one, "--append-eod", "--quiet"])
    main(["--input", str(tree / "src"), "--output-prefix", two, "--append-eod", "--quiet", "--workers", "2"])
    for suffix in (".bin", ".idx"):
        assert open(one + suffix, "rb").read() == open(two + suffix, "rb").read()


@pytest.mark.parametrize("lines, message", [
    (['{"text": "ok"}', "{not json"], r"bad\.jsonl:2: not valid JSON"),
    (['{"text": "ok"}', '{"body": "x"}'], r"bad\.jsonl:2: no string under --json-key 'text'"),
])
def test_bad_jsonl_fails_and_writes_nothing(tmp_path, capsys, lines, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["--input", str(bad), "--output-prefix", str(tmp_path / "out" / "c"), "--quiet"])
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert os.listdir(tmp_path / "out") == []  # the partial output was discarded


def test_missing_input_and_no_matches(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "c")])
    assert "nope': no such file or directory" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    with pytest.raises(SystemExit):
        main(["--input", str(tmp_path / "d"), "--output-prefix", str(tmp_path / "c")])
    assert "no files matched --pattern" in capsys.readouterr().err


def test_console_script_on_stdlib_package(tmp_path):
    """The installed entry point on a real standard-library package (json/), as the main job does."""
    source = os.path.dirname(json.__file__)
    out = str(tmp_path / "json")
    result = subprocess.run([sys.executable, "-c", "import sys; from tpfuse.data.preprocess import main; "
                             "sys.exit(main())", "--input", source, "--output-prefix", out, "--pattern", "*.py",
                             "--append-eod"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    names = sorted(n for n in os.listdir(source) if n.endswith(".py"))
    expected = [list(open(os.path.join(source, n), "rb").read()) + [EOD] for n in names]
    assert _docs(out) == [d for d in expected if len(d) > 1]
    assert "tokenizing" in result.stderr  # the progress bar


def test_tokenizers():
    byte = ByteTokenizer()
    text = "naïve → ok\n"
    assert byte.tokenize(text) == _bytes(text) and byte.detokenize(byte.tokenize(text) + [EOD]) == text
    assert (byte.vocab_size, byte.eod) == (257, 256)
    null = build_tokenizer("null:100")
    assert isinstance(null, NullTokenizer) and (null.vocab_size, null.eod) == (101, 100)
    for spec in ("", "null:x", "/no/such/tokenizer.json"):
        with pytest.raises(ValueError, match="tokenizer"):
            build_tokenizer(spec)


def test_hf_tokenizer_optional(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")  # optional dependency: only this path needs it
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<|endoftext|>": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    model.save(path)
    tok = build_tokenizer(path)
    assert (tok.vocab_size, tok.eod) == (4, 3) and tok.tokenize("hello world foo") == [1, 2, 0]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"text": "world hello"}) + "\n" + json.dumps({"text": "hello"}) + "\n")
    out = str(tmp_path / "hf")
    main(["--input", str(jsonl), "--output-prefix", out, "--tokenizer", path, "--append-eod", "--quiet"])
    ds = IndexedDataset(out, vocab_size=4)
    assert ds.dtype == np.uint16 and [ds[i].tolist() for i in range(len(ds))] == [[2, 1, 3], [1, 3]]


def test_empty_input_fails_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "empty.py").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["--input", str(tmp_path / "d"), "--output-prefix", str(tmp_path / "c")])
    assert exit_.value.code == 2
    assert "no text to tokenize" in capsys.readouterr().err
    assert not list(tmp_path.glob("c.*"))


def test_empty_input_over_an_existing_prefix_keeps_the_old_pair(tmp_path, capsys):
    (tmp_path / "good.txt").write_text("some text")
    prefix = str(tmp_path / "corpus")
    assert main(["--input", str(tmp_path / "good.txt"), "--output-prefix", prefix, "--quiet"]) == 0
    old = {s: open(f"{prefix}.{s}", "rb").read() for s in ("bin", "idx")}
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["--input", str(tmp_path / "empty.txt"), "--output-prefix", prefix, "--quiet"])
    assert exit_.value.code == 2 and "no text to tokenize" in capsys.readouterr().err
    assert {s: open(f"{prefix}.{s}", "rb").read() for s in ("bin", "idx")} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.bin", "corpus.idx", "empty.txt",
                                                          "good.txt"]   # no temporary left
