"""tpfuse.megatron_compat: each Megatron-style call checked against the native tpfuse call or a
hand-computed value (single-process parts here, the tensor-parallel parts on 4 gloo ranks)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpfuse.megatron_compat import num_microbatches_calculator as nmc
from tpfuse.megatron_compat import parallel_state as mpu
from tpfuse.megatron_compat import tensor_parallel as tensor_parallel
from tpfuse.megatron_compat._fields import ONLY, support_of
from tpfuse.megatron_compat.enums import ModelType
from tpfuse.megatron_compat.model_parallel_config import ModelParallelConfig
from tpfuse.megatron_compat.pipeline_parallel import schedules
from tpfuse.megatron_compat.transformer import TransformerConfig
from tpfuse.parallel.microbatches import MicrobatchCalculator

TINY = dict(num_layers=4, hidden_size=16, num_attention_heads=4)


# ----------------------------------------------------------------------------- configs (item 2)
def test_configs_have_megatrons_fields_defaults_and_derivations():
    assert len(dataclasses.fields(ModelParallelConfig)) == 67
    assert len(dataclasses.fields(TransformerConfig)) == 242
    c = TransformerConfig(**TINY)
    # Megatron's defaults (no seq_length needed) and derived values
    assert (c.hidden_dropout, c.attention_dropout, c.layernorm_epsilon, c.add_bias_linear,
            c.normalization, c.init_method_std, c.transformer_impl, c.params_dtype) == (
        0.1, 0.1, 1e-5, True, "LayerNorm", 0.02, "transformer_engine", torch.float32)
    assert (c.ffn_hidden_size, c.kv_channels, c.num_query_groups) == (64, 4, 4)
    assert c.microbatch_group_size_per_vp_stage == 1 and c.expert_tensor_parallel_size == 1
    w = torch.empty(4000)
    torch.manual_seed(0)
    c.output_layer_init_method(w)        # N(0, 0.02² / (2·4)): std 0.02/√8 ≈ 0.00707
    assert w.std().item() == pytest.approx(0.02 / 8 ** 0.5, rel=0.05)


def test_default_only_fields_raise_and_free_fields_are_accepted():
    support = support_of(TransformerConfig)
    only = [name for name, kind in support.items() if kind == ONLY]
    assert {"fp8", "tp_comm_overlap", "variable_seq_lengths", "enable_cuda_graph",
            "overlap_p2p_comm", "cpu_offloading"} <= set(only)
    for name, value in (("fp8", "e4m3"), ("tp_comm_overlap", True), ("overlap_p2p_comm", True),
                        ("variable_seq_lengths", True), ("deterministic_mode", True)):
        with pytest.raises(ValueError, match=f"{name}={value!r} is not supported"):
            TransformerConfig(**TINY, **{name: value})
    config = TransformerConfig(**TINY, gated_linear_unit=True, qk_layernorm=True,
                               num_moe_experts=8, use_cpu_initialization=True,
                               gradient_accumulation_fusion=True)
    assert config.num_moe_experts == 8 and config.moe_ffn_hidden_size == 64
    with pytest.raises(ValueError, match="pipeline_dtype"):
        ModelParallelConfig(pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ModelParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="num_attention_heads=4 must be a multiple"):
        TransformerConfig(**TINY, tensor_model_parallel_size=8)


# ----------------------------------------------------------------------------- micro-batches (4)
def test_module_level_microbatch_api_matches_native_calculator():
    native = MicrobatchCalculator(32, 2, 2, rampup_batch_size=[8, 8, 48])
    nmc.init_num_microbatches_calculator(0, ["8", "8", "48"], 32, 2, 2)   # CLI strings, as Megatron
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            nmc.init_num_microbatches_calculator(0, None, 32, 2, 2)
        for consumed in (0, 15, 16, 40, 48, 49, 1000):
            nmc.update_num_microbatches(consumed, consistency_check=True)
            native.update(consumed)
            assert (nmc.get_num_microbatches(), nmc.get_current_global_batch_size(),
                    nmc.get_current_running_global_batch_size(), nmc.get_micro_batch_size()) \
                == (native.num_microbatches, native.current_global_batch_size,
                    native.current_running_global_batch_size, 2), consumed
        calc = nmc._calculator()
        assert (calc.start_global_batch_size, calc.batch_size_increment, calc.ramup_samples,
                calc.rampup_samples_per_increment, calc.micro_batch_times_data_parallel_size,
                calc.num_micro_batches) == (8, 8, 48, 16.0, 4, 8)
        nmc.reconfigure_num_microbatches_calculator(0, None, 10, 2, 2,
                                                    decrease_batch_size_if_needed=True)
        assert (nmc.get_num_microbatches(), nmc.get_current_running_global_batch_size()) == (2, 8)
    finally:
        nmc.destroy_num_microbatches_calculator()
    with pytest.raises(RuntimeError, match="not initialized"):
        nmc.get_num_microbatches()
    with pytest.raises(ValueError, match="not an integer"):
        nmc.init_num_microbatches_calculator(0, ["8", "8.5", "48"], 32, 2, 2)


# ----------------------------------------------------------------------------- seeding (7)
def test_model_parallel_cuda_manual_seed_streams_and_default_generator():
    mpu.destroy_model_parallel()
    mpu.set_tensor_model_parallel_rank(1)        # Megatron's setters feed the seeds
    mpu.set_expert_model_parallel_rank(2)
    mpu.set_expert_tensor_parallel_rank(1)
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(50)
    finally:
        mpu.destroy_model_parallel()
    assert torch.equal(torch.rand(2), expected)          # CPU default generator untouched
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, tensor_parallel.CudaRNGStatesTracker)
    for name, seed in (("data-parallel-rng", 50), ("model-parallel-rng", 50 + 2718 + 1),
                       (tensor_parallel.get_expert_parallel_rng_tracker_name(),
                        50 + 1024 + 100 * 2 + 1)):
        with tracker.fork(name):
            assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator()
                                                         .manual_seed(seed))), name
    with pytest.raises(ValueError, match="use_te_rng_tracker"):
        tensor_parallel.get_cuda_rng_tracker(use_te_rng_tracker=True)


# ----------------------------------------------------------------------------- misc API (8)
def test_model_type_pipeline_helpers_and_utils():
    assert ModelType.encoder_or_decoder.value == 1
    with pytest.raises(ValueError, match="deprecated"):
        ModelType.encoder_or_decoder.encoder_and_decoder
    x = torch.ones(3, requires_grad=True)
    out = (x * 2).exp()
    schedules.deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
    assert out.numel() == 1                              # storage freed, grad_fn kept
    schedules.custom_backward(out, torch.ones(3))        # shape of the original output
    assert torch.allclose(x.grad, 2 * torch.exp(torch.full((3,), 2.0)))
    parts = tensor_parallel.split_tensor_along_last_dim(torch.arange(12.).view(2, 6), 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert tensor_parallel.VocabUtility.vocab_range_from_global_vocab_size(96, 2, 4) == (48, 72)
    assert schedules.get_forward_backward_func(1, None) is schedules.forward_backward_no_pipelining
    assert schedules.get_forward_backward_func(4, None) is \
        schedules.forward_backward_pipelining_without_interleaving
    assert schedules.get_forward_backward_func(4, 2) is \
        schedules.forward_backward_pipelining_with_interleaving
    w = torch.randn(5, 3, requires_grad=True)
    inp = torch.randn(4, 3, requires_grad=True)
    y = tensor_parallel.linear_with_frozen_weight(inp, w, None, False, False, False, None)
    y.sum().backward()
    assert w.grad is None                                # frozen: no weight gradient
    torch.testing.assert_close(inp.grad, torch.ones(4, 5) @ w.detach())


def test_no_pipelining_schedule_keywords_and_loss_conventions():
    """Megatron's keyword set; the 2-value loss is divided by m; grad_scale_func applies; the
    gradient equals the dense one of the mean loss."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model.config = ModelParallelConfig(grad_scale_func=lambda loss: 4.0 * loss)
    model.set_input_tensor = lambda tensor: None
    batches = [torch.randn(2, 3) for _ in range(3)]

    def forward_step(data_iterator, module):
        out = module(next(data_iterator)).sum()
        return out, lambda o: (o, {"value": o.detach()})

    reduced = schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=3, seq_length=4, micro_batch_size=2, decoder_seq_length=4,
        forward_only=False, collect_non_loss_data=False, first_val_step=None,
        adjust_tensor_shapes_fn=None, force_all_reduce=True)
    assert [r["value"].item() for r in reduced] == [model(b).sum().item() for b in batches]
    expected = 4.0 * sum(b.sum(0) for b in batches) / 3          # d(4·mean of sums)/dw
    torch.testing.assert_close(model.weight.grad[0], expected)
    with pytest.raises(ValueError, match="pg_collection"):
        schedules.forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=iter(batches), model=model,
            num_microbatches=1, seq_length=4, micro_batch_size=2, pg_collection=object())


def test_pipeline_tensors_travel_in_pipeline_dtype():
    from tpfuse.pipeline.executor import _recv_tensor_spec

    chunk = torch.nn.Linear(2, 2)
    chunk.config = TransformerConfig(**TINY, pipeline_model_parallel_size=2,
                                     pipeline_dtype=torch.bfloat16)
    _, dtype, _ = _recv_tensor_spec([chunk], 8, 2, None, None)
    assert dtype == torch.bfloat16                # Megatron's field, not params_dtype (fp32)


# ----------------------------------------------------------------------------- 4 gloo ranks
def _rank_input(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layers_vs_native(config):
    from tpfuse.tp_layers import ColumnParallelLinear, RowParallelLinear
    from tpfuse.tp_layers.init import normal_init

    init = normal_init(0.02)
    x = _rank_input((8, 2, 16), 1)                                   # (s, b, h), replicated
    torch.manual_seed(4)
    col = tensor_parallel.ColumnParallelLinear(16, 32, config=config, init_method=init,
                                               keep_master_weight_for_test=True)
    torch.manual_seed(4)
    native_col = ColumnParallelLinear(16, 32, init_method=init)      # the default state's group
    out, bias = col(x)
    assert bias is None and torch.equal(out, native_col(x))
    assert torch.equal(col.master_weight.chunk(2)[mpu.get_tensor_model_parallel_rank()],
                       col.weight)
    gathered, _ = col(x, runtime_gather_output=True)                 # (s, b, 32) everywhere
    assert torch.equal(gathered, x @ col.master_weight.t())
    torch.manual_seed(5)
    row = tensor_parallel.RowParallelLinear(32, 16, config=config, init_method=init, bias=True,
                                            input_is_parallel=True, skip_bias_add=True)
    torch.manual_seed(5)
    native_row = RowParallelLinear(32, 16, init_method=init, skip_bias_add=True)
    (y, b), (ny, nb) = row(out), native_row(out)
    assert torch.equal(y, ny) and torch.equal(b, nb) and b.shape == (16,)
    # Megatron's keyword forms (config=, skip_bias_add=) build the native layer's weights
    torch.manual_seed(4)
    kw_col = tensor_parallel.ColumnParallelLinear(16, 32, config=config, init_method=init,
                                                  skip_bias_add=True)
    assert torch.equal(kw_col.weight, native_col.weight) and kw_col(x)[1] is kw_col.bias
    lazy = ModelParallelConfig(tensor_model_parallel_size=2, perform_initialization=False)
    assert not tensor_parallel.ColumnParallelLinear(16, 32, config=lazy, init_method=init
                                                    ).weight.any()
    tied = tensor_parallel.ColumnParallelLinear(16, 32, config=config, init_method=init,
                                                skip_weight_param_allocation=True)
    assert tied.weight is None and torch.equal(tied(x, weight=col.weight)[0], out)
    with pytest.raises(RuntimeError, match="skip_weight_param_allocation"):
        tied(x)
    return True


def _mappings_vs_native():
    from tpfuse.parallel import mappings as M

    group = mpu.get_tensor_model_parallel_group()
    rank, tp = mpu.get_tensor_model_parallel_rank(), 2
    x = _rank_input((4, 2, 6), 10 + rank)
    pairs = [
        (tensor_parallel.copy_to_tensor_model_parallel_region(x), M.copy_to_region(x, group)),
        (tensor_parallel.reduce_from_tensor_model_parallel_region(x),
         M.reduce_from_region(x, group)),
        (tensor_parallel.scatter_to_tensor_model_parallel_region(x), M.scatter_to_region(x, group)),
        (tensor_parallel.gather_from_tensor_model_parallel_region(x),
         M.gather_from_region(x, group)),
        (tensor_parallel.scatter_to_sequence_parallel_region(x),
         M.scatter_to_sequence_parallel_region(x, group)),
        (tensor_parallel.reduce_scatter_to_sequence_parallel_region(x),
         M.reduce_scatter_to_sequence_parallel_region(x, group)),
        (tensor_parallel.all_gather_last_dim_from_tensor_parallel_region(x),
         M.all_gather_last_dim_region(x, group)),
    ]
    for i, (megatron, native) in enumerate(pairs):
        assert torch.equal(megatron, native), i
    # Megatron's argument order: the second positional is tensor_parallel_output_grad
    leaf = x.clone().requires_grad_(True)
    tensor_parallel.gather_from_sequence_parallel_region(leaf, False).sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(x))            # split, not reduce-scatter
    # uneven sequence splits: rank r holds r + 1 rows
    rows = _rank_input((rank + 1, 3), 20 + rank).requires_grad_(True)
    full = tensor_parallel.gather_from_sequence_parallel_region(rows, output_split_sizes=[1, 2])
    expected = torch.cat([_rank_input((r + 1, 3), 20 + r) for r in range(tp)])
    assert torch.equal(full, expected)
    (full * torch.arange(3.0).repeat(3, 1)).sum().backward()      # grad rows summed over tp
    assert torch.equal(rows.grad, tp * torch.arange(3.0).repeat(rank + 1, 1))
    summed = tensor_parallel.reduce_scatter_to_sequence_parallel_region(
        torch.ones(3, 2), input_split_sizes=[1, 2])
    assert torch.equal(summed, torch.full((rank + 1, 2), float(tp)))
    tokens = _rank_input((4, 6), 30 + rank)                      # sp: this rank's 4 tokens
    hp = tensor_parallel.all_to_all_sp2hp(tokens)                # (8 tokens, h/2)
    every = torch.cat([_rank_input((4, 6), 30 + r) for r in range(tp)])
    assert torch.equal(hp, every[:, rank * 3:(rank + 1) * 3])
    assert torch.equal(tensor_parallel.all_to_all_hp2sp(hp), tokens)
    return True


def _cross_entropy_and_broadcast():
    rank = mpu.get_tensor_model_parallel_rank()
    logits = _rank_input((3, 2, 10), 40)                         # (s, b, V), same on every rank
    target = torch.tensor([[1, 9], [0, 4], [7, 7]])
    shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
    loss = tensor_parallel.vocab_parallel_cross_entropy(shard, target, label_smoothing=0.1)
    dense = logits.clone().requires_grad_(True)
    # Megatron's smoothing ε over V classes is torch's ε·V/(V−1)
    reference = F.cross_entropy(dense.view(-1, 10), target.view(-1), reduction="none",
                                label_smoothing=0.1 * 10 / 9).view(3, 2)
    torch.testing.assert_close(loss, reference)
    loss.sum().backward()
    reference.sum().backward()
    torch.testing.assert_close(shard.grad, dense.grad.chunk(2, dim=-1)[rank])
    plain = tensor_parallel.vocab_parallel_cross_entropy(shard.detach(), target)
    torch.testing.assert_close(plain, F.cross_entropy(logits.view(-1, 10), target.view(-1),
                                                      reduction="none").view(3, 2))
    data = {"tokens": torch.arange(6).view(2, 3) * (rank + 1), "ids": torch.tensor([rank])}
    got = tensor_parallel.broadcast_data(["tokens", "ids"], data, torch.int64)
    assert torch.equal(got["tokens"], torch.arange(6).view(2, 3)) and got["ids"].tolist() == [0]
    return True


def _expert_layers():
    from tpfuse.tp_layers.init import normal_init

    config = ModelParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    common = dict(config=config, init_method=normal_init(0.02), is_expert=True)
    x = _rank_input((4, 1, 8), 50)
    col = tensor_parallel.ColumnParallelLinear(8, 16, **common)   # etp 1, ep 2: local shard only
    row = tensor_parallel.RowParallelLinear(16, 8, bias=True, input_is_parallel=True,
                                            skip_bias_add=True, **common)
    assert col.tp.size == mpu.get_expert_tensor_parallel_world_size() == 1
    assert col.weight.allreduce is False and row.bias.allreduce is False
    assert torch.equal(col(x)[0], x @ col.weight.t() + col.bias)
    with pytest.raises(ValueError, match="skip_bias_add"):
        tensor_parallel.RowParallelLinear(16, 8, bias=True, input_is_parallel=True,
                                          skip_bias_add=False, **common)
    return True


def _compat_body():
    assert mpu.initialize_model_parallel(2) is None              # Megatron returns None
    try:
        config = ModelParallelConfig(tensor_model_parallel_size=2)
        assert _layers_vs_native(config) and _mappings_vs_native()
        assert _cross_entropy_and_broadcast()
    finally:
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2, expert_model_parallel_size=2,
                                  expert_tensor_parallel_size=1)
    try:
        assert _expert_layers()
    finally:
        mpu.destroy_model_parallel()
    with pytest.raises(AssertionError):                           # Megatron's assert type
        mpu.get_tensor_model_parallel_group()
    return True


def test_tensor_parallel_api_against_native_on_four_ranks(run_distributed):
    assert run_distributed(4, _compat_body) == [True] * 4


# ----------------------------------------------------------------------------- datasets (6)
def test_gpt_dataset_config_fields_mock_and_attention_mask():
    from tpfuse.data.indices import build_gpt_indices
    from tpfuse.data.tokenizer import NullTokenizer
    from tpfuse.megatron_compat.datasets.gpt_dataset import (BlendedMegatronDatasetBuilder,
                                                            GPTDatasetConfig, MockGPTDataset)

    fields = [f for f in dataclasses.fields(GPTDatasetConfig) if f.init]
    assert len(fields) == 27
    flags = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    config = GPTDatasetConfig(random_seed=5, sequence_length=8, tokenizer=NullTokenizer(50),
                              **flags)
    assert config.mock and config.split == "1,1,1"              # derived from the missing blend
    assert config.create_attention_mask and config.add_extra_token_to_sequence
    assert config.split_matrix == [(0.0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.0)]
    with pytest.raises(ValueError, match="reset_position_ids"):
        GPTDatasetConfig(random_seed=5, sequence_length=8, tokenizer=NullTokenizer(50))
    blended = GPTDatasetConfig(random_seed=5, sequence_length=8, tokenizer=NullTokenizer(50),
                               blend=(["a", "b"], [0.3, 0.7]), split="98,2,0", **flags)
    assert blended.native.blend_pairs == [("a", 0.3), ("b", 0.7)] and not blended.mock
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [6, 0, 0], lambda: True,
                                                config).build()
    sample = train[0]
    causal_masked = ~torch.tril(torch.ones(8, 8, dtype=torch.bool))
    assert torch.equal(sample["attention_mask"][0], causal_masked)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    # add_extra_token_to_sequence=False: windows of s tokens, the last label a masked pad
    short = GPTDatasetConfig(random_seed=5, sequence_length=8, tokenizer=NullTokenizer(50),
                             add_extra_token_to_sequence=False, **flags)
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [6, 0, 0], lambda: True,
                                                short).build()
    sample = train[0]
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert sample["labels"][-1] == -100 and sample["loss_mask"][-1] == 0
    assert sample["loss_mask"][:-1].all()
    # 6 tokens, s = 3: (6 - 1) // 3 = 1 sample with the extra token, 6 // 3 = 2 without
    assert build_gpt_indices([4, 2], [0, 1], 3, None, 0)[2].size == 1
    documents, sample_index, shuffle = build_gpt_indices([4, 2], [0, 1], 3, None, 0,
                                                         extra_tokens=0)
    # seed 0 orders the documents [1, 0]: stream = doc 1 (2 tokens), doc 0 (4 tokens); windows
    # start at 0 and 3, and the last entry locates the stream's last token (position 5)
    assert documents.tolist() == [1, 0] and shuffle.size == 2
    assert sample_index.tolist() == [[0, 0], [1, 1], [1, 3]]


def test_linear_with_grad_accumulation_accumulates_into_main_grad():
    """Megatron's gradient-accumulation fusion: with ``weight.main_grad`` set, the weight
    gradient of each call is added to it (fp32), matching x^T·dy summed over two calls."""
    torch.manual_seed(1)
    w = torch.randn(5, 3, requires_grad=True)
    w.main_grad = torch.zeros(5, 3)
    xs = [torch.randn(4, 3) for _ in range(2)]
    for x in xs:
        tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, True, False, False).sum().backward()
    expected = sum(torch.ones(4, 5).t() @ x for x in xs)
    torch.testing.assert_close(w.main_grad, expected)
