"""Pretrain a GPT: ``torchrun --nproc-per-node N -m tpfuse.pretrain_gpt <flags>`` (or ``tpfuse-train``).

The three callbacks of Megatron's pretrain_gpt.py, written for tpfuse: the model provider builds
a :class:`tpfuse.models.GPTModel` from the config ``build_model`` passes, the datasets come from
the indexed files of ``--data-path`` (or ``--mock-data``), and ``forward_step`` returns the
per-token losses with a loss function that averages them over the loss mask; the fourth,
``sample_func``, continues ``--sample-prompt`` after training with ``tpfuse.inference``. Settings
arrive as keyword-only parameters that ``pretrain`` binds (``data``: the DataSettings,
``config``: the TransformerConfig, ``tokenizer``), so the schedules still call
``forward_step(data_iterator, model)`` and nothing reads a global. Without flags the
``stdlib-demo`` preset (``training/presets.py``) runs.
"""
from __future__ import annotations

import os
import sys
from functools import partial

import torch

from tpfuse.training.pretrain import pretrain


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss over the tokens the mask keeps. loss_mask, output_tensor: (b, s) (with
    context parallelism this rank's s/cp tokens; the mean is over the whole sequence's)."""
    from tpfuse.training.context_parallel import sequence_mean_loss

    loss, reported = sequence_mean_loss(output_tensor, loss_mask)
    return loss, {"lm loss": reported}


def _fields_needed(model, data, config) -> tuple[bool, bool | None]:
    """(position ids?, document ids?) this chunk takes from its batch. Without the settings (a
    wrapper calling ``forward_step(data_iterator, model)``): ``(True, None)``, the batch is read
    and its document ids used where it holds them (the same numbers; a middle stage then reads a
    batch it could have skipped)."""
    if data is None:
        return True, None
    rope = (model.config if config is None else config).position_embedding_type == "rope"
    return model.pre_process or (data.reset_position_ids and rope), data.reset_attention_mask


def forward_step(data_iterator, model, *, data=None, config=None):
    """One micro-batch through one model chunk: (output, loss function). A chunk copies only
    what it uses: tokens on the first stage (and the last with MTP), labels (with MTP the loss
    mask too) on the last, position ids where the first
    stage embeds them or rope needs the sample's own (--reset-position-ids), document ids on every
    chunk with --reset-attention-mask; a middle pipeline stage needing none of them reads no batch
    at all, as in Megatron. With context parallelism the batch is cut to this cp rank's s/cp
    tokens (chunks r and 2·cp−1−r) first. ``data`` (the DataSettings) and ``config`` (the
    TransformerConfig; default the chunk's) are bound by ``pretrain``."""
    from tpfuse.training.context_parallel import get_batch_on_this_cp_rank

    first, last = model.pre_process, model.post_process
    positions_needed, documents_needed = _fields_needed(model, data, config)
    # multi-token prediction on the last stage embeds the tokens ahead and weighs its losses by
    # the loss mask (Megatron's get_batch on the MTP stage)
    mtp = last and getattr(model.config if config is None else config, "mtp_num_layers", None)
    if not (first or last or positions_needed or documents_needed):
        return model(None), partial(loss_func, None)
    batch = get_batch_on_this_cp_rank(next(data_iterator))
    if documents_needed is None:
        documents_needed = "document_ids" in batch
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device) if first or mtp else None         # (b, s[/cp])
    labels = batch["labels"].to(device) if last else None                 # (b, s[/cp])
    position_ids = batch["position_ids"].to(device) if positions_needed else None
    document_ids = batch["document_ids"].to(device) if documents_needed else None
    extra = {"loss_mask": batch["loss_mask"].to(device)} if mtp else {}
    output = model(tokens, position_ids, labels=labels, document_ids=document_ids, **extra)
    return output, partial(loss_func, batch["loss_mask"] if last else None)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None,
                   config=None):
    """This stage's GPTModel of ``config`` (the TransformerConfig ``build_model`` passes)."""
    from tpfuse.models import GPTModel

    if config is None:
        raise ValueError("model_provider needs config= (build_model passes the TransformerConfig)")
    return GPTModel(config, pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, *, data, config, tokenizer):
    """Mock or indexed GPT datasets (``--data-path`` blends cut by ``--split``, or the per-split
    ``--train/valid/test-data-path`` blends), built rank 0 first and cached. ``data``: the
    DataSettings; ``config``: the TransformerConfig (seed, sequence length)."""
    from tpfuse.data import (BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig,
                             MockGPTDataset, blend_from_cli)

    per_split = data.per_split_paths
    dataset_config = GPTDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        tokenizer=tokenizer, blend=blend_from_cli(data.data_path),
        blend_per_split=[blend_from_cli(p) for p in per_split] if any(per_split) else None,
        split=data.split, path_to_cache=data.data_cache_path, mock=data.mock_data)
    dataset_cls = MockGPTDataset if data.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_cls, train_val_test_num_samples,
                                         lambda: True, dataset_config).build()


def sample_func(model_chunks, tokenizer, prompt: str, max_new_tokens: int, state, **decoding):
    """``--sample-prompt``'s continuation after training: inference's ``training_sample`` (the
    trainer is given it, it does not import inference)."""
    from tpfuse.inference.sample import training_sample

    return training_sample(model_chunks, tokenizer, prompt, max_new_tokens, state, **decoding)


def main(argv=None) -> int:
    """Without any flag, the default preset (the README's main job) runs."""
    from tpfuse.training.arguments import parse_args
    from tpfuse.training.presets import DEFAULT_PRESET

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        argv = ["--preset", DEFAULT_PRESET]
    try:  # a bad flag is a one-line message (from rank 0 only), not a traceback per rank
        parse_args(argv)
    except ValueError as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"tpfuse.pretrain_gpt: error: {error}", file=sys.stderr)
        return 2
    from tpfuse.runtime.initialize import shutdown_distributed

    finished = False
    try:  # every way out ends the process groups: finished, early exit, error, KeyboardInterrupt
        pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv,
                 sample_func=sample_func)
        finished = True
    except Exception as error:  # noqa: BLE001 — reported once per job by tpfuse-train
        from tpfuse.runtime.launcher import report_failure

        report_failure(error)
        return 1
    finally:
        shutdown_distributed(finished)
    return 0


if __name__ == "__main__":
    sys.exit(main())
