"""Megatron's tokenizer types end to end, each on a tiny vocabulary built here (no downloads):
tpfuse-preprocess writes exactly the ids of the library's own encoder (plus EOD), the checkpoint
of a few tpfuse-train iterations on that file rebuilds the same tokenizer, and the model's
vocabulary is the tokenizer's padded Megatron's way.

References: GPT2BPETokenizer — transformers' GPT-2 tokenizer on the same vocab.json +
merges.txt; SentencePiece — ``SentencePieceProcessor.encode``; TikTokenizer — a
``tiktoken.Encoding`` of the rank file laid out as Megatron lays it out (special tokens first,
ranks shifted past them); HuggingFaceTokenizer — ``AutoTokenizer`` of the folder.
"""
import base64
import dataclasses
import json
import math

import pytest
import sentencepiece
import tiktoken
import tokenizers
import transformers

from support.pretrain_run import run_pretrain
from tpfuse.checkpoint.reading import load_tokenizer
from tpfuse.convert.hf import export_hf
from tpfuse.data import IndexedDataset, build_tokenizer
from tpfuse.data.preprocess import main as preprocess_main
from tpfuse.data.tokenizer_tiktoken import PATTERNS
from tpfuse.training import arguments

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a tokenizer turns text into ids, and ids back into text",
    "pack my box with five dozen liquor jugs!",
    "hello world: hello tokens, 12345 numbers and naïve café",
    "the end of one document is the start of the next",
]
PROBE = "hello brown tokens, unseen words: zebra 987 über"

TRAIN_FLAGS = [
    "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1",
    "--eval-iters", "0", "--split", "100,0,0", "--log-interval", "1000", "--no-progress-bar",
    "--no-layout-table", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
]


# ---------------------------------------------------------------------- the tiny vocabularies
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def gpt2_bpe(folder):
    """A byte-level BPE of ~300 ids trained by ``tokenizers`` on CORPUS, saved as GPT-2's
    vocab.json + merges.txt; reference: transformers' GPT2Tokenizer on those two files."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=300, min_frequency=1, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    vocab, merges = bpe.save_model(str(folder), "gpt2")
    reference = transformers.GPT2Tokenizer(vocab, merges)
    return {"flags": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                      "--merge-file", merges],
            # Megatron's GPT-2 tokenizer knows no special tokens: text is BPE'd as written
            "encode": lambda text: reference(text, split_special_tokens=True).input_ids,
            "eod": reference.convert_tokens_to_ids("<|endoftext|>"), "vocab_size": len(reference)}


@pytest.fixture(scope="module")
def sentencepiece_model(folder):
    """A 64-piece SentencePiece BPE model trained on CORPUS (eos id 2, sentencepiece's
    default); reference: SentencePieceProcessor.encode."""
    prefix = str(folder / "spm")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_prefix=prefix, vocab_size=64, model_type="bpe",
        num_threads=1, minloglevel=2, character_coverage=1.0)
    reference = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
    return {"flags": ["--tokenizer-type", "SentencePieceTokenizer",
                      "--tokenizer-model", prefix + ".model"],
            "encode": reference.encode, "eod": reference.eos_id(),
            "vocab_size": reference.get_piece_size()}


def _tiktoken_ranks():
    """The 256 bytes in order, then every prefix of a few words (each prefix one merge of a
    shorter one and a byte), in order of length."""
    tokens = [bytes([i]) for i in range(256)]
    words = [w.encode() for w in (" the", " quick", " brown", "hello", " tokens", " text", "ids")]
    for length in range(2, max(map(len, words)) + 1):
        for word in words:
            if len(word) >= length and word[:length] not in tokens:
                tokens.append(word[:length])
    return tokens


def _write_tiktoken_files(folder, tokens):
    megatron_json = folder / "ranks.json"
    megatron_json.write_text(json.dumps([
        {"rank": i, "token_bytes": base64.b64encode(t).decode(),
         "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]))
    bpe_file = folder / "ranks.tiktoken"
    bpe_file.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                for i, t in enumerate(tokens)))
    return str(megatron_json), str(bpe_file)


TIKTOKEN_SPECIALS = 10      # 7 named (<unk> <s> </s> <mask> <pad> <cls> <sep>) + 3 fillers


def _tiktoken_case(path, tokens, pattern):
    named = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
    specials = named + [f"<SPECIAL_{k}>" for k in range(len(named), TIKTOKEN_SPECIALS)]
    reference = tiktoken.Encoding(
        name="reference", pat_str=PATTERNS[pattern],
        mergeable_ranks={t: TIKTOKEN_SPECIALS + r for r, t in enumerate(tokens)},
        special_tokens={t: i for i, t in enumerate(specials)})
    vocab_size = TIKTOKEN_SPECIALS + len(tokens)
    return {"flags": ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path,
                      "--vocab-size", str(vocab_size), "--tiktoken-num-special-tokens",
                      str(TIKTOKEN_SPECIALS), "--tiktoken-pattern", pattern],
            "encode": lambda text: reference.encode(text, allowed_special="all"),
            "eod": specials.index("</s>"), "vocab_size": vocab_size}


@pytest.fixture(scope="module")
def tiktoken_files(folder):
    tokens = _tiktoken_ranks()
    return tokens, _write_tiktoken_files(folder, tokens)


@pytest.fixture(scope="module")
def huggingface_folder(folder):
    """A transformers tokenizer folder (save_pretrained) around a ``tokenizers`` BPE trained on
    CORPUS with <s> / </s> and a post-processor putting <s> first; reference: AutoTokenizer."""
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    model.train_from_iterator(CORPUS * 4, trainer)
    model.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", model.token_to_id("<s>"))])
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>",
                                                   bos_token="<s>", eos_token="</s>")
    path = folder / "hf_tokenizer"
    wrapped.save_pretrained(str(path))
    reference = transformers.AutoTokenizer.from_pretrained(str(path))
    return path, reference


def _huggingface_case(huggingface_folder, include_special_tokens):
    path, reference = huggingface_folder
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(path)]
    if include_special_tokens:
        flags.append("--tokenizer-hf-include-special-tokens")
    return {"flags": flags,
            "encode": lambda text: reference(
                text, add_special_tokens=include_special_tokens).input_ids,
            "eod": reference.eos_token_id, "vocab_size": len(reference)}


CASES = ["GPT2BPETokenizer", "SentencePieceTokenizer", "TikTokenizer-json-v2",
         "TikTokenizer-tiktoken-v1", "HuggingFaceTokenizer", "HuggingFaceTokenizer-special"]


@pytest.fixture
def case(request, gpt2_bpe, sentencepiece_model, tiktoken_files, huggingface_folder):
    name = request.param
    if name == "GPT2BPETokenizer":
        return gpt2_bpe
    if name == "SentencePieceTokenizer":
        return sentencepiece_model
    if name.startswith("TikTokenizer"):
        tokens, (megatron_json, bpe_file) = tiktoken_files
        path = megatron_json if "-json-" in name else bpe_file
        return _tiktoken_case(path, tokens, name[-2:])
    return _huggingface_case(huggingface_folder, name.endswith("-special"))


# ---------------------------------------------------------------------- preprocess + train
def _train_and_save(argv):
    return run_pretrain(TRAIN_FLAGS + list(argv)).train_losses


def _preprocess(tmp_path, flags):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS * 6))
    prefix = str(tmp_path / "corpus")
    assert preprocess_main(["--input", str(corpus), "--output-prefix", prefix, "--append-eod",
                            "--quiet", *flags]) == 0
    return prefix


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_preprocess_and_train_give_the_library_ids(run_distributed, tmp_path, case):
    prefix = _preprocess(tmp_path, case["flags"])
    written = IndexedDataset(prefix, vocab_size=case["vocab_size"])
    expected = [case["encode"](text) + [case["eod"]] for text in CORPUS * 6]
    assert [written[i].tolist() for i in range(len(written))] == expected

    config, settings = arguments.parse_args(TRAIN_FLAGS + ["--data-path", prefix, *case["flags"]])
    tokenizer = settings.tokenizer
    assert (tokenizer.vocab_size, tokenizer.eod) == (case["vocab_size"], case["eod"])
    assert config.vocab_size == case["vocab_size"]        # Megatron: padded to 128 x tp
    assert config.padded_vocab_size == math.ceil(case["vocab_size"] / 128) * 128
    assert tokenizer.tokenize(PROBE) == case["encode"](PROBE)
    assert build_tokenizer(tokenizer.name).tokenize(PROBE) == case["encode"](PROBE)

    save = str(tmp_path / "checkpoint")
    (losses,) = run_distributed(1, _train_and_save, ["--data-path", prefix, "--save", save,
                                                    *case["flags"]])
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    # a freshly initialised model predicts about uniformly over the real vocabulary
    assert abs(losses[0] - math.log(case["vocab_size"])) < 1.0
    restored = load_tokenizer(save)
    assert restored.tokenize(PROBE) == case["encode"](PROBE) and restored.eod == case["eod"]
    # the HF export names the same end-of-document id (rebuilt from the files the flags name)
    assert export_hf(save, str(tmp_path / "hf"))["eos_token_id"] == case["eod"]


# ---------------------------------------------------------------------- special text, workers
def test_special_tokens_in_text(gpt2_bpe, tiktoken_files, tmp_path):
    """GPT-2 (Megatron's GPT2BPETokenizer) BPEs a literal <|endoftext|> as text; TikTokenizer
    (Megatron's ``allowed_special="all"``) turns a literal </s> into its EOD id."""
    gpt2 = build_tokenizer(arguments.parse_args(
        TRAIN_FLAGS + ["--mock-data", *gpt2_bpe["flags"]])[1].tokenizer.name)
    text = "one document<|endoftext|>another"
    assert gpt2.tokenize(text) == gpt2_bpe["encode"](text)
    assert gpt2_bpe["eod"] not in gpt2.tokenize(text)
    tokens, (megatron_json, _) = tiktoken_files
    case = _tiktoken_case(megatron_json, tokens, "v2")
    tik = arguments.parse_args(TRAIN_FLAGS + ["--mock-data", *case["flags"]])[1].tokenizer
    assert tik.tokenize("hello</s>the") == case["encode"]("hello</s>the")
    assert tik.tokenize("hello</s>the").count(case["eod"]) == 1


def test_workers_rebuild_the_tokenizer(tiktoken_files, tmp_path):
    """--workers 2: each process rebuilds the tokenizer from the same flags; the same files."""
    tokens, (megatron_json, _) = tiktoken_files
    flags = _tiktoken_case(megatron_json, tokens, "v2")["flags"]
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    one = _preprocess(tmp_path / "one", flags)
    two = _preprocess(tmp_path / "two", flags + ["--workers", "2"])
    for suffix in (".bin", ".idx"):
        assert open(one + suffix, "rb").read() == open(two + suffix, "rb").read()


# ---------------------------------------------------------------------- flags and errors
def test_preprocess_takes_the_trainers_tokenizer_flags():
    """tpfuse-preprocess and tpfuse-train accept the same Megatron tokenizer flags, with the same
    defaults (both are Megatron's)."""
    from tpfuse.data.preprocess import build_parser
    from tpfuse.data.tokenizer_options import TokenizerOptions

    def tokenizer_actions(parser):
        names = {f.name for f in dataclasses.fields(TokenizerOptions)} | {"tiktoken_special_tokens"}
        return {a.dest: (a.default, a.nargs, tuple(a.choices or ())) for a in parser._actions
                if a.dest in names}

    trainer = tokenizer_actions(arguments.build_parser())
    assert tokenizer_actions(build_parser()) == trainer and len(trainer) == 11


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-type", "BertWordPieceCase"],
     "BertWordPieceCase is a Megatron tokenizer tpfuse does not implement"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"],
     "GPT2BPETokenizer needs --merge-file"),
    (["--tokenizer-type", "SentencePieceTokenizer"],
     "SentencePieceTokenizer needs --tokenizer-model"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/no/such.model"],
     "--tokenizer-model /no/such.model: no such file"),
    (["--tokenizer-type", "ByteTokenizer", "--tiktoken-pattern", "v1"],
     "--tiktoken-pattern does not apply to --tokenizer-type ByteTokenizer"),
    (["--tokenizer", "byte", "--tokenizer-type", "ByteTokenizer"], "not both"),
    (["--vocab-file", "v.json"], "--vocab-file needs --tokenizer-type"),
])
def test_preprocess_refuses_bad_tokenizer_flags(tmp_path, capsys, flags, message):
    (tmp_path / "doc.txt").write_text("text")
    with pytest.raises(SystemExit) as exit_:
        preprocess_main(["--input", str(tmp_path / "doc.txt"), "--output-prefix",
                         str(tmp_path / "c"), "--quiet", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("c.*"))


def test_tiktoken_errors_and_the_deprecated_special_tokens_flag(tiktoken_files):
    tokens, (megatron_json, bpe_file) = tiktoken_files
    base = TRAIN_FLAGS + ["--mock-data", "--tokenizer-type", "TikTokenizer",
                          "--tokenizer-model", megatron_json]
    with pytest.raises(ValueError, match=f"holds {len(tokens)} ranks; --vocab-size 131072 with "
                                         f"1000 special tokens needs 130072"):
        arguments.parse_args(base)
    sized = base + ["--vocab-size", str(len(tokens) + 12), "--tiktoken-num-special-tokens", "12"]
    with pytest.raises(ValueError, match="must include <unk> <s> </s> <mask> <pad> <cls> <sep>"):
        arguments.parse_args(sized + ["--tokenizer-special-tokens", "<unk>", "<s>", "</s>"])
    named = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "<cls>", "<sep>", "<tool>"]
    tokenizer = arguments.parse_args(sized + ["--tiktoken-special-tokens", *named])[1].tokenizer
    assert (tokenizer.eod, tokenizer.bos, tokenizer.tokenize("<tool>")) == (3, 2, [7])
    assert tokenizer.special_tokens[8:] == ["<SPECIAL_8>", "<SPECIAL_9>", "<SPECIAL_10>",
                                            "<SPECIAL_11>"]
    cut = arguments.parse_args(base[:-1] + [bpe_file, "--vocab-size", "266",
                                            "--tiktoken-num-special-tokens", "7"])[1].tokenizer
    assert cut.vocab_size == 266 and max(cut.tokenize("the quick brown")) < 266   # ranks cut


def test_gpt2_vocabulary_without_endoftext_is_refused(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="'<\\|endoftext\\|>' is not in the vocabulary"):
        arguments.parse_args(TRAIN_FLAGS + ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
                                            "--vocab-file", str(tmp_path / "vocab.json"),
                                            "--merge-file", str(tmp_path / "merges.txt")])


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "MultimodalTokenizer", "SFTTokenizer"])
def test_trainer_names_the_megatron_types_it_leaves_out(kind):
    with pytest.raises(ValueError, match=f"--tokenizer-type {kind} is a Megatron tokenizer tpfuse "
                                         "does not implement"):
        arguments.parse_args(TRAIN_FLAGS + ["--mock-data", "--tokenizer-type", kind])
