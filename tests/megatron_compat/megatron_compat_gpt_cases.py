"""Bodies of the multi-process tests of the compat model half (run in the run_distributed
workers): Megatron's flow (TransformerConfig → GPTModel with the local spec → DDP →
get_forward_backward_func → finalize_model_grads → get_megatron_optimizer →
dist_checkpointing),
the same model trained with tpfuse's native API, and checkpoints across layouts.

Model and data are tiny and fixed: counting sequences (next token = this one + 1, learnable)
from starts drawn with a generator seeded per micro-batch; dropout off (both sides run the same
engine, so dropout would match too, but the comparison should not depend on the RNG streams).
"""
import os

import torch
import torch.distributed as dist

SEED, VOCAB, HIDDEN, HEADS, LAYERS, SEQ, MICRO = 7, 64, 16, 4, 4, 8, 2
LR, STEPS, MICROBATCHES = 3e-3, 3, 2


def microbatch(index):
    gen = torch.Generator().manual_seed(500 + index)
    starts = torch.randint(0, VOCAB, (MICRO, 1), generator=gen)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": torch.ones(MICRO, SEQ),
            "position_ids": torch.arange(SEQ).expand(MICRO, SEQ),
            "attention_mask": causal.expand(MICRO, 1, SEQ, SEQ)}


def data_iterator():
    index = 0
    while True:
        yield microbatch(index)
        index += 1


def probe_batch():
    tokens = (torch.arange(MICRO * SEQ).view(MICRO, SEQ) * 5) % VOCAB
    return tokens, torch.arange(SEQ).expand(MICRO, SEQ)


# ----------------------------------------------------------------------------- Megatron style
def megatron_config(tp, pp, **overrides):
    from tpfuse.megatron_compat.distributed import finalize_model_grads
    from tpfuse.megatron_compat.transformer import TransformerConfig

    fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                  finalize_model_grads_func=finalize_model_grads)
    fields.update(overrides)
    return TransformerConfig(**fields)


def megatron_model(config, tied=True, **model_kwargs):
    """Megatron's model_provider(pre_process, post_process) and the DDP wrapper around it."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.distributed import (DistributedDataParallel,
                                                    DistributedDataParallelConfig)
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def model_provider(pre_process=True, post_process=True):
        return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                        max_sequence_length=SEQ, pre_process=pre_process,
                        post_process=post_process,
                        share_embeddings_and_output_weights=tied, **model_kwargs)

    model = model_provider(parallel_state.is_pipeline_first_stage(),
                           parallel_state.is_pipeline_last_stage())
    return DistributedDataParallel(config, DistributedDataParallelConfig(), model)


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].view(-1).float()
        loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


def per_token_forward_step(data_iterator, model):
    """Megatron's 3-value loss function (Σ loss, tokens, logs) for calculate_per_token_loss."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].view(-1).float()
        total, tokens = torch.sum(output_tensor.float().view(-1) * mask), mask.sum().int()
        return total, tokens, {"lm loss": (total / tokens).detach()}
    return output, loss_func


def megatron_train(model, steps=STEPS, step_func=forward_step):
    """(per-step mean loss on the last stage, step results) with Megatron's training calls.
    ``model``: one DDP chunk, or a list of them (virtual pipeline: one data iterator each)."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.optimizer import OptimizerConfig, get_megatron_optimizer
    from tpfuse.megatron_compat.pipeline_parallel import get_forward_backward_func

    chunks = model if isinstance(model, list) else [model]
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR), chunks)
    forward_backward = get_forward_backward_func()
    iterator = [data_iterator() for _ in chunks] if len(chunks) > 1 else data_iterator()
    losses, results = [], []
    for _ in range(steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(forward_step_func=step_func, data_iterator=iterator,
                                   model=chunks, num_microbatches=MICROBATCHES,
                                   seq_length=SEQ, micro_batch_size=MICRO,
                                   decoder_seq_length=SEQ, forward_only=False)
        results.append(optimizer.step())
        if parallel_state.is_pipeline_last_stage():
            losses.append(torch.stack([r["lm loss"] for r in reduced]).mean().item())
    return losses, results


def logits_of(model):
    """The last stage's full-vocabulary logits (b, s, V) on the probe batch (eval mode)."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.pipeline_parallel import get_forward_backward_func

    tokens, positions = probe_batch()
    collected = []

    def probe_step(data_iterator, chunk):
        output = chunk(tokens, positions, None, runtime_gather_output=True)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    model.eval()
    with torch.no_grad():
        reduced = get_forward_backward_func()(
            forward_step_func=probe_step, data_iterator=iter([None]), model=[model],
            num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO, forward_only=True)
    model.train()
    if parallel_state.is_pipeline_last_stage():
        collected.append(reduced[0]["logits"])
    return collected[0] if collected else None


def save_and_reload(model, directory):
    """dist_checkpointing save, perturb, load: the reloaded model's logits."""
    from tpfuse.megatron_compat import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.module.sharded_state_dict(), directory)
    with torch.no_grad():
        for param in model.module.parameters():
            param.mul_(0.5)
    loaded = dist_checkpointing.load(model.module.sharded_state_dict(), directory)
    model.module.load_state_dict(loaded)
    return logits_of(model)


def flow_tp2(directory):
    """Megatron's flow at tp = 2 (dp = 1): losses, step results, logits before/after reload."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(2, 1)
    try:
        model_parallel_cuda_manual_seed(SEED)
        model = megatron_model(megatron_config(2, 1), tied=False)
        losses, results = megatron_train(model, steps=6)
        before = logits_of(model)
        after = save_and_reload(model, directory)
        return losses, results, before, after
    finally:
        parallel_state.destroy_model_parallel()


def per_token_and_mean_tp2():
    """The same training with Megatron's per-token loss (finalize_model_grads divides by the
    token count) and with the per-micro-batch mean: ((losses, grad norms), (losses, grad norms))."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    runs = []
    for per_token in (True, False):
        parallel_state.initialize_model_parallel(2, 1)
        try:
            model_parallel_cuda_manual_seed(SEED)
            model = megatron_model(megatron_config(2, 1, calculate_per_token_loss=per_token))
            step = per_token_forward_step if per_token else forward_step
            losses, results = megatron_train(model, step_func=step)
            runs.append((losses, [grad_norm for _, grad_norm, _ in results]))
        finally:
            parallel_state.destroy_model_parallel()
    return runs


def megatron_virtual_chunks(config, vpp, tied=True):
    """Megatron's get_model for a virtual pipeline: model_provider once per chunk i with
    ``pre_process = is_pipeline_first_stage(ignore_virtual=False, vp_stage=i)`` (and last),
    one DDP per chunk (bucketing off after the first), the chunks' no_sync / grad-sync hooks
    in the config as lists. (chunks, no_sync entries counted per chunk)."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.distributed import (DistributedDataParallel,
                                                    DistributedDataParallelConfig)
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                        max_sequence_length=SEQ, pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=tied,
                        vp_stage=vp_stage)

    chunks = []
    for i in range(vpp):
        model = model_provider(parallel_state.is_pipeline_first_stage(False, vp_stage=i),
                               parallel_state.is_pipeline_last_stage(False, vp_stage=i),
                               vp_stage=i)
        chunks.append(DistributedDataParallel(config, DistributedDataParallelConfig(), model,
                                              disable_bucketing=i > 0))
    entered = [0] * vpp

    def counting_no_sync(i):
        def no_sync():
            entered[i] += 1
            return chunks[i].no_sync()
        return no_sync
    config.no_sync_func = [counting_no_sync(i) for i in range(vpp)]
    config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
    return chunks, entered


def compat_and_native_pp2_vpp2():
    """pp2·vpp2 (4 layers: one per chunk) the Megatron way and the native way: (is last stage,
    compat losses, native losses, step results, no_sync entries per chunk, layers of each chunk
    built the Megatron way, the same built after set_virtual_pipeline_model_parallel_rank)."""
    import warnings

    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    try:
        model_parallel_cuda_manual_seed(SEED)
        config = megatron_config(1, 2, virtual_pipeline_model_parallel_size=2)
        chunks, entered = megatron_virtual_chunks(config, 2)
        last = parallel_state.is_pipeline_last_stage()
        compat, results = megatron_train(chunks)
        layers = [c.module.native.layer_indices for c in chunks]
        older = []                  # the older style: set the virtual rank, then build
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for i in range(2):
                parallel_state.set_virtual_pipeline_model_parallel_rank(i)
                model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                                 max_sequence_length=SEQ,
                                 pre_process=parallel_state.is_pipeline_first_stage(False),
                                 post_process=parallel_state.is_pipeline_last_stage(False))
                older.append((model.native.layer_indices, model.pre_process, model.post_process))
            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    finally:
        parallel_state.destroy_model_parallel()
    return last, compat, native_losses(1, 2, vpp=2), results, entered, layers, older


# ----------------------------------------------------------------------------- native tpfuse
def native_losses(tp, pp, vpp=None):
    from tpfuse.models import TransformerConfig, allreduce_embedding_grads
    from tpfuse.models.build import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.pipeline import get_forward_backward_func
    from tpfuse.training.data_parallel import (DataParallelBuffers,
                                               DistributedDataParallelConfig)
    from tpfuse.training.optimizer import MixedPrecisionOptimizer

    state = ParallelState.initialize(tp=tp, pp=pp, vpp=vpp)
    try:
        config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN,
                                   num_attention_heads=HEADS, vocab_size=VOCAB, seq_length=SEQ,
                                   tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=vpp, hidden_dropout=0.0,
                                   attention_dropout=0.0, seed=SEED)
        chunks = build_model(make_gpt_model_provider(config), config, state)
        buffers = DataParallelBuffers(chunks, DistributedDataParallelConfig(), state)
        optimizer = MixedPrecisionOptimizer(chunks, buffers, state, lr=LR, weight_decay=0.01,
                                            clip_grad=1.0)
        forward_backward = get_forward_backward_func(state)

        def native_step(data_iterator, chunk):
            batch = next(data_iterator)
            loss = chunk(batch["tokens"], labels=batch["labels"])
            return loss, lambda out: (out.mean(), {"lm loss": out.mean().detach()})

        iterator = [data_iterator() for _ in chunks] if len(chunks) > 1 else data_iterator()
        losses = []
        for _ in range(STEPS):
            buffers.zero_grad_buffer()
            logs = forward_backward(native_step, iterator, chunks, MICROBATCHES, SEQ, MICRO)
            buffers.finish_grad_sync()
            allreduce_embedding_grads(chunks, state)
            optimizer.step()
            if state.is_pipeline_last_stage():
                losses.append(torch.stack([d["lm loss"] for d in logs]).mean().item())
        return losses
    finally:
        state.destroy()


def compat_and_native_tp2_pp2():
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(2, 2)
    try:
        model_parallel_cuda_manual_seed(SEED)
        compat, results = megatron_train(megatron_model(megatron_config(2, 2), tied=True))
    finally:
        parallel_state.destroy_model_parallel()
    return compat, native_losses(2, 2), results


# ----------------------------------------------------------------------------- other layouts
def _built(tp, pp, seed):
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(seed)
    return megatron_model(megatron_config(tp, pp), tied=True)


def reshard_tp2_to_pp2(directory):
    """Train and save at tp2·pp1, load into a differently seeded tp1·pp2 model: logits."""
    from tpfuse.megatron_compat import dist_checkpointing, parallel_state

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    try:
        model = _built(2, 1, SEED)
        megatron_train(model, steps=2)
        saved = logits_of(model)
        dist_checkpointing.save(model.module.sharded_state_dict(), directory)
    finally:
        parallel_state.destroy_model_parallel()
    try:
        model = _built(1, 2, SEED + 1)
        fresh = logits_of(model)
        model.module.load_state_dict(
            dist_checkpointing.load(model.module.sharded_state_dict(), directory))
        return saved, fresh, logits_of(model)
    finally:
        parallel_state.destroy_model_parallel()


def refused_loads(directory):
    """(message of a load into a wider model, message of a load of a corrupted chunk)."""
    from tpfuse.megatron_compat import dist_checkpointing, parallel_state
    from tpfuse.megatron_compat.dist_checkpointing import CheckpointingException

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    messages = []
    try:
        model = _built(2, 1, SEED)
        dist_checkpointing.save(model.module.sharded_state_dict(), directory)
        wider = megatron_model(megatron_config(2, 1, ffn_hidden_size=8 * HIDDEN), tied=True)
        try:
            dist_checkpointing.load(wider.module.sharded_state_dict(), directory)
        except CheckpointingException as error:
            messages.append(str(error))
        dist.barrier()
        if dist.get_rank() == 0:
            _flip_a_byte(directory, model)
        dist.barrier()
        try:
            dist_checkpointing.load(model.module.sharded_state_dict(), directory)
        except CheckpointingException as error:
            messages.append(str(error))
        return messages
    finally:
        parallel_state.destroy_model_parallel()


CORRUPTED_KEY = "decoder.layers.self_attention.linear_qkv.weight"


def _flip_a_byte(directory, model):
    """Invert one byte of the stored values of rank 0's first chunk of CORRUPTED_KEY (found by
    its bytes inside that chunk's record of the data file)."""
    from tpfuse.megatron_compat.dist_checkpointing import torch_dist

    metadata = torch_dist.read_metadata(directory)
    index = next(i for i in metadata.storage_data if i.fqn == CORRUPTED_KEY
                 and all(o == 0 for o in i.offset))
    info = metadata.storage_data[index]
    values = model.module.decoder.layers[0].self_attention.linear_qkv.weight.detach()
    path = os.path.join(directory, info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        record = f.read(info.length)
        at = record.find(values.numpy().tobytes())
        assert at >= 0, "the chunk's values are not stored as raw bytes"
        f.seek(info.offset + at + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def precision_and_sharding_dp2():
    """dp = 2: (bf16 + distributed optimizer) and (fp16 with Megatron's loss scaling through
    config.grad_scale_func) apply their steps; per run (losses, step results, optimizer class name, loss
    scale, parameters before, parameters after)."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.distributed import (DistributedDataParallel,
                                                    DistributedDataParallelConfig)
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.optimizer import OptimizerConfig, get_megatron_optimizer
    from tpfuse.megatron_compat.pipeline_parallel import get_forward_backward_func
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    runs = {}
    for name, dtype, distributed in (("bf16", torch.bfloat16, True),
                                     ("fp16", torch.float16, False)):
        parallel_state.initialize_model_parallel(1, 1)
        try:
            model_parallel_cuda_manual_seed(SEED)
            config = megatron_config(1, 1, params_dtype=dtype, bf16=name == "bf16",
                                     fp16=name == "fp16")
            model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                             max_sequence_length=SEQ)
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
            optimizer = get_megatron_optimizer(OptimizerConfig(
                lr=1e-2, bf16=name == "bf16", fp16=name == "fp16", params_dtype=dtype,
                use_distributed_optimizer=distributed, initial_loss_scale=2.0 ** 12), [ddp])
            config.grad_scale_func = optimizer.scale_loss        # as Megatron's training does
            forward_backward, iterator, losses, results = get_forward_backward_func(), \
                data_iterator(), [], []
            before = torch.cat([p.detach().float().view(-1) for p in model.parameters()])
            for _ in range(4):
                ddp.zero_grad_buffer()
                reduced = forward_backward(forward_step_func=forward_step,
                                           data_iterator=iterator, model=[ddp],
                                           num_microbatches=MICROBATCHES, seq_length=SEQ,
                                           micro_batch_size=MICRO, forward_only=False)
                results.append(optimizer.step())
                losses.append(torch.stack([r["lm loss"] for r in reduced]).float().mean().item())
            after = torch.cat([p.detach().float().view(-1) for p in model.parameters()])
            runs[name] = (losses, results, type(optimizer).__name__,
                          float(optimizer.get_loss_scale()), before, after)
        finally:
            parallel_state.destroy_model_parallel()
    return runs


def sequence_parallel_and_plain_tp2():
    """Megatron's flow at tp = 2 with and without sequence parallelism: (losses, losses)."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    runs = []
    for sequence_parallel in (True, False):
        parallel_state.initialize_model_parallel(2, 1)
        try:
            model_parallel_cuda_manual_seed(SEED)
            model = megatron_model(megatron_config(2, 1, sequence_parallel=sequence_parallel))
            runs.append(megatron_train(model)[0])
        finally:
            parallel_state.destroy_model_parallel()
    return runs
