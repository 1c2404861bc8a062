"""Datasets for GPT pretraining: tokenizers, indexed token files, GPT / mock / blended datasets, the
train-valid-test builder and the data-parallel micro-batch loader.

Names are imported lazily (PEP 562), so ``import tpfuse.data`` stays cheap.
"""
import importlib

_EXPORTS = {
    "ByteTokenizer": "tokenizer", "NullTokenizer": "tokenizer", "HFTokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
    "IndexedDataset": "indexed", "IndexedDatasetWriter": "indexed", "write_indexed_dataset": "indexed",
    "token_dtype": "indexed",
    "GPTDatasetConfig": "config", "parse_blend": "config", "parse_split": "config", "split_ranges": "config",
    "GPTDataset": "gpt_dataset", "MockGPTDataset": "gpt_dataset", "MockGPTLowLevelDataset": "gpt_dataset",
    "BlendedDataset": "blended",
    "BlendedMegatronDatasetBuilder": "builder",
    "MegatronPretrainingSampler": "sampler", "build_pretraining_data_loader": "sampler",
    "collate": "sampler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpfuse.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return __all__
