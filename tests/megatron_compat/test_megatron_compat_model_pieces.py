"""The compat model half in one process: each Megatron-style call against the native call it
wraps, and every refused option naming itself.

Equalities are exact where both sides run the same modules on the same weights (the compat
GPTModel is a view of the native one); the scheduler is compared with Megatron's formulas
written out here.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tpfuse.megatron_compat import dist_checkpointing
from tpfuse.megatron_compat.datasets.utils import Split, compile_helpers
from tpfuse.megatron_compat.dist_checkpointing import ShardedObject, ShardedTensor
from tpfuse.megatron_compat.distributed import DistributedDataParallelConfig
from tpfuse.megatron_compat.models.gpt import GPTModel
from tpfuse.megatron_compat.models.gpt import gpt_layer_specs as specs
from tpfuse.megatron_compat.optimizer import OptimizerConfig, OptimizerParamScheduler
from tpfuse.megatron_compat.tensor_parallel.random import model_parallel_cuda_manual_seed
from tpfuse.megatron_compat.transformer import (ModuleSpec, TransformerConfig,
                                                build_module)
from tpfuse.megatron_compat.transformer.identity_op import IdentityOp
from tpfuse.models import GPTModel as NativeGPT
from tpfuse.models import TransformerConfig as NativeConfig

SEED, VOCAB, SEQ = 3, 32, 8


@pytest.fixture
def seeded():
    model_parallel_cuda_manual_seed(SEED, tp_rank=0, ep_rank=0, etp_rank=0)


def config(**overrides):
    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                  attention_dropout=0.0)
    fields.update(overrides)
    return TransformerConfig(**fields)


def compat_model(cfg=None, **kwargs):
    return GPTModel(cfg or config(), specs.get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, **kwargs)


def batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen), torch.arange(SEQ).expand(2, SEQ)


# ----------------------------------------------------------------------------- GPTModel
def test_gpt_model_is_the_native_model_under_megatron_names(seeded):
    model = compat_model()
    native = NativeGPT(NativeConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                                    vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.0,
                                    attention_dropout=0.0, seed=SEED,
                                    untie_embeddings_and_output_weights=True))
    ids, pos = batch()
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)
    logits = model(ids, pos, causal)                            # Megatron's mask accepted
    assert logits.shape == (2, SEQ, VOCAB)
    assert torch.equal(logits, native(ids, pos)[..., :VOCAB])   # native pads V to 128
    assert torch.equal(model(ids, pos, None, labels=ids), native(ids, pos, labels=ids))
    names = set(model.state_dict())
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 "decoder.layers.1.input_layernorm.weight",
                 "decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.layers.0.self_attention.linear_proj.bias",
                 "decoder.layers.0.pre_mlp_layernorm.bias",
                 "decoder.layers.0.mlp.linear_fc1.weight",
                 "decoder.layers.0.mlp.linear_fc2.weight", "decoder.final_layernorm.weight",
                 "output_layer.weight"):
        assert name in names
    assert len(list(model.parameters())) == len(list(native.parameters()))


def test_gpt_model_train_mode_reaches_the_engine(seeded):
    model = compat_model(config(hidden_dropout=0.5))
    ids, pos = batch()
    model.eval()
    assert not model.native.training and not model.native.layers[0].training
    assert torch.equal(model(ids, pos, None), model(ids, pos, None))
    model.train()
    assert model.native.layers[0].training


def test_gpt_model_refuses_what_it_does_not_compute(seeded):
    ids, pos = batch()
    with pytest.raises(ValueError, match="attention_mask"):
        compat_model()(ids, pos, torch.zeros(2, 1, SEQ, SEQ, dtype=torch.bool))
    with pytest.raises(ValueError, match="decoder_input"):
        compat_model()(ids, pos, None, decoder_input=torch.zeros(SEQ, 2, 16))
    with pytest.raises(ValueError, match="rotary_percent"):
        compat_model(rotary_percent=0.5)
    with pytest.raises(ValueError, match="fp32_residual_connection"):
        compat_model(config(fp32_residual_connection=True))
    with pytest.raises(ValueError, match="activation_func"):
        compat_model(config(activation_func=F.relu))
    with pytest.raises(ValueError, match="init_method"):
        compat_model(config(init_method=torch.nn.init.xavier_normal_))
    with pytest.raises(ValueError, match="position_embedding_type"):
        compat_model(position_embedding_type="none")


def test_gpt_model_needs_a_seed():
    from tpfuse.tp_layers.random import get_rng_tracker

    get_rng_tracker().reset()
    with pytest.raises(ValueError, match="model_parallel_cuda_manual_seed"):
        compat_model()


def test_rope_and_swiglu_reach_the_engine(seeded):
    model = compat_model(config(activation_func=F.silu, gated_linear_unit=True,
                                add_bias_linear=False), position_embedding_type="rope")
    assert model.native.config.activation == "swiglu"
    assert model.native.config.position_embedding_type == "rope"
    assert model(*batch(), None).shape == (2, SEQ, VOCAB)


# ----------------------------------------------------------------------------- specs
def test_transformer_engine_spec_names_the_local_spec():
    with pytest.raises(ValueError, match="get_gpt_layer_local_spec"):
        specs.get_gpt_layer_with_transformer_engine_spec()
    with pytest.raises(ValueError, match="Transformer Engine"):
        specs.get_mlp_module_spec(use_te=True)
    attention = specs.get_gpt_layer_local_spec(qk_layernorm=True).submodules.self_attention
    assert attention.submodules.q_layernorm is specs.WrappedTorchNorm
    assert attention.submodules.k_layernorm is specs.WrappedTorchNorm


def test_a_spec_slot_tpfuse_does_not_compute_is_named(seeded):
    spec = specs.get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.q_layernorm = specs.WrappedTorchNorm
    with pytest.raises(ValueError, match="self_attention.q_layernorm"):
        GPTModel(config(), spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def test_qk_layernorm_model_is_the_native_model_with_megatron_keys(seeded):
    cfg = config(qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=1e-6)
    model = GPTModel(cfg, specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    native = NativeGPT(NativeConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                                    vocab_size=VOCAB, seq_length=SEQ, hidden_dropout=0.0,
                                    attention_dropout=0.0, seed=SEED, normalization="RMSNorm",
                                    layernorm_epsilon=1e-6, position_embedding_type="rope",
                                    qk_layernorm=True, untie_embeddings_and_output_weights=True))
    assert model.native.config.qk_layernorm
    ids, pos = batch()
    assert torch.equal(model(ids, pos, None), native(ids, pos)[..., :VOCAB])
    norms = {name: tuple(p.shape) for name, p in model.named_parameters()
             if "q_layernorm" in name or "k_layernorm" in name}
    assert norms == {f"decoder.layers.{i}.self_attention.{n}_layernorm.weight": (4,)
                     for i in range(2) for n in "qk"}
    sharded = model.sharded_state_dict()
    assert sharded["decoder.layers.1.self_attention.q_layernorm.weight"].key == \
        "decoder.layers.self_attention.q_layernorm.weight"
    assert sharded["decoder.layers.0.self_attention.k_layernorm.weight"].global_shape == (2, 4)


def test_qk_layernorm_spec_and_config_must_agree(seeded):
    with pytest.raises(ValueError, match="self_attention.q_layernorm is IdentityOp but "
                                         "TransformerConfig.qk_layernorm=True"):
        GPTModel(config(qk_layernorm=True), specs.get_gpt_layer_local_spec(), vocab_size=VOCAB,
                 max_sequence_length=SEQ)
    with pytest.raises(ValueError, match="qk_layernorm=False"):
        GPTModel(config(), specs.get_gpt_layer_local_spec(qk_layernorm=True), vocab_size=VOCAB,
                 max_sequence_length=SEQ)


def test_moe_spec_and_config_must_agree(seeded):
    with pytest.raises(ValueError, match="num_moe_experts"):
        GPTModel(config(), specs.get_gpt_layer_local_spec(num_experts=4), vocab_size=VOCAB,
                 max_sequence_length=SEQ)
    moe = GPTModel(config(num_moe_experts=4, moe_router_topk=2),
                   specs.get_gpt_layer_local_spec(num_experts=4), vocab_size=VOCAB,
                   max_sequence_length=SEQ)
    assert moe(*batch(), None).shape == (2, SEQ, VOCAB)


def test_build_module_follows_megatron():
    spec = ModuleSpec(module=torch.nn.Linear, params={"bias": False})
    layer = build_module(spec, 3, 4)
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None
    assert isinstance(build_module(IdentityOp), IdentityOp)
    bda = specs.get_bias_dropout_add
    assert build_module(ModuleSpec(module=bda)) is bda
    assert build_module(ModuleSpec(module=("torch.nn", "ReLU"))).__class__ is torch.nn.ReLU


def test_transformer_layer_builds_and_runs_on_its_own(seeded):
    from tpfuse.megatron_compat.transformer import TransformerLayer

    spec = specs.get_gpt_layer_local_spec()
    layer = build_module(spec, config=config(), layer_number=1)
    assert isinstance(layer, TransformerLayer)
    hidden = torch.randn(SEQ, 2, 16)
    out, context = layer(hidden, attention_mask=None)
    assert context is None and torch.equal(out, layer._native(hidden))


# ----------------------------------------------------------------------------- checkpoints
def test_sharded_state_dict_has_megatron_keys(seeded):
    model = compat_model()
    sharded = model.sharded_state_dict()
    extra = {k for k in sharded if k.endswith("._extra_state")}
    assert set(sharded) - extra == set(model.state_dict())
    assert len(extra) == 2 * 4                                  # 4 linears per layer
    obj = sharded["decoder.layers.1.mlp.linear_fc2._extra_state"]
    assert obj.unique_key == "decoder.layers.mlp.linear_fc2._extra_state/shard_1_2"
    qkv = sharded["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.key == "decoder.layers.self_attention.linear_qkv.weight"
    assert qkv.global_shape == (2, 48, 16) and qkv.global_offset == (1, 0, 0)
    norm = sharded["decoder.layers.0.input_layernorm.weight"]
    assert norm.key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert sharded["decoder.layers.0.pre_mlp_layernorm.bias"].key == \
        "decoder.layers.mlp.linear_fc1.layer_norm_bias"
    assert sharded["decoder.final_layernorm.weight"].key == "decoder.final_layernorm.weight"


def test_tied_output_layer_is_a_replica_of_the_embedding(seeded):
    sharded = compat_model(share_embeddings_and_output_weights=True).sharded_state_dict()
    output = sharded["output_layer.weight"]
    assert output.key == "embedding.word_embeddings.weight" and output.replica_id != 0
    assert output.replica_id[0] == 1                            # never the written copy


def test_single_process_save_load_round_trip(seeded, tmp_path):
    model = compat_model()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    assert dist_checkpointing.check_is_distributed_checkpoint(str(tmp_path))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path)))
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    metadata = dist_checkpointing.load_tensors_metadata(str(tmp_path))
    assert metadata["decoder.layers.mlp.linear_fc1.weight"].global_shape == (2, 64, 16)


def test_sharded_tensor_and_object_follow_megatron():
    data = torch.zeros(4, 6)
    sh = ShardedTensor.from_rank_offsets("w", data, (1, 1, 2), (2, 3, 5), replica_id=(0, 1),
                                         prepend_axis_num=1)
    assert sh.global_shape == (1, 8, 30) and sh.global_offset == (0, 4, 18)
    assert sh.axis_fragmentations == (1, 2, 5) and sh.local_shape == (4, 6)
    obj = ShardedObject("rng", {"a": 1}, (2, 4), (1, 3))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    back = ShardedObject.empty_from_unique_key(obj.unique_key)
    assert (back.key, back.global_offset, back.global_shape) == ("rng", (1, 3), (2, 4))
    with pytest.raises(ValueError, match="flattened_range"):
        ShardedTensor.from_rank_offsets("w", data, flattened_range=slice(0, 2))


def test_objects_and_common_entries_round_trip(tmp_path):
    state = {"step": 7, "rng": ShardedObject("rng", [1, 2, 3], (1,), (0,)),
             "w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).view(2, 3))}
    dist_checkpointing.save(state, str(tmp_path))
    request = {"rng": ShardedObject("rng", None, (1,), (0,)),
               "w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3))}
    loaded = dist_checkpointing.load(request, str(tmp_path))
    assert loaded["step"] == 7 and loaded["rng"] == [1, 2, 3]
    assert torch.equal(loaded["w"], torch.arange(6.0).view(2, 3))
    with pytest.raises(dist_checkpointing.CheckpointingException, match="'v' is not in"):
        dist_checkpointing.load({"v": ShardedTensor.from_rank_offsets("v", torch.empty(1))},
                                str(tmp_path))


# ----------------------------------------------------------------------------- configs
def test_default_only_options_raise_naming_themselves():
    with pytest.raises(ValueError, match="use_megatron_fsdp"):
        DistributedDataParallelConfig(use_megatron_fsdp=True)
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances"):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match="optimizer_cpu_offload"):
        OptimizerConfig(lr=1.0, optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match="optimizer="):
        OptimizerConfig(lr=1.0, optimizer="sgd")
    with pytest.raises(ValueError, match="overlap_param_gather"):
        DistributedDataParallelConfig(overlap_param_gather=True)


def test_ddp_config_maps_onto_the_native_one():
    native = DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=1000,
                                           use_distributed_optimizer=True,
                                           overlap_param_gather=True).to_native()
    assert (native.grad_reduce_in_fp32, native.bucket_size, native.use_distributed_optimizer,
            native.overlap_param_gather) == (True, 1000, True, True)


def megatron_lr(n, max_lr, min_lr, warmup, decay, style):
    """Megatron's OptimizerParamScheduler.get_lr, written out (init_lr = 0)."""
    if warmup > 0 and n <= warmup:
        return max_lr * n / warmup
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_param_scheduler_follows_megatron(style):
    groups = [{"lr": 0.0, "weight_decay": 0.0, "wd_mult": 1.0},
              {"lr": 0.0, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 0.5}]
    optimizer = type("Opt", (), {"param_groups": groups})()
    scheduler = OptimizerParamScheduler(optimizer, 0.0, 1e-3, 1e-5, 3, 10, style, 0.0, 0.1, 10,
                                        "linear")
    for n in range(1, 13):
        scheduler.step(1)
        expected = megatron_lr(n, 1e-3, 1e-5, 3, 10, style)
        assert groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
        assert groups[1]["lr"] == pytest.approx(0.5 * expected, rel=1e-12)
        assert groups[0]["weight_decay"] == pytest.approx(0.1 * min(n, 10) / 10, rel=1e-12)
        assert groups[1]["weight_decay"] == 0.0
    restored = OptimizerParamScheduler(optimizer, 0.0, 1e-3, 1e-5, 3, 10, style, 0.0, 0.1, 10,
                                       "linear")
    restored.load_state_dict(scheduler.state_dict())
    assert restored.num_steps == 12
    with pytest.raises(ValueError, match="init_lr"):
        OptimizerParamScheduler(optimizer, 1e-4, 1e-3, 0.0, 1, 10, "linear", 0.0, 0.0, 1,
                                "constant")


def test_compile_helpers_is_a_no_op():
    assert compile_helpers() is None
    assert [s.name for s in Split] == ["train", "valid", "test"]


def test_transformer_block_builds_this_stage_on_its_own(seeded):
    from tpfuse.megatron_compat.transformer import TransformerBlock

    block = TransformerBlock(config(), specs.get_gpt_layer_local_spec())
    assert len(block.layers) == 2 and block.final_layernorm is not None
    hidden = torch.randn(SEQ, 2, 16)
    expected = hidden
    for layer in block.layers:
        expected = layer(expected)[0]
    assert torch.equal(block(hidden, None), block.final_layernorm(expected))
    assert "layers.1.mlp.linear_fc2.weight" in block.state_dict()
