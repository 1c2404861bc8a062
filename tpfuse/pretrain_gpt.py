"""Pretrain a GPT: ``torchrun --nproc-per-node N -m tpfuse.pretrain_gpt <flags>`` (or ``tpfuse-train``).

The three callbacks of Megatron's pretrain_gpt.py, written for tpfuse: the model provider is
:func:`tpfuse.models.gpt_model_provider`, the datasets come from the indexed files of
``--data-path`` (or ``--mock-data``), and ``forward_step`` returns the per-token losses with a loss
function that averages them over the loss mask.
"""
from __future__ import annotations

import os
import sys
from functools import partial

import torch

from tpfuse.training.pretrain import get_args, get_config, pretrain

# The main job's model when no flag says otherwise: small enough to train on 2 CPU cores.
MAIN_JOB_DEFAULTS = {
    "num_layers": 8, "hidden_size": 128, "num_attention_heads": 8, "seq_length": 128,
    "max_position_embeddings": 128, "vocab_size": 257,
    "make_vocab_size_divisible_by": 64,  # 257 pads to 384 at tp=2 (128 would give 512)
    "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
    "num_layers_per_virtual_pipeline_stage": 2, "sequence_parallel": True,
    "micro_batch_size": 4, "global_batch_size": 32, "train_iters": 120, "lr": 3e-3,
    "min_lr": 3e-4, "lr_warmup_iters": 10, "eval_interval": 20, "eval_iters": 4,
    "eval_at_start": True,
    "log_interval": 10, "hidden_dropout": 0.0, "attention_dropout": 0.0,
}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss over the tokens the mask keeps. loss_mask, output_tensor: (b, s)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1).to(losses.device)
    loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """One micro-batch through one model chunk: (output, loss function)."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device)              # (b, s)
    labels = batch["labels"].to(device)              # (b, s)
    position_ids = batch["position_ids"].to(device)  # (b, s)
    attention_mask = batch.get("attention_mask")
    output = model(tokens, position_ids, attention_mask=attention_mask, labels=labels)
    return output, partial(loss_func, batch["loss_mask"])


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None):
    from tpfuse.models import GPTModel

    return GPTModel(get_config(), pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Mock or indexed GPT datasets, split by ``--split``, built rank 0 first and cached."""
    from tpfuse.data import (BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig,
                             MockGPTDataset)
    from tpfuse.data.tokenizer import build_tokenizer

    args, config = get_args(), get_config()
    tokenizer = build_tokenizer(args.tokenizer_type)
    if config.vocab_size is None or tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"--vocab-size {config.vocab_size} is smaller than the vocabulary of "
                         f"--tokenizer-type {args.tokenizer_type} ({tokenizer.vocab_size} ids)")
    dataset_config = GPTDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        tokenizer=tokenizer, blend=args.data_path,
        split=args.split, path_to_cache=args.data_cache_path, mock=args.mock_data)
    dataset_cls = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_cls, train_val_test_num_samples,
                                         lambda: True, dataset_config).build()


def main(argv=None) -> int:
    from tpfuse.training.arguments import parse_args

    try:  # a bad flag is a one-line message (from rank 0 only), not a traceback per rank
        parse_args(argv, MAIN_JOB_DEFAULTS)
    except ValueError as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"tpfuse.pretrain_gpt: error: {error}", file=sys.stderr)
        return 2
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
             args_defaults=MAIN_JOB_DEFAULTS, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
