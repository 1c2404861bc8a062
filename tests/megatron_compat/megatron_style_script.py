"""A small training script written against megatron-core 0.16's API (only the imports point at
``tpfuse.megatron_compat``), and the same model trained with tpfuse's native API.

Model: token embedding → N residual MLP blocks (column-parallel fc1, gelu, row-parallel fc2) →
untied column-parallel output layer → vocab-parallel cross-entropy; sequence parallelism on.
Every block, the embedding and the output layer draw their full master weights under their own
seed, so both scripts build identical weights at any layout. Data: micro-batch i's counting
sequences start at tokens drawn from a generator seeded with i. Optimiser: SGD on every rank's own parameters (dp = 1).
"""
import contextlib

import torch
import torch.nn.functional as F

SEED, VOCAB, HIDDEN, FFN, SEQ, MICRO, LAYERS = 11, 64, 16, 32, 8, 2, 4
GLOBAL_BATCH, RAMPUP, STEPS, LR = 8, [4, 2, 8], 6, 4.0


@contextlib.contextmanager
def seeded(seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def microbatch(index):
    """Counting sequences from random starts (learnable: the next token is this one + 1)."""
    gen = torch.Generator().manual_seed(1000 + index)
    starts = torch.randint(0, VOCAB, (MICRO, 1), generator=gen)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": torch.ones(MICRO, SEQ)}


def data_iterator():
    index = 0
    while True:
        yield microbatch(index)
        index += 1


def layer_range(pp_rank, pp):
    per_stage = LAYERS // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


# ----------------------------------------------------------------------------- Megatron style
def megatron_style_losses():
    from tpfuse.megatron_compat import parallel_state, tensor_parallel
    from tpfuse.megatron_compat.num_microbatches_calculator import (
        destroy_num_microbatches_calculator, get_current_global_batch_size,
        get_num_microbatches, init_num_microbatches_calculator, update_num_microbatches)
    from tpfuse.megatron_compat.pipeline_parallel import get_forward_backward_func
    from tpfuse.megatron_compat.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(2, 2)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    finalized = []
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        finalize_model_grads_func=lambda models, num_tokens, **kw: finalized.append(len(models)))

    class Block(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            with seeded(SEED + 100 + index):
                self.fc1 = tensor_parallel.ColumnParallelLinear(
                    HIDDEN, FFN, config=config, init_method=config.init_method, bias=True,
                    gather_output=False, skip_bias_add=True)
                self.fc2 = tensor_parallel.RowParallelLinear(
                    FFN, HIDDEN, config=config, init_method=config.output_layer_init_method,
                    bias=True, input_is_parallel=True, skip_bias_add=False)

        def forward(self, hidden):
            intermediate, bias = self.fc1(hidden)
            out, out_bias = self.fc2(F.gelu(intermediate + bias))
            assert out_bias is None
            return hidden + out

    class Stage(torch.nn.Module):
        def __init__(self, pre_process, post_process):
            super().__init__()
            self.config, self.pre_process, self.post_process = config, pre_process, post_process
            self.input_tensor = None
            if pre_process:
                with seeded(SEED + 1):
                    self.embedding = tensor_parallel.VocabParallelEmbedding(
                        VOCAB, HIDDEN, init_method=config.init_method,
                        reduce_scatter_embeddings=True, config=config)
            rank = parallel_state.get_pipeline_model_parallel_rank()
            self.blocks = torch.nn.ModuleList(Block(i) for i in layer_range(rank, 2))
            if post_process:
                with seeded(SEED + 3):
                    self.output_layer = tensor_parallel.ColumnParallelLinear(
                        HIDDEN, VOCAB, config=config, init_method=config.init_method, bias=False)

        def set_input_tensor(self, input_tensor):
            self.input_tensor = input_tensor

        def forward(self, tokens, labels):
            hidden = self.embedding(tokens) if self.pre_process else self.input_tensor
            for block in self.blocks:
                hidden = block(hidden)                                   # (s/tp, b, h)
            if not self.post_process:
                return hidden
            logits, _ = self.output_layer(hidden)                        # (s, b, V/tp)
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous())
            return loss.t()                                              # (b, s)

    def model_provider(pre_process=True, post_process=True):
        return Stage(pre_process, post_process)

    def loss_func(loss_mask, output_tensor):
        loss = torch.sum(output_tensor.float().reshape(-1) * loss_mask.reshape(-1))
        num_tokens = loss_mask.sum().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output_tensor = model(batch["tokens"], batch["labels"])
        return output_tensor, lambda out: loss_func(batch["loss_mask"], out)

    model = model_provider(parallel_state.is_pipeline_first_stage(),
                           parallel_state.is_pipeline_last_stage())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    init_num_microbatches_calculator(0, RAMPUP, GLOBAL_BATCH, MICRO,
                                     parallel_state.get_data_parallel_world_size())
    forward_backward_func = get_forward_backward_func()
    iterator, losses, consumed = data_iterator(), [], 0
    try:
        for _ in range(STEPS):
            update_num_microbatches(consumed, consistency_check=True)
            optimizer.zero_grad()
            reduced = forward_backward_func(
                forward_step_func=forward_step, data_iterator=iterator, model=[model],
                num_microbatches=get_num_microbatches(), seq_length=SEQ,
                micro_batch_size=MICRO, decoder_seq_length=SEQ, forward_only=False)
            optimizer.step()
            consumed += get_current_global_batch_size()
            if parallel_state.is_pipeline_last_stage():
                total = torch.stack([r["lm loss"] for r in reduced]).sum(0)
                losses.append((total[0] / total[1]).item())
    finally:
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
    assert finalized == [1] * STEPS, finalized
    return losses


# ----------------------------------------------------------------------------- native tpfuse
def native_losses():
    from types import SimpleNamespace

    from tpfuse.parallel.microbatches import MicrobatchCalculator
    from tpfuse.parallel.state import ParallelState
    from tpfuse.pipeline import get_forward_backward_func
    from tpfuse.tp_layers import (ColumnParallelLinear, RowParallelLinear,
                                  VocabParallelEmbedding, model_parallel_seed,
                                  vocab_parallel_cross_entropy)
    from tpfuse.tp_layers.init import normal_init

    state = ParallelState.initialize(tp=2, pp=2)
    torch.manual_seed(SEED)
    model_parallel_seed(SEED, state)
    std = 0.02
    out_init = normal_init(std / (2.0 * LAYERS) ** 0.5)

    class Block(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            with seeded(SEED + 100 + index):
                self.fc1 = ColumnParallelLinear(HIDDEN, FFN, init_method=normal_init(std),
                                                sequence_parallel=True, activation="gelu",
                                                state=state)
                self.fc2 = RowParallelLinear(FFN, HIDDEN, init_method=out_init,
                                             sequence_parallel=True, state=state)

        def forward(self, hidden):
            return hidden + self.fc2(self.fc1(hidden))

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(hidden_size=HIDDEN, sequence_parallel=True,
                                          params_dtype=torch.float32)
            self.first, self.last = state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
            if self.first:
                with seeded(SEED + 1):
                    self.embedding = VocabParallelEmbedding(VOCAB, HIDDEN, sequence_parallel=True,
                                                            state=state)
            self.blocks = torch.nn.ModuleList(Block(i) for i in layer_range(state.pp_rank, 2))
            if self.last:
                with seeded(SEED + 3):
                    self.output_layer = ColumnParallelLinear(HIDDEN, VOCAB, bias=False,
                                                             sequence_parallel=True, state=state)

        def set_input_tensor(self, input_tensor):
            self.input_tensor = input_tensor

        def forward(self, tokens, labels):
            hidden = self.embedding(tokens) if self.first else self.input_tensor
            for block in self.blocks:
                hidden = block(hidden)
            if not self.last:
                return hidden
            return vocab_parallel_cross_entropy(self.output_layer(hidden),
                                                labels.t().contiguous(), state=state)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], batch["labels"])
        return out, lambda loss: (loss.mean(), {"lm loss": loss.mean().detach()})

    model = Stage()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    calculator = MicrobatchCalculator(GLOBAL_BATCH, MICRO, state.dp_size,
                                      rampup_batch_size=RAMPUP)
    forward_backward = get_forward_backward_func(state)
    iterator, losses, consumed = data_iterator(), [], 0
    try:
        for _ in range(STEPS):
            calculator.update(consumed)
            optimizer.zero_grad()
            logs = forward_backward(forward_step, iterator, [model], calculator.num_microbatches,
                                    SEQ, MICRO)
            optimizer.step()
            consumed += calculator.current_global_batch_size
            if state.is_pipeline_last_stage():
                losses.append(torch.stack([d["lm loss"] for d in logs]).mean().item())
    finally:
        state.destroy()
    return losses


def both():
    return megatron_style_losses(), native_losses()
