"""Writes the megatron-core checkpoint fixtures of tests/data/megatron_core_checkpoints/ (run it
with a Python that has megatron-core 0.16.1 installed; tpfuse is not needed)::

    python tests/support/write_megatron_core_fixtures.py [OUT_DIR [CASE ...]]

For every case in CASES (a dense GPT, a SwiGLU GPT with tied embeddings, an MoE GPT with
sequential SwiGLU experts, the same MoE GPT with grouped-GEMM experts: see WEIGHTS_FROM) it
builds megatron-core's own GPTModel with the local spec at tp = 1 on one gloo rank, moves
every parameter off its initial value (``perturb``: norms and biases would otherwise be 1 and 0,
and a checkpoint reader that dropped them would go unnoticed), saves it with megatron-core's
``dist_checkpointing.save`` into ``OUT_DIR/<case>/checkpoint`` and writes next to it
``reference.pt``: the probe batch (``tokens``, ``position_ids``) and megatron-core's fp32
logits ``(b, s, V)`` on it, plus ``config.json``, the TransformerConfig / GPTModel arguments
the test rebuilds the model from.

megatron-core needs CUDA for a few calls even with ``use_cpu_initialization``; on a CPU they are
emulated (current device → cpu, synchronize → nothing, the RNG tracker's CUDA states → the CPU
generator's; tests/megatron_compat/megatron_core_reference.py uses the same emulation); the
router's optional Transformer Engine GEMM, whose name megatron-core leaves undefined without TE,
is set to None.

``dense_trained`` (TRAINED_CASES) is a checkpoint written the way Megatron-LM's training writes
one (megatron/training/checkpointing.py at core_v0.16.1): a tiny dense GPT wrapped in
megatron-core's DistributedDataParallel with megatron-core's own DistributedOptimizer
(``get_megatron_optimizer``, ``use_distributed_optimizer`` on the one gloo rank; torch's AdamW
underneath, as without TE / apex) and OptimizerParamScheduler takes TRAIN_STEPS steps on a
fixed batch, then ``dist_checkpointing.save`` writes ``OUT_DIR/dense_trained/checkpoint/
iter_0000003`` and ``latest_checkpointed_iteration.txt`` with Megatron-LM's state dict:
``args`` (an argparse.Namespace of Megatron-LM's argument names and values, enums and dtypes
included: ``megatron_args``), ``checkpoint_version`` 3.0, ``iteration``, ``model``,
``optimizer`` (the DistributedOptimizer's sharded state dict in Megatron-LM's default
``dp_reshardable`` layout: per bucket flat ``param`` / ``exp_avg`` / ``exp_avg_sq`` tensors),
``opt_param_scheduler``, ``rng_state`` (a ShardedObject over (pp, tp)) and
``num_floating_point_operations_so_far``. ``dense_tied_buckets`` is the same model with tied
embeddings (Megatron's default) trained and saved the same way, its gradient buffer cut into
buckets of about TRAINED_ARGS' ``ddp_bucket_size`` elements (``--overlap-grad-reduce``): several
``bucket_idx_<k>`` tensors per state, a layer's parameters spread over two of them; its
config.json also records those args. ``dense_trained_tp2`` is dense_trained at tp = 2: one
process per tp rank (``write_tp_case``: torch.multiprocessing, two gloo ranks, dp = pp = 1),
each rank's buckets (``dp_group_idx_<tp rank>``) holding its TP shards, the rng_state a
ShardedObject over (1, 2). ``reference.pt`` keeps the fixed batch, the losses
and learning rates of the saved steps and of RESUMED_STEPS more steps megatron-core takes
after the save (what a resumed run must reproduce), and every parameter's optimizer state in
model space (``param``, ``exp_avg``, ``exp_avg_sq`` in the parameter's whole shape,
TP-gathered at tp > 1) at the save.
Beyond the calls above, the optimizer's CUDA-only pieces are emulated too: tensors asked for on
``cuda`` are made on the CPU, ``Tensor.type()`` names a CPU tensor as its CUDA type (the
optimizer checks the parameters' type), ``Tensor.cuda()`` is the tensor itself.
"""
import argparse
import functools
import json
import os
import random
import signal
import shutil
import socket
import sys

import torch
import torch.nn.functional as F

NUM_LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 2, 32, 4, 64, 16, 2
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                           "megatron_core_checkpoints")

# case: (TransformerConfig fields beyond the common ones, GPTModel keyword arguments)
CASES = {
    "dense": ({}, {}),
    "swiglu": ({"gated_linear_unit": True, "activation": "silu"},
               {"share_embeddings_and_output_weights": True}),
    "moe": ({"gated_linear_unit": True, "activation": "silu", "num_moe_experts": 4,
             "moe_router_topk": 2, "moe_ffn_hidden_size": HIDDEN // 2, "add_bias_linear": False,
             "moe_token_dispatcher_type": "allgather", "moe_aux_loss_coeff": 0.0}, {}),
}
CASES["moe_grouped"] = (dict(CASES["moe"][0], moe_grouped_gemm=True), {})
# a case trained by megatron-core's optimizer and saved as Megatron-LM's training saves
TRAINED_CASES = {"dense_trained": ({"hidden_size": 16, "num_attention_heads": 2}, {})}
# the same model with Megatron's default tied embeddings, its gradient buffer cut into buckets
# (Megatron-LM's --overlap-grad-reduce --ddp-bucket-size): TRAINED_ARGS are its args beyond
# dense_trained's, the DistributedDataParallelConfig follows them (ddp_config)
TRAINED_CASES["dense_tied_buckets"] = (TRAINED_CASES["dense_trained"][0],
                                       {"share_embeddings_and_output_weights": True})
TRAINED_ARGS = {"dense_tied_buckets": {"untie_embeddings_and_output_weights": False,
                                       "overlap_grad_reduce": True, "ddp_bucket_size": 2000}}
# dense_trained at tp = 2 on two gloo ranks (--tensor-model-parallel-size 2): each tp rank's
# buckets hold its TP shards under dp_group_idx_<tp rank>; Megatron-LM pads the vocabulary to a
# multiple of make_vocab_size_divisible_by · tp, so 32 · 2 keeps its VOCAB rows
TRAINED_CASES["dense_trained_tp2"] = TRAINED_CASES["dense_trained"]
TRAINED_ARGS["dense_trained_tp2"] = {"tensor_model_parallel_size": 2, "world_size": 2,
                                     "make_vocab_size_divisible_by": VOCAB // 2}
TRAIN_STEPS, RESUMED_STEPS, TRAIN_ITERS = 3, 2, 10
# Megatron-LM's training flags of that case (what its args record)
TRAINING = dict(lr=1e-2, min_lr=1e-3, lr_decay_style="cosine", lr_warmup_iters=1,
                lr_decay_iters=TRAIN_ITERS, weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9,
                adam_beta2=0.95, adam_eps=1e-8)
# megatron-core's GroupedMLP computes in bf16 with the grouped_gemm CUDA package only: that case
# takes the weights (and logits) of the SequentialMLP case's model, loaded into a GroupedMLP
# model by megatron-core and saved from it (its own layout of the same tensors)
WEIGHTS_FROM = {"moe_grouped": "moe"}
LIVE_CASES = ("dense", "swiglu", "moe")          # the cases megatron-core can also compute
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


def probe():
    """A fixed (b, s) token batch and its positions."""
    tokens = (torch.arange(BATCH * SEQ).view(BATCH, SEQ) * 7 + 3) % VOCAB
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ).contiguous()


def config_fields(case):
    """The TransformerConfig fields of a case (``activation`` names the activation_func)."""
    fields = dict(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  hidden_dropout=0.0, attention_dropout=0.0)
    fields.update({**CASES, **TRAINED_CASES}[case][0])
    return fields


def perturb(model, seed):
    """Every parameter += N(0, 0.05²) from a generator seeded once (in named order)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _emulate_cuda():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    from megatron.core.tensor_parallel import random as megatron_random
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):       # its import fails without TE
        moe_utils.te_general_gemm = None
    return megatron_random


def _allow_grouped_mlp():
    """GroupedMLP's constructor asserts the grouped_gemm package; it is built here only to
    save and load (its forward, which needs that package, is never run)."""
    from megatron.core.transformer.moe import grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is None:
        grouped_gemm_util.grouped_gemm = "not installed: GroupedMLP built for checkpoints only"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_size_of(case) -> int:
    """The tensor-parallel size a case runs at (TRAINED_ARGS' --tensor-model-parallel-size)."""
    return TRAINED_ARGS.get(case, {}).get("tensor_model_parallel_size", 1)


def megatron_model(case, seed):
    """megatron-core's GPTModel of a case (at its tp, local spec), perturbed; parallel_state
    initialised (the caller destroys it)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = config_fields(case)
    activation = fields.pop("activation", "gelu")
    if fields.get("moe_grouped_gemm"):
        _allow_grouped_mlp()
    parallel_state.initialize_model_parallel(tp_size_of(case), 1)
    megatron_random.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(**fields, activation_func=ACTIVATIONS[activation],
                               use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=fields.get("num_moe_experts"),
                                    moe_grouped_gemm=bool(fields.get("moe_grouped_gemm")))
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     **{**CASES, **TRAINED_CASES}[case][1])
    perturb(model, seed)
    return model


def megatron_logits(model):
    """The model's fp32 logits (b, s, V) on the probe batch (eval mode)."""
    model.eval()
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        return model(*probe(), causal).float()


def _regrouped(sequential, case, seed, scratch):
    """A GroupedMLP model of ``case`` holding ``sequential``'s weights (through megatron-core's
    own save and load)."""
    from megatron.core import dist_checkpointing, parallel_state

    os.makedirs(scratch)
    dist_checkpointing.save(sequential.sharded_state_dict(), scratch)
    parallel_state.destroy_model_parallel()
    grouped = megatron_model(case, seed)
    grouped.load_state_dict(dist_checkpointing.load(grouped.sharded_state_dict(), scratch))
    return grouped


def write_case(case, out_dir, seed):
    from megatron.core import dist_checkpointing, parallel_state

    model = megatron_model(WEIGHTS_FROM.get(case, case), seed)
    logits = megatron_logits(model)
    case_dir = os.path.join(out_dir, case)
    checkpoint = os.path.join(case_dir, "checkpoint")
    shutil.rmtree(case_dir, ignore_errors=True)
    if case in WEIGHTS_FROM:
        model = _regrouped(model, case, seed, os.path.join(case_dir, "scratch"))
    os.makedirs(checkpoint)
    dist_checkpointing.save(model.sharded_state_dict(), checkpoint)
    shutil.rmtree(os.path.join(case_dir, "scratch"), ignore_errors=True)
    tokens, positions = probe()
    torch.save({"tokens": tokens, "position_ids": positions, "logits": logits},
               os.path.join(case_dir, "reference.pt"))
    with open(os.path.join(case_dir, "config.json"), "w") as f:
        json.dump({"config": config_fields(case), "model": CASES[case][1], "vocab_size": VOCAB,
                   "max_sequence_length": SEQ}, f, indent=1, sort_keys=True)
    parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------------------- a trained checkpoint
def _on_cpu_for_cuda(factory):
    @functools.wraps(factory)
    def made(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return made


def _emulate_cuda_tensors():
    """The optimizer's CUDA-only pieces on a CPU (module docstring)."""
    if getattr(torch.Tensor.type, "emulated", False):
        return
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        setattr(torch, name, _on_cpu_for_cuda(getattr(torch, name)))
    cpu_type = torch.Tensor.type

    def cuda_type(tensor, *args, **kwargs):
        if args or kwargs:
            return cpu_type(tensor, *args, **kwargs)
        return cpu_type(tensor).replace("torch.", "torch.cuda.", 1)
    cuda_type.emulated = True
    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor


def train_batch():
    """The fixed (b, s) batch every step trains on: windows of s + 1 ids, tokens = the first s,
    labels = the last s (Megatron's GPTDataset fields)."""
    text = (torch.arange(BATCH * (SEQ + 1)).view(BATCH, SEQ + 1) * 5 + 2) % VOCAB
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


def megatron_args(case, iteration):
    """Megatron-LM's ``args`` of the run (its argument names; the values validate_args sets,
    the dtypes and the attention-backend enum included)."""
    from megatron.core.transformer.enums import AttnBackend

    fields = config_fields(case)
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    args = argparse.Namespace(
        num_layers=fields["num_layers"], hidden_size=hidden, ffn_hidden_size=4 * hidden,
        num_attention_heads=heads, kv_channels=hidden // heads, group_query_attention=False,
        num_query_groups=heads, seq_length=SEQ, max_position_embeddings=SEQ,
        position_embedding_type="learned_absolute", add_position_embedding=True,
        normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False, squared_relu=False,
        add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False,
        untie_embeddings_and_output_weights=True, num_experts=None,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tokenizer_type="NullTokenizer", vocab_size=VOCAB - 1, vocab_file=None,
        make_vocab_size_divisible_by=VOCAB, padded_vocab_size=VOCAB,
        micro_batch_size=BATCH, global_batch_size=BATCH, train_iters=TRAIN_ITERS,
        train_samples=None, optimizer="adam", use_distributed_optimizer=True,
        **TRAINING, lr_warmup_init=0.0, lr_warmup_fraction=None, lr_warmup_samples=0,
        lr_decay_samples=None, start_weight_decay=TRAINING["weight_decay"],
        end_weight_decay=TRAINING["weight_decay"], weight_decay_incr_style="constant",
        override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
        expert_model_parallel_size=1, sequence_parallel=False, data_parallel_size=1,
        world_size=1, rank=0, fp16=False, bf16=False, params_dtype=torch.float32,
        main_grads_dtype=torch.float32, main_params_dtype=torch.float32,
        exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
        attention_backend=AttnBackend.auto, transformer_impl="local", ckpt_format="torch_dist",
        dist_ckpt_optim_fully_reshardable=False, seed=1234, iteration=iteration,
        consumed_train_samples=iteration * BATCH, consumed_valid_samples=0,
        skipped_train_samples=0, exit_signal=signal.SIGTERM)
    vars(args).update(TRAINED_ARGS.get(case, {}))
    return args


def ddp_config(case):
    """megatron-core's DistributedDataParallelConfig of the case, as Megatron-LM builds it from
    its args (--overlap-grad-reduce, --ddp-bucket-size)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    args = TRAINED_ARGS.get(case, {})
    return DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.get("overlap_grad_reduce", False),
        bucket_size=args.get("ddp_bucket_size"))


def megatron_trainer(case, seed):
    """(DDP-wrapped model, megatron-core's optimizer, its OptimizerParamScheduler): Megatron-LM's
    setup_model_and_optimizer for the case, in samples as Megatron-LM counts."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = megatron_model(case, seed)
    ddp = DistributedDataParallel(model.config, ddp_config(case), model)
    t = TRAINING
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t["lr"], min_lr=t["min_lr"], weight_decay=t["weight_decay"],
        adam_beta1=t["adam_beta1"], adam_beta2=t["adam_beta2"], adam_eps=t["adam_eps"],
        clip_grad=t["clip_grad"], use_distributed_optimizer=True, params_dtype=torch.float32),
        [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t["lr"], min_lr=t["min_lr"],
        lr_warmup_steps=t["lr_warmup_iters"] * BATCH, lr_decay_steps=t["lr_decay_iters"] * BATCH,
        lr_decay_style=t["lr_decay_style"], start_wd=t["weight_decay"], end_wd=t["weight_decay"],
        wd_incr_steps=TRAIN_ITERS * BATCH, wd_incr_style="constant")
    return model, ddp, optimizer, scheduler


def megatron_train_step(model, ddp, optimizer, scheduler):
    """One step of Megatron-LM's train_step on the fixed batch (one micro-batch, the per-token
    mean loss): (its loss, the lr it used)."""
    from megatron.core.distributed import finalize_model_grads

    tokens, labels = train_batch()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    model.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, positions, causal, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    lr = optimizer.param_groups[0]["lr"]
    succeeded, _, _ = optimizer.step()
    assert succeeded
    scheduler.step(increment=BATCH)
    return loss.item(), lr


def megatron_rng_state(tp_size=1, tp_rank=0):
    """Megatron-LM's get_rng_state for torch_dist: one state per (pp, tp) rank."""
    import numpy as np
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state], (1, tp_size), (0, tp_rank), replica_id=0)


def _tp_gathered(tensor, param):
    """The whole (TP-gathered) tensor of a tp rank's shard ``tensor`` of ``param``: the tp
    group's shards concatenated in rank order along the parameter's partition_dim (a
    replicated parameter's own tensor)."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(shards, tensor.contiguous(),
                                 group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=param.partition_dim)


def model_space_optimizer_state(model, optimizer):
    """Megatron key → {"param", "exp_avg", "exp_avg_sq"} of every parameter, in its whole
    (TP-gathered) shape (the one data-parallel rank holds every element of its shard)."""
    distributed = optimizer.chained_optimizers[0]
    out = {}
    for name, param in model.named_parameters():
        tensors = distributed._get_main_param_and_optimizer_states(param)
        out[name] = {key: _tp_gathered(tensors[key].detach().clone().view(param.shape), param)
                     for key in ("param", "exp_avg", "exp_avg_sq")}
    return out


def write_trained_case(case, out_dir, seed):
    """Megatron-LM's save_checkpoint of the case after TRAIN_STEPS steps (module docstring)."""
    from megatron.core import dist_checkpointing, parallel_state

    _emulate_cuda_tensors()
    model, ddp, optimizer, scheduler = megatron_trainer(case, seed)
    saved = [megatron_train_step(model, ddp, optimizer, scheduler) for _ in range(TRAIN_STEPS)]
    first = torch.distributed.get_rank() == 0
    case_dir = os.path.join(out_dir, case)
    root = os.path.join(case_dir, "checkpoint")
    folder = os.path.join(root, f"iter_{TRAIN_STEPS:07d}")
    if first:
        shutil.rmtree(case_dir, ignore_errors=True)
        os.makedirs(folder)
    torch.distributed.barrier()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True, "dp_cp_group": group}
    state_dict = {"args": megatron_args(case, TRAIN_STEPS), "checkpoint_version": 3.0,
                  "iteration": TRAIN_STEPS, "model": model.sharded_state_dict(metadata=metadata)}
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["rng_state"] = megatron_rng_state(
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank())
    state_dict["num_floating_point_operations_so_far"] = 0
    content = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
    dist_checkpointing.save(state_dict, folder, content_metadata=content)
    if first:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(TRAIN_STEPS))
    optimizer_state = model_space_optimizer_state(model, optimizer)
    lr_at_save = scheduler.get_lr(optimizer.param_groups[0])
    resumed = [megatron_train_step(model, ddp, optimizer, scheduler) for _ in range(RESUMED_STEPS)]
    parallel_state.destroy_model_parallel()
    if not first:
        return
    tokens, labels = train_batch()
    torch.save({"tokens": tokens, "labels": labels,
                "losses": [loss for loss, _ in saved], "lrs": [lr for _, lr in saved],
                "resumed_losses": [loss for loss, _ in resumed],
                "resumed_lrs": [lr for _, lr in resumed], "lr_at_save": lr_at_save,
                "optimizer_state": optimizer_state}, os.path.join(case_dir, "reference.pt"))
    with open(os.path.join(case_dir, "config.json"), "w") as f:
        json.dump({"config": config_fields(case), "model": TRAINED_CASES[case][1],
                   "vocab_size": VOCAB, "max_sequence_length": SEQ, "training": TRAINING,
                   "global_batch_size": BATCH, "train_iters": TRAIN_ITERS,
                   "iteration": TRAIN_STEPS, **({"args": TRAINED_ARGS[case]}
                                                if case in TRAINED_ARGS else {})},
                  f, indent=1, sort_keys=True)


def _tp_rank_process(rank, world, port, case, out_dir, seed):
    """One of a case's ``world`` gloo ranks (torch.multiprocessing.spawn), CUDA emulated."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    _emulate_cuda()
    write_trained_case(case, out_dir, seed)
    torch.distributed.destroy_process_group()


def write_tp_case(case, out_dir, seed):
    """write_trained_case of a case at tp > 1: one process per tp rank (dp = pp = 1)."""
    import torch.multiprocessing

    world = tp_size_of(case)
    torch.multiprocessing.spawn(_tp_rank_process, args=(world, _free_port(), case, out_dir, seed),
                                nprocs=world)


def start_single_process():
    """One gloo rank, CUDA calls emulated."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    _emulate_cuda()


def main(out_dir=DEFAULT_OUT, *cases):
    """Every case (or only ``cases``) into ``out_dir``."""
    start_single_process()
    for index, case in enumerate(CASES):
        if not cases or case in cases:
            write_case(case, out_dir, seed=11 + index)
    for index, case in enumerate(TRAINED_CASES):
        if (not cases or case in cases) and tp_size_of(case) == 1:
            write_trained_case(case, out_dir, seed=31 + index)
    torch.distributed.destroy_process_group()
    for index, case in enumerate(TRAINED_CASES):
        if (not cases or case in cases) and tp_size_of(case) > 1:
            write_tp_case(case, out_dir, seed=31 + index)


if __name__ == "__main__":
    main(*sys.argv[1:])
