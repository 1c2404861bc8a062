"""Megatron-LM's ``examples/run_simple_mcore_train_loop.py`` (core_v0.16.1) rewritten in our own
words with the same imports and calls, ``megatron.core`` → ``tpfuse.megatron_compat``, cuda →
cpu, nccl → gloo. Two changes beyond those: the process group may already exist (the test's
worker pool), and the tokenizer is tpfuse's ``NullTokenizer`` (the example takes Megatron's from
``megatron.training``, which is not megatron-core).

As in the original, the model is wrapped in DistributedDataParallel and stepped by a plain
``torch.optim.Adam`` over ``parameters()``: the DDP keeps the gradients in ``main_grad`` (Adam
sees none), so the loss stays ≈ ln(100) over the five iterations, as megatron-core's own run of
the script shows. ``main`` returns the logged losses and whether the reloaded model reproduces
the saved model's logits.
"""
import os
from functools import partial
from pathlib import Path

import torch
from torch.optim import Adam
from torch.utils.data import DataLoader

from tpfuse.data.tokenizer import NullTokenizer
from tpfuse.megatron_compat import dist_checkpointing, parallel_state
from tpfuse.megatron_compat.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder)
from tpfuse.megatron_compat.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from tpfuse.megatron_compat.datasets.utils import compile_helpers
from tpfuse.megatron_compat.distributed import (DistributedDataParallel,
                                                DistributedDataParallelConfig)
from tpfuse.megatron_compat.distributed.finalize_model_grads import finalize_model_grads
from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from tpfuse.megatron_compat.models.gpt.gpt_model import GPTModel
from tpfuse.megatron_compat.pipeline_parallel.schedules import get_forward_backward_func
from tpfuse.megatron_compat.tensor_parallel.random import model_parallel_cuda_manual_seed
from tpfuse.megatron_compat.transformer.transformer_config import TransformerConfig

SEQUENCE_LENGTH = 64
device = torch.device("cpu")


def initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    parallel_state.destroy_model_parallel()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="gloo", rank=int(os.environ["RANK"]),
                                             world_size=int(os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size,
                                             pipeline_model_parallel_size)


def model_provider():
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=100, max_sequence_length=SEQUENCE_LENGTH)


def get_train_data_iterator():
    if torch.distributed.get_rank() == 0:
        compile_helpers()
    torch.distributed.barrier()
    config = GPTDatasetConfig(random_seed=0, sequence_length=SEQUENCE_LENGTH,
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False,
                              tokenizer=NullTokenizer(vocab_size=SEQUENCE_LENGTH),
                              mid_level_dataset_surplus=0.005)
    datasets = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True,
                                             config).build()
    return iter(DataLoader(datasets[0], batch_size=8, shuffle=True))


def forward_step_func(data_iterator, model):
    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        return loss, {"lm loss": loss}

    data = next(data_iterator)
    tokens = data["tokens"].to(device)
    attention_mask = data["attention_mask"].to(device)
    position_ids = data["position_ids"].to(device)
    labels = data["labels"].to(device)
    loss_mask = data["loss_mask"].to(device)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def save_distributed_checkpoint(checkpoint_path, gpt_model):
    model = gpt_model.module if hasattr(gpt_model, "module") else gpt_model
    dist_checkpointing.save(sharded_state_dict=model.sharded_state_dict(prefix=""),
                            checkpoint_dir=checkpoint_path)


def load_distributed_checkpoint(checkpoint_path, gpt_model):
    model = gpt_model.module if hasattr(gpt_model, "module") else gpt_model
    checkpoint = dist_checkpointing.load(sharded_state_dict=model.sharded_state_dict(prefix=""),
                                         checkpoint_dir=checkpoint_path)
    model.load_state_dict(checkpoint)
    return gpt_model


def probe_logits(gpt_model):
    """The model's logits on a fixed batch (eval mode: no dropout)."""
    model = gpt_model.module if hasattr(gpt_model, "module") else gpt_model
    tokens = torch.arange(2 * SEQUENCE_LENGTH).view(2, SEQUENCE_LENGTH) % 100
    positions = torch.arange(SEQUENCE_LENGTH).expand(2, -1)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, None)
    model.train()
    return logits


def main(workdir):
    initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    try:
        model_parallel_cuda_manual_seed(123)
        gpt_model = model_provider()
        gpt_model.to(device)
        config = gpt_model.config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False,
                                                   overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        gpt_model = DistributedDataParallel(config=config, ddp_config=ddp_config,
                                            module=gpt_model)
        optim = Adam(gpt_model.parameters())
        train_iterator = get_train_data_iterator()
        forward_backward_func = get_forward_backward_func()
        losses = []
        for _ in range(5):
            optim.zero_grad()
            losses_reduced = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=train_iterator,
                model=gpt_model, num_microbatches=1, seq_length=SEQUENCE_LENGTH,
                micro_batch_size=8, decoder_seq_length=SEQUENCE_LENGTH, forward_only=False)
            finalize_model_grads([gpt_model])
            optim.step()
            losses.append(float(losses_reduced[0]["lm loss"]))
        ckpt_path = str(workdir) + "/ckpt"
        if torch.distributed.get_rank() == 0:
            Path(ckpt_path).mkdir(exist_ok=True)
        torch.distributed.barrier()
        saved = probe_logits(gpt_model)
        save_distributed_checkpoint(checkpoint_path=ckpt_path, gpt_model=gpt_model)
        with torch.no_grad():                          # reload into a perturbed model
            for param in gpt_model.module.parameters():
                param.add_(1.0)
        gpt_model = load_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)
        gpt_model.to(device)
        reloaded = probe_logits(gpt_model)
        return losses, bool(torch.equal(saved, reloaded)), sorted(os.listdir(ckpt_path))
    finally:
        parallel_state.destroy_model_parallel()
