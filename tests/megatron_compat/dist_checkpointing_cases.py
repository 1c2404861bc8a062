"""Bodies of the dist_checkpointing layout tests (run in the run_distributed workers, 2 ranks):
a compat GPTModel is built and saved at one layout, a differently seeded one is built at
another layout and loads the checkpoint; both give their full-vocabulary logits on a probe
batch. Model sizes are tiny (hidden 16, 2 layers); dropout off.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEED, VOCAB, HIDDEN, HEADS, LAYERS, SEQ, MICRO = 7, 32, 16, 4, 2, 8, 2


def probe_batch():
    tokens = (torch.arange(MICRO * SEQ).view(MICRO, SEQ) * 5) % VOCAB
    return tokens, torch.arange(SEQ).expand(MICRO, SEQ)


def model_config(layout, **overrides):
    from tpfuse.megatron_compat.transformer import TransformerConfig

    fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
                  tensor_model_parallel_size=layout.get("tp", 1),
                  pipeline_model_parallel_size=layout.get("pp", 1),
                  expert_model_parallel_size=layout.get("ep", 1),
                  sequence_parallel=layout.get("tp", 1) > 1 and "num_moe_experts" in overrides)
    fields.update(overrides)
    return TransformerConfig(**fields)


SWIGLU = dict(gated_linear_unit=True, activation_func=F.silu)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=HIDDEN,
           moe_token_dispatcher_type="alltoall", **SWIGLU)


def build(layout, seed, overrides):
    """Initialise the layout's groups, seed, build the compat GPTModel of this stage."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        layout.get("tp", 1), layout.get("pp", 1),
        expert_model_parallel_size=layout.get("ep", 1),
        expert_tensor_parallel_size=layout.get("etp"))
    model_parallel_cuda_manual_seed(seed)
    config = model_config(layout, **overrides)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                    moe_grouped_gemm=config.moe_grouped_gemm)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    model.eval()
    return model


def logits(model):
    """Full-vocabulary logits (b, s, V) of a one-stage model on the probe batch."""
    with torch.no_grad():
        return model(*probe_batch(), None, runtime_gather_output=True)


def save_then_load(directory, saved_layout, loaded_layout, saved_overrides,
                   loaded_overrides=None):
    """(saved model's logits, fresh model's logits, loaded model's logits, the checkpoint's
    common entries) — one-stage layouts."""
    from tpfuse.megatron_compat import dist_checkpointing, parallel_state

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    try:
        model = build(saved_layout, SEED, saved_overrides)
        saved = logits(model)
        dist_checkpointing.save(model.sharded_state_dict(), directory)
    finally:
        parallel_state.destroy_model_parallel()
    try:
        model = build(loaded_layout, SEED + 1,
                      saved_overrides if loaded_overrides is None else loaded_overrides)
        fresh = logits(model)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
        return saved, fresh, logits(model), dist_checkpointing.load_common_state_dict(directory)
    finally:
        parallel_state.destroy_model_parallel()


# ----------------------------------------------------------------- megatron-core's cases
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


def megatron_case_model(recorded, tp, seed):
    """The compat GPTModel of a megatron-core case (``recorded``: the fixture's config.json —
    TransformerConfig fields with ``activation`` naming the function, GPTModel arguments) at
    this tp (MoE with sequence parallelism at tp > 1, as megatron-core requires), in eval
    mode; parallel_state initialised (the caller destroys it)."""
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed
    from tpfuse.megatron_compat.transformer import TransformerConfig

    fields = dict(recorded["config"])
    activation = ACTIVATIONS[fields.pop("activation", "gelu")]
    moe = fields.get("num_moe_experts") is not None
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(**fields, activation_func=activation,
                               tensor_model_parallel_size=tp, sequence_parallel=moe and tp > 1)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                    moe_grouped_gemm=config.moe_grouped_gemm)
    model = GPTModel(config, spec, vocab_size=recorded["vocab_size"],
                     max_sequence_length=recorded["max_sequence_length"], **recorded["model"])
    model.eval()
    return model


def perturb(model, seed):
    """Every parameter += N(0, 0.05²) from one generator seeded alike on every rank (norms and
    biases leave 1 and 0; replicated parameters stay equal across ranks)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


# ----------------------------------------------------------------- model + optimizer resume
def _training_run(layout, seed, dtype, distributed, overrides):
    """(DDP model, compat optimizer) of Megatron's flow at this layout (the groups initialised;
    the caller destroys them)."""
    import megatron_compat_gpt_cases as gpt

    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.distributed import (DistributedDataParallel,
                                                    DistributedDataParallelConfig)
    from tpfuse.megatron_compat.optimizer import OptimizerConfig, get_megatron_optimizer
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    parallel_state.initialize_model_parallel(tp, pp,
                                             expert_model_parallel_size=layout.get("ep", 1))
    model_parallel_cuda_manual_seed(seed)
    half = dtype != torch.float32
    moe = "num_moe_experts" in overrides
    config = gpt.megatron_config(tp, pp, params_dtype=dtype, pipeline_dtype=dtype, bf16=half,
                                 expert_model_parallel_size=layout.get("ep", 1),
                                 sequence_parallel=moe and tp > 1, **overrides)
    model = _moe_aware_model(config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=gpt.LR, bf16=half, params_dtype=dtype, use_distributed_optimizer=distributed), [ddp])
    return ddp, optimizer


def _moe_aware_model(config):
    """The compat GPTModel of this stage (tied embeddings) with the spec config asks for."""
    import megatron_compat_gpt_cases as gpt

    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                    moe_grouped_gemm=config.moe_grouped_gemm)
    return GPTModel(config, spec, vocab_size=gpt.VOCAB, max_sequence_length=gpt.SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=True)


def _train_steps(ddp, optimizer, first_microbatch, steps):
    """Megatron's training steps on micro-batches first_microbatch...: the last stage's mean
    loss per step (None elsewhere)."""
    import megatron_compat_gpt_cases as gpt

    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.pipeline_parallel import get_forward_backward_func

    def iterator():
        index = first_microbatch
        while True:
            yield gpt.microbatch(index)
            index += 1
    batches, losses = iterator(), []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=gpt.forward_step, data_iterator=batches, model=[ddp],
            num_microbatches=gpt.MICROBATCHES, seq_length=gpt.SEQ, micro_batch_size=gpt.MICRO,
            forward_only=False)
        assert optimizer.step()[0]
        if parallel_state.is_pipeline_last_stage():
            losses.append(torch.stack([r["lm loss"] for r in reduced]).float().mean().item())
    return losses or None


def _checkpoint_state(ddp, optimizer, is_loading=False):
    model_state = ddp.module.sharded_state_dict()
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def resume_at_another_layout(directory, saved_layout, loaded_layout, dtype=torch.float32,
                             distributed=False, overrides=None):
    """Train 2 steps at saved_layout, save model + optimizer, train 2 more (the uninterrupted
    run); build another seed's model at loaded_layout, load both, train the same 2 steps; and
    once more loading the model only (a fresh optimizer). The last stage's losses of the two
    continuing steps: (uninterrupted, resumed, model only)."""
    import megatron_compat_gpt_cases as gpt

    from tpfuse.megatron_compat import dist_checkpointing, parallel_state

    steps = gpt.MICROBATCHES
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    try:
        ddp, optimizer = _training_run(saved_layout, SEED, dtype, distributed, overrides or {})
        _train_steps(ddp, optimizer, 0, 2)
        dist_checkpointing.save(_checkpoint_state(ddp, optimizer), directory)
        uninterrupted = _train_steps(ddp, optimizer, 2 * steps, 2)
    finally:
        parallel_state.destroy_model_parallel()
    runs = []
    for with_optimizer in (True, False):
        try:
            ddp, optimizer = _training_run(loaded_layout, SEED + 1, dtype, distributed,
                                           overrides or {})
            loaded = dist_checkpointing.load(_checkpoint_state(ddp, optimizer, True), directory)
            ddp.module.load_state_dict(loaded["model"])
            if with_optimizer:
                optimizer.load_state_dict(loaded["optimizer"])
            else:
                optimizer.reload_model_params()
            runs.append(_train_steps(ddp, optimizer, 2 * steps, 2))
        finally:
            parallel_state.destroy_model_parallel()
    return uninterrupted, runs[0], runs[1]
