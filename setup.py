"""Installs the repository's top-level folders as subpackages of the namespace ``tpfuse``.

``tpfuse.parallel`` -> ``parallel/``, ``tpfuse.kernels`` -> ``kernels/`` and so on; the package
``tpfuse`` itself (version, ``python -m tpfuse.pretrain_gpt``) lives in ``tpfuse/``.
"""
import os

from setuptools import setup

SUBPACKAGES = ["parallel", "kernels", "tp_layers", "moe", "models", "pipeline", "data",
               "checkpoint", "runtime", "training", "inference", "convert", "megatron_compat"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _existing(folders):
    """Only folders that already hold an __init__.py are installed (later issues add the rest)."""
    return [f for f in folders if os.path.exists(os.path.join(HERE, f, "__init__.py"))]


def _package_map():
    mapping = {"tpfuse": "tpfuse"}
    for folder in _existing(SUBPACKAGES):
        mapping[f"tpfuse.{folder}"] = folder
        # nested packages (e.g. parallel/sub/) keep their folder layout
        for root, dirs, files in os.walk(os.path.join(HERE, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(root, HERE)
            if rel != folder and "__init__.py" in files:
                mapping["tpfuse." + rel.replace(os.sep, ".")] = rel
    return mapping


PACKAGE_MAP = _package_map()

CONSOLE_SCRIPTS = [
    "tpfuse-layout=tpfuse.parallel.cli:main",
    "tpfuse-schedule=tpfuse.pipeline.cli:main",
    "tpfuse-config=tpfuse.models.cli:main",
    "tpfuse-preprocess=tpfuse.data.preprocess:main",
    "tpfuse-train=tpfuse.training.launcher:main",
    "tpfuse-plan=tpfuse.training.plan.cli:main",
    "tpfuse-generate=tpfuse.inference.cli:main",
    "tpfuse-convert=tpfuse.convert.cli:main",
]

setup(
    name="tpfuse",
    version="0.1.0",
    description="Tensor- and pipeline-parallel GPT training with fused comm+GEMM Triton kernels",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=sorted(PACKAGE_MAP),
    package_dir=PACKAGE_MAP,
    install_requires=[
        "torch>=2.4",
        "triton>=3.3",
        "numpy",
        # progress bars for the preprocessing and training loops (a well-kept library
        # instead of hand-written carriage-return printing)
        "tqdm",
        # the rank-grid / pipeline Gantt pictures (--png)
        "matplotlib",
        # HuggingFace checkpoint files (tpfuse-convert reads and writes safetensors)
        "safetensors",
    ],
    extras_require={
        # tokenizers: HuggingFace BPE tokenizers and Megatron's GPT2BPETokenizer (optional; the
        # byte tokenizer is built in); transformers: HuggingFaceTokenizer folders, and checking
        # tpfuse-convert's output against HuggingFace's own models. The test extra carries every
        # tokenizer library and both observability back-ends (wandb runs offline in the tests) so
        # each tokenizer type and each logger is tested.
        "hf": ["tokenizers", "transformers"],
        # Megatron's SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer
        "sentencepiece": ["sentencepiece"],
        # Megatron's TikTokenizer
        "tiktoken": ["tiktoken"],
        "tokenizers": ["tokenizers", "transformers", "sentencepiece", "tiktoken", "tensorboard", "wandb"],
        # training observability, imported only when --tensorboard-dir / --wandb-project is given
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        "test": ["pytest", "pytest-benchmark", "pytest-timeout", "tokenizers", "transformers",
                 "sentencepiece", "tiktoken", "tensorboard", "wandb"],
    },
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
