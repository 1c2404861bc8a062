"""megatron-core 0.16.1 conventions the compat layer keeps, each checked against values worked
out by hand from megatron-core's source: ``utils.is_torch_min_version`` and
``transformer.transformer_layer.get_transformer_layer_offset``, the compat model's
``embedding_init_method_std`` and ``DistributedDataParallel.buffers`` /
``expert_parallel_buffers``."""
import math

import pytest
import torch

from tpfuse.megatron_compat import parallel_state
from tpfuse.megatron_compat.transformer.transformer_config import TransformerConfig
from tpfuse.megatron_compat.transformer.transformer_layer import get_transformer_layer_offset
from tpfuse.megatron_compat.utils import is_torch_min_version
from tpfuse.models.layer_assignment import layer_offset, layers_for


@pytest.mark.parametrize("installed, asked, at_least, strictly_above", [
    ("2.4.0", "2.4.0", True, False),                 # equality: >= holds, > does not
    ("2.4.1", "2.4.0", True, True),
    ("2.3.9", "2.4.0", False, False),
    ("2.4.0+cu121", "2.4.0", True, True),            # a local version sorts above its public one
    ("2.4.0a0+git1234", "2.4.0", False, False),      # a pre-release sorts below the release
    ("2.4.0rc1", "2.4.0a0", True, True),
    ("2.4.0rc1", "2.4.0rc1", True, False),
    ("2.10.0", "2.9.0", True, True),                 # numeric, not string, comparison
    ("2.13.0+cpu", "2.13", True, True),
])
def test_is_torch_min_version_compares_as_packaging_orders(monkeypatch, installed, asked,
                                                           at_least, strictly_above):
    monkeypatch.setattr(torch, "__version__", installed)
    assert is_torch_min_version(asked) is at_least
    assert is_torch_min_version(asked, check_equality=True) is at_least
    assert is_torch_min_version(asked, check_equality=False) is strictly_above


def _pipeline_config(num_layers, pp, vpp=None, first=None, last=None, **fields):
    return TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2,
                             pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                             virtual_pipeline_model_parallel_size=vpp,
                             num_layers_in_first_pipeline_stage=first,
                             num_layers_in_last_pipeline_stage=last, **fields)


# (num_layers, pp, vpp, first, last) -> offsets[vp_stage][pp_rank], each from megatron-core's
# formula by hand. Uneven: M = L - first - last over the stages not given; with vpp the per-chunk
# counts are first/vpp, M/vpp, last/vpp, a round holds T = their sum, and rank r > 0 starts at
# v·T + first/vpp + (r - [first given])·(M/vpp // middle stages).
OFFSET_GRID = [
    ((8, 1, None, None, None), [[0]]),
    ((8, 2, None, None, None), [[0, 4]]),
    ((8, 4, None, None, None), [[0, 2, 4, 6]]),
    ((8, 2, 2, None, None), [[0, 2], [4, 6]]),                 # (c·pp + r)·L/(pp·vpp)
    ((12, 2, 3, None, None), [[0, 2], [4, 6], [8, 10]]),
    ((10, 3, None, 2, None), [[0, 2, 6]]),                     # 2 | 4 | 4
    ((10, 3, None, None, 2), [[0, 4, 8]]),                     # 4 | 4 | 2
    ((10, 4, None, 1, 3), [[0, 1, 4, 7]]),                     # 1 | 3 | 3 | 3
    ((6, 3, None, 0, None), [[0, 0, 3]]),                      # an empty first stage
    ((12, 3, 2, 2, 2), [[0, 1, 5], [6, 7, 11]]),               # T = 1 + 4 + 1
    ((10, 3, 2, None, 2), [[0, 2, 4], [5, 7, 9]]),             # T = 0 + 4 + 1
    ((14, 4, 2, 2, None), [[0, 1, 3, 5], [7, 8, 10, 12]]),     # T = 1 + 6 + 0
]


@pytest.mark.parametrize("split, offsets", OFFSET_GRID)
def test_layer_offset_is_megatrons_over_a_grid_of_splits(split, offsets):
    num_layers, pp, vpp, first, last = split
    config = _pipeline_config(num_layers, pp, vpp, first, last)
    for vp_stage, row in enumerate(offsets):
        chunk = None if vpp is None else vp_stage
        assert [get_transformer_layer_offset(config, chunk, rank)
                for rank in range(pp)] == row, (split, vp_stage)
        if pp > 1:                                  # the native assignment underneath
            native = _native_assignment(config)
            for rank in range(pp):
                held = layers_for(native, rank, chunk)
                assert layer_offset(native, rank, chunk) == row[rank]
                assert not held or held[0] == row[rank]


def _native_assignment(config):
    from types import SimpleNamespace

    return SimpleNamespace(num_layers=config.num_layers,
                           pipeline_model_parallel_size=config.pipeline_model_parallel_size,
                           virtual_pipeline_model_parallel_size=(
                               config.virtual_pipeline_model_parallel_size),
                           decoder_first_pipeline_num_layers=(
                               config.num_layers_in_first_pipeline_stage),
                           decoder_last_pipeline_num_layers=(
                               config.num_layers_in_last_pipeline_stage))


def test_layer_offset_reads_the_rank_of_parallel_state_and_ignores_vp_stage_without_vpp():
    config = _pipeline_config(8, 4)
    parallel_state.set_pipeline_model_parallel_rank(3)
    try:
        assert get_transformer_layer_offset(config) == 6
        assert get_transformer_layer_offset(config, vp_stage=1) == 6   # no vpp: not read
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)


def test_layer_offset_needs_vp_stage_with_vpp_as_megatron_asserts():
    with pytest.raises(AssertionError, match="vp_stage must be provided"):
        get_transformer_layer_offset(_pipeline_config(8, 2, 2), None, 1)


@pytest.mark.parametrize("field", ["account_for_embedding_in_pipeline_split",
                                   "account_for_loss_in_pipeline_split"])
def test_layer_offset_refuses_the_splits_tpfuse_does_not_build_naming_the_field(field):
    config = _pipeline_config(7, 2, **{field: True})
    with pytest.raises(ValueError, match=f"TransformerConfig.{field}=True is not implemented"):
        get_transformer_layer_offset(config, None, 1)
    assert get_transformer_layer_offset(_pipeline_config(7, 1, **{field: True}), None, 0) == 0


# ----------------------------------------------------------------------------- embedding std
def test_compat_model_draws_its_embeddings_with_embedding_init_method_std():
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.tensor_parallel.random import model_parallel_cuda_manual_seed
    from tpfuse.models import GPTModel as NativeGPT
    from tpfuse.models import TransformerConfig as NativeConfig

    vocab, seq = 64, 16
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               init_method_std=0.02, embedding_init_method_std=0.1)
    assert config.embedding_init_method.keywords["std"] == 0.1      # Megatron's derived method
    compat = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab,
                      max_sequence_length=seq)
    native = NativeGPT(NativeConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                    vocab_size=vocab, make_vocab_size_divisible_by=1,
                                    seq_length=seq, seed=5, init_method_std=0.02,
                                    embedding_init_method_std=0.1,
                                    untie_embeddings_and_output_weights=True))
    assert compat.native.config.embedding_init_method_std == 0.1
    compat_weights = compat.native.state_dict()
    for name, tensor in native.state_dict().items():
        assert torch.equal(tensor, compat_weights[name]), name


def test_compat_model_refuses_a_custom_embedding_init_method():
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               embedding_init_method=torch.nn.init.zeros_)
    with pytest.raises(ValueError, match="TransformerConfig.embedding_init_method: tpfuse draws"):
        GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


# ----------------------------------------------------------------------------- DDP buffers
def _megatron_layout(params, distributed, dp):
    """megatron-core's single-bucket layout (bucket_size None): parameters in reverse order,
    with the distributed optimizer each starting at a multiple of 64 and the bucket padded to a
    multiple of lcm(dp, 128). (param -> (start, end, 0)), numel_unpadded, numel."""
    index_map, cursor = {}, 0
    for param in reversed(params):
        start = -(-cursor // 64) * 64 if distributed else cursor
        index_map[param] = (start, start + param.numel(), 0)
        cursor = start + param.numel()
    divisor = math.lcm(dp, 128) if distributed else 1
    return index_map, cursor, -(-cursor // divisor) * divisor


def _ddp_buffer_facts():
    """dp = 2, a MoE GPT (experts over edp = 2): per DDP variant the checks of Megatron's buffer
    attributes that failed (empty: all hold) and a few sizes."""
    import torch.nn.functional as F

    from tpfuse.megatron_compat.distributed import (DistributedDataParallel,
                                                    DistributedDataParallelConfig)
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.tensor_parallel import model_parallel_cuda_manual_seed

    facts = {}
    for name, distributed, disable_bucketing in (("plain", False, False),
                                                 ("distributed", True, False),
                                                 ("one group", False, True)):
        parallel_state.initialize_model_parallel(1, 1)
        try:
            model_parallel_cuda_manual_seed(3)
            config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                                       num_moe_experts=2, moe_router_topk=1,
                                       moe_ffn_hidden_size=16, gated_linear_unit=True,
                                       activation_func=F.silu, hidden_dropout=0.0,
                                       attention_dropout=0.0)
            model = GPTModel(config, get_gpt_layer_local_spec(num_experts=2), vocab_size=32,
                             max_sequence_length=8)
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
                use_distributed_optimizer=distributed), model,
                disable_bucketing=disable_bucketing)
            facts[name] = _check_buffers(ddp, model, distributed, disable_bucketing)
        finally:
            parallel_state.destroy_model_parallel()
    return facts


def _check_buffers(ddp, model, distributed, disable_bucketing):
    failed = []

    def check(condition, what):
        if not condition:
            failed.append(what)

    trainable = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in trainable if getattr(p, "allreduce", True)]
    expert = [p for p in trainable if not getattr(p, "allreduce", True)]
    check(isinstance(ddp.buffers, list) and isinstance(ddp.expert_parallel_buffers, list),
          "lists")
    check(len(ddp.buffers) == 1 and len(ddp.expert_parallel_buffers) == 1, "one dtype each")
    for buffer, params in ((ddp.buffers[0], dense), (ddp.expert_parallel_buffers[0], expert)):
        check([id(p) for p in buffer.params] == [id(p) for p in params], "params in order")
        check(buffer.param_indices == list(range(len(params))), "param_indices")
        check(buffer.param_dtype == buffer.grad_dtype == torch.float32, "dtypes")
        check(buffer.data_parallel_world_size == 2, "data_parallel_world_size")
        check(buffer.gradient_scaling_factor == 0.5, "1/dp scaling")
        index_map, unpadded, numel = _megatron_layout(params, distributed, 2)
        check(buffer.param_index_map == index_map, "param_index_map")
        check((buffer.numel_unpadded, buffer.numel) == (unpadded, numel), "numel")
        check(buffer.grad_data.shape == (numel,), "grad_data size")
        check(buffer.bucket_indices == [(0, numel)], "bucket_indices")
        check(len(buffer.buckets) == 1, "one bucket")
        bucket = buffer.buckets[0]
        check(bucket.params_list == params[::-1] and bucket.params == set(params), "bucket params")
        check((bucket.bucket_id, bucket.offset, bucket.numel_unpadded) == (0, 0, unpadded),
              "bucket ids")
        check(bucket.grad_data.data_ptr() == buffer.grad_data.data_ptr(), "bucket grad_data")
        within, start = {}, 0
        for param in params[::-1]:
            within[param] = (start, start + param.numel())
            start += param.numel()
        check(bucket.param_to_index == within, "param_to_index")
        check(all(buffer.param_to_bucket[p] is bucket for p in params), "param_to_bucket")
        for param in params:
            start, end, _ = buffer.param_index_map[param]
            check(param.main_grad.data_ptr() == buffer.grad_data[start:end].data_ptr(),
                  "main_grad is a view of grad_data")
            if distributed:
                check(param.data.data_ptr() == buffer.param_data[start:end].data_ptr(),
                      "param.data is a view of param_data")
        check((buffer.param_data is not None) == distributed, "param_data")
        buffer.grad_data.fill_(2.0)
        buffer.scale_gradients(0.25)
        check(bool((params[0].main_grad == 0.5).all()), "scale_gradients")
        buffer.reset()
        check(bool((buffer.grad_data == 0).all()), "reset")
    groups = ddp.bucket_groups + ddp.expert_parallel_bucket_groups
    check(len(groups) == 2 and [len(g.buckets) for g in groups] == [1, 1], "bucket groups")
    check(all(ddp.param_to_bucket_group[p] is groups[0] for p in dense)
          and all(ddp.param_to_bucket_group[p] is groups[1] for p in expert),
          "param_to_bucket_group")
    check(groups[0].params == set(dense) and groups[0].buckets == ddp.buffers[0].buckets,
          "group params")
    ddp.zero_grad_buffer()
    return failed, len(dense), len(expert)


def test_ddp_buffers_are_megatrons_buffer_lists(run_distributed):
    for rank_facts in run_distributed(2, _ddp_buffer_facts):
        for name, (failed, dense, expert) in rank_facts.items():
            assert failed == [], name
            assert dense > 0 and expert > 0, name


@pytest.mark.parametrize("tied_first", [True, False])
def test_buffer_sizes_with_a_shared_embedding_bucket_are_megatrons(tied_first):
    """Distributed optimizer, dp 2, the tied embedding (100 elements) in a bucket of its own.
    Registered first (first stage: it is laid out last), Megatron closes the bucket before it at
    its 64-aligned start: w2 [0, 50), w1 [64, 94), bucket 0 unpadded 128 (not 94), end 128;
    embedding [128, 228), bucket 1 unpadded 100, end 256. Registered last (last stage's output
    layer), no early close: embedding [0, 100), bucket 0 unpadded 100 → 128; w1 [128, 158),
    unpadded 30, end 256."""
    from tpfuse.megatron_compat.distributed import DistributedDataParallelConfig
    from tpfuse.megatron_compat.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from tpfuse.training.grad_buffers import ParamAndGradBuffer

    embedding, w1, w2 = (torch.nn.Parameter(torch.zeros(n)) for n in (100, 30, 50))
    params = [embedding, w1, w2] if tied_first else [w1, embedding]
    native = ParamAndGradBuffer(params, torch.float32, None, 2, 0, 0.5, None, distributed=True,
                                own_bucket=frozenset({id(embedding)}))
    buffer = _ParamAndGradBuffer(native, DistributedDataParallelConfig(
        use_distributed_optimizer=True), bucket_size=None)
    if tied_first:
        expected_map = {w2: (0, 50, 0), w1: (64, 94, 0), embedding: (128, 228, 1)}
        expected_buckets = ([(0, 128), (128, 256)], [128, 100])
    else:
        expected_map = {embedding: (0, 100, 0), w1: (128, 158, 1)}
        expected_buckets = ([(0, 128), (128, 256)], [100, 30])
    assert buffer.param_index_map == expected_map
    assert (buffer.bucket_indices, [b.numel_unpadded for b in buffer.buckets]) == \
        expected_buckets
    assert (buffer.numel, buffer.numel_unpadded) == (256, sum(expected_buckets[1]))
