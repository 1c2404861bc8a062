"""Datasets for GPT pretraining: tokenizers, indexed token files, GPT / mock / blended datasets, the
train-valid-test builder and the data-parallel micro-batch loader.

Names are imported lazily (PEP 562), so ``import tpfuse.data`` stays cheap.
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "ByteTokenizer": "tokenizer_builtin", "NullTokenizer": "tokenizer_builtin",
    "HFTokenizer": "tokenizer_builtin", "build_tokenizer": "tokenizer",
    "TokenizerOptions": "tokenizer_options", "build_megatron_tokenizer": "tokenizer_options",
    "GPT2BPETokenizer": "tokenizer_gpt2", "SentencePieceTokenizer": "tokenizer_sentencepiece",
    "TikTokenizer": "tokenizer_tiktoken", "HuggingFaceAutoTokenizer": "tokenizer_hf",
    "IndexedDataset": "indexed", "IndexedDatasetWriter": "indexed", "write_indexed_dataset": "indexed",
    "token_dtype": "indexed",
    "GPTDatasetConfig": "config", "parse_blend": "config", "blend_from_cli": "config",
    "parse_split": "config", "split_ranges": "config",
    "GPTDataset": "gpt_dataset", "MockGPTDataset": "gpt_dataset", "MockGPTLowLevelDataset": "gpt_dataset",
    "BlendedDataset": "blended",
    "BlendedMegatronDatasetBuilder": "builder",
    "MegatronPretrainingSampler": "sampler", "build_pretraining_data_loader": "sampler",
    "collate": "sampler",
    "DocumentDataset": "variable_length", "check_micro_batch_length": "variable_length",
    "sequence_length_multiple": "variable_length",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
