"""Document masks, sliding windows and context parallelism in the layers, the model and the trainer's
batch / loss helpers, each against a reference computed another way:

- ParallelAttention with document ids and a window (flash path, head dim 16, and explicit path,
  head dim 4) against the dense head-by-head attention with the mask built from its definition,
  at tp 1 and 2, and at tp2 × cp2 with sequence parallelism for every cp comm type (parameter
  gradients summed over cp, as the dp-cp gradient reduction does);
- a GPTModel on packed documents (document ids, positions restarting per document) gives each
  document's tokens exactly the losses and gradients of that document run alone;
- ``get_batch_on_this_cp_rank`` / ``sequence_mean_loss`` against the whole-sequence values;
- bad settings (sequence not divisible by 2·cp or 2·cp·tp with SP, kv heads for a2a, attention
  dropout, cp not dividing the world) fail through ``pretrain`` with a ValueError naming the
  values on every rank by itself, and the KV cache is refused under context parallelism.

Tolerance: tests/support/tp_testing.py (fp32 sums in another order; a wrong mask or offset moves
outputs by O(1)).
"""
import pytest
import torch
import torch.distributed as dist

from support.dense_reference import assembled_grads, dense_attention, master_params
from support.pretrain_run import pretrain_error
from support.tp_testing import assert_close_fp32, chunk_of, seeded_randn
from tpfuse.parallel.context_split import split_sequence

S, B = 16, 2


def _document_ids(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.repeat_interleave(torch.arange(S), torch.randint(1, 8, (S,), generator=gen))[:S]
            for _ in range(B)]
    return torch.stack(rows)                                       # (B, S) sorted ids


def _keep(ids, window):
    """(B, 1, S, S) bool by the definitions: causal, window, same document."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    keep = (j <= i) & ((i - j < window) if window else torch.ones(S, S, dtype=torch.bool))
    if ids is not None:
        keep = keep & (ids[:, :, None] == ids[:, None, :])
    return keep[:, None] if keep.dim() == 3 else keep


def _local(t, state, dim, sp):
    """This rank's part of a full tensor: cp chunks along ``dim``, then (SP) the tp chunk."""
    t = split_sequence(t, state.cp_size, state.cp_rank, dim=dim)
    return chunk_of(t, state, dim) if sp else t


ATTENTION_CASES = {  # name: (hidden, heads, groups, rope)
    "flash_gqa_rope": (128, 8, 4, True),
    "explicit_mha": (16, 4, 4, False),
}


def _check_attention(state, sp, comm_type, case, ids, window):
    from tpfuse.tp_layers import ParallelAttention

    hidden, heads, groups, rope = ATTENTION_CASES[case]
    module = ParallelAttention(hidden, heads, num_query_groups=groups,
                               position_embedding_type="rope" if rope else "learned_absolute",
                               rotary_base=100.0, sequence_parallel=sp, state=state,
                               window_size=window, cp_comm_type=comm_type)
    masters = master_params(module, state, seed=100)
    positions = torch.arange(S).expand(B, S)
    x, dy = seeded_randn(1, S, B, hidden), seeded_randn(2, S, B, hidden)
    xd = x.clone().requires_grad_()
    expected = dense_attention(masters, "", xd, heads, groups, 100.0 if rope else None, positions,
                               keep=_keep(ids, window))
    expected.backward(dy)
    x_in = _local(x, state, 0, sp).clone().requires_grad_()
    local_ids = None if ids is None else split_sequence(ids, state.cp_size, state.cp_rank, dim=1)
    out, bias = module(x_in, split_sequence(positions, state.cp_size, state.cp_rank, dim=1),
                       document_ids=local_ids)
    tag = f"{case} tp={state.tp_size} cp={state.cp_size} sp={sp} {comm_type} window={window}"
    out = out if bias is None else out + bias   # None at tp = 1: the projection GEMM added it
    assert_close_fp32(out, _local(expected.detach(), state, 0, sp), f"{tag}: out")
    out.backward(_local(dy, state, 0, sp))
    assert_close_fp32(x_in.grad, _local(xd.grad, state, 0, sp), f"{tag}: dx")
    for param in module.parameters():           # each cp rank holds its tokens' share
        dist.all_reduce(param.grad, group=state.cp_group)
    for name, grad in assembled_grads(module, state).items():
        assert_close_fp32(grad, masters[name].grad, f"{tag}: d{name}")


def _attention_masks_against_dense(layouts):
    from tpfuse.parallel.state import ParallelState

    checked = 0
    for tp, cp, sp, comm_types in layouts:
        state = ParallelState.initialize(tp=tp, cp=cp)
        try:
            for comm_type in comm_types:
                for case in ATTENTION_CASES:
                    for ids, window in ((_document_ids(3), None), (None, 3),
                                        (_document_ids(4), 5)):
                        _check_attention(state, sp, comm_type, case, ids, window)
                        checked += 1
        finally:
            state.destroy()
    return checked


def test_document_and_window_attention_match_dense(run_distributed):
    layouts = [(1, 1, False, ["p2p"]), (2, 1, True, ["p2p"])]
    assert run_distributed(2, _attention_masks_against_dense, layouts) == [12] * 2


def test_tp2_cp2_sequence_parallel_attention_matches_dense(run_distributed):
    layouts = [(2, 2, True, ["p2p", "all_gather", "a2a"])]
    assert run_distributed(4, _attention_masks_against_dense, layouts) == [18] * 4


# ----------------------------------------------------------------------------- GPTModel, packed

DOCUMENTS = (5, 7, 4)   # lengths of the documents packed into one sample of S = 16 tokens


@pytest.mark.parametrize("variant", [
    dict(),                                                                   # explicit, learned
    dict(hidden_size=32, num_attention_heads=2, position_embedding_type="rope",
         window_size=(2, 0)),                                                 # flash, rope, window
])
def test_packed_documents_equal_separate_documents(variant):
    from tpfuse.models import GPTModel, TransformerConfig

    config = TransformerConfig(**{**dict(num_layers=2, hidden_size=16, num_attention_heads=4,
                                         seq_length=S, vocab_size=61, hidden_dropout=0.0,
                                         attention_dropout=0.0, seed=5), **variant})
    model = GPTModel(config)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 61, (1, S), generator=gen) for _ in range(2))
    ids = torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS))[None]
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    packed = model(tokens, positions, labels=labels, document_ids=ids)         # (1, S)
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    separate, start = [], 0
    for n in DOCUMENTS:
        alone = model(tokens[:, start:start + n], labels=labels[:, start:start + n])
        alone.sum().backward()                                               # grads accumulate
        separate.append(alone)
        start += n
    assert_close_fp32(packed.detach(), torch.cat(separate, dim=1).detach(), "per-token losses")
    for name, param in model.named_parameters():
        assert_close_fp32(packed_grads[name], param.grad, f"d{name}")


# ----------------------------------------------------------------------------- batch and loss

def _batch_and_loss_on_cp_ranks():
    from tpfuse.parallel.state import ParallelState
    from tpfuse.training.context_parallel import get_batch_on_this_cp_rank, sequence_mean_loss

    state = ParallelState.initialize(cp=2)
    try:
        batch = {"tokens": torch.arange(B * S).view(B, S), "loss_mask": torch.ones(B, S),
                 "position_ids": torch.arange(S).expand(B, S), "note": "kept"}
        local = get_batch_on_this_cp_rank(batch, state)
        expected_tokens = torch.cat([batch["tokens"][:, c * 4:(c + 1) * 4] for c in
                                     (state.cp_rank, 3 - state.cp_rank)], dim=1)
        assert torch.equal(local["tokens"], expected_tokens) and local["note"] == "kept"
        try:
            get_batch_on_this_cp_rank({**batch, "attention_mask": torch.ones(B, 1, S, S)}, state)
            raise AssertionError("a dense attention_mask must be refused")
        except ValueError as error:
            assert "attention_mask" in str(error)
        losses, mask = seeded_randn(7, B, S).abs(), (seeded_randn(8, B, S) > 0).float()
        mine = split_sequence(losses, 2, state.cp_rank, dim=1).clone().requires_grad_()
        loss, reported = sequence_mean_loss(mine, split_sequence(mask, 2, state.cp_rank, 1),
                                            state)
        loss.backward()
        full_mean = (losses * mask).sum() / mask.sum()
        assert_close_fp32(reported, full_mean, "reported loss")
        # d loss / d local losses = cp · mask / (whole sequence's count): averaged over dp·cp
        # ranks later, that is the single process's d mean / d losses
        assert_close_fp32(mine.grad, 2 * split_sequence(mask, 2, state.cp_rank, 1) / mask.sum(),
                          "loss gradient")
    finally:
        state.destroy()
    return True


def test_batch_split_and_sequence_mean_loss(run_distributed):
    assert run_distributed(2, _batch_and_loss_on_cp_ranks) == [True, True]


# ----------------------------------------------------------------------------- bad settings

TRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
               "--seq-length", "12", "--max-position-embeddings", "12", "--vocab-size", "63",
               "--mock-data", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
               "--hidden-dropout", "0.0", "--no-progress-bar", "--no-layout-table"]
BAD_SETTINGS = [  # (flags, what the message names)
    (["--context-parallel-size", "2", "--attention-dropout", "0.0", "--seq-length", "10"],
     "seq_length=10 is not divisible by 2 × context_parallel_size (2) = 4"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.0", "--tensor-model-parallel-size",
      "2", "--sequence-parallel"], "seq_length=12 is not divisible by 2 × context_parallel_size (2)"
                                   " × tensor_model_parallel_size (2) (sequence_parallel=True) = 8"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.0", "--num-query-groups", "1",
      "--cp-comm-type", "a2a"], "cp_comm_type='a2a': query groups (kv heads) per tensor-parallel "
                                "rank = 1 is not divisible by context_parallel_size=2"),
    (["--context-parallel-size", "3", "--attention-dropout", "0.0"],
     "world size 2 is not divisible by tensor_model_parallel_size (1) × "
     "pipeline_model_parallel_size (1) × context_parallel_size (3)"),
]


def _pretrain_errors(settings):
    """Every setting through ``pretrain`` on this rank: the ValueError's message (None if none)."""
    return [pretrain_error(TRAIN_FLAGS + flags) for flags, _ in settings]


def test_bad_context_parallel_settings_fail_on_every_rank_before_any_collective(run_distributed):
    """Each rank raises by itself (a rank blocked in a collective would time the job out)."""
    for messages in run_distributed(2, _pretrain_errors, BAD_SETTINGS, timeout_s=120):
        for message, (flags, named) in zip(messages, BAD_SETTINGS):
            assert message is not None and named in message, (flags, message)


def _cached_attention_error():
    from tpfuse.inference import InferenceContext
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers import ParallelAttention

    state = ParallelState.initialize(cp=2)
    try:
        module = ParallelAttention(16, 4, state=state)
        module(seeded_randn(1, S // 2, B, 16), inference_context=InferenceContext(B, S))
    except ValueError as error:
        return str(error)
    finally:
        state.destroy()
    return None


def test_kv_cache_refused_under_context_parallelism(run_distributed):
    """Generation's KV cache holds whole sequences: refused at cp = 2, on each rank by itself."""
    for message in run_distributed(2, _cached_attention_error):
        assert message and "inference_context with context_parallel_size=2" in message, message
