"""Work a forward does once, not per layer or per stage.

- The rope cos/sin tables are computed once per GPTModel forward (not once per layer), and the
  model's output is the same as with every layer computing its own (the tables depend only on the
  positions, so passing them down is exact).
- The main job's ``forward_step`` on a middle pipeline chunk (neither embedding nor loss) reads
  no batch from its iterator; with --reset-position-ids and rope it reads the batch for the
  position ids only; the first / last chunks copy only what they use.
"""
import pytest
import torch

from tpfuse.models import GPTModel, TransformerConfig


def _config(**overrides):
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=50,
                hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                seed=4)
    return TransformerConfig(**{**base, **overrides})


def test_rotary_tables_once_per_forward_and_same_result(monkeypatch):
    import tpfuse.models.gpt as gpt_module
    import tpfuse.tp_layers.attention as attention_module
    from tpfuse.tp_layers.rope import rotary_cos_sin

    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return rotary_cos_sin(*args, **kwargs)

    model = GPTModel(_config())
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).flip(0).expand(2, 8)      # not the default: must reach every layer
    monkeypatch.setattr(gpt_module, "rotary_cos_sin", counting)
    monkeypatch.setattr(attention_module, "rotary_cos_sin", counting)
    shared = model(ids, positions)
    assert len(calls) == 1
    # every layer computing its own tables from the same positions gives the same logits
    hidden = model.embedding(ids, positions)
    for layer in model.layers:
        hidden = layer(hidden, positions)
    own = model.output_layer(model.final_norm(hidden)).transpose(0, 1)
    assert len(calls) == 1 + len(model.layers)
    assert torch.equal(shared, own)


class _Iterator:
    def __init__(self, batch):
        self.batch, self.reads = batch, 0

    def __next__(self):
        self.reads += 1
        return self.batch


def _batch():
    gen = torch.Generator().manual_seed(1)
    return {"tokens": torch.randint(0, 50, (2, 8), generator=gen),
            "labels": torch.randint(0, 50, (2, 8), generator=gen),
            "loss_mask": torch.ones(2, 8), "position_ids": torch.arange(8).expand(2, 8)}


@pytest.mark.parametrize("reset_position_ids, reads", [(False, 0), (True, 1)])
def test_middle_stage_reads_no_batch(monkeypatch, reset_position_ids, reads):
    from functools import partial

    from tpfuse import pretrain_gpt
    from tpfuse.training.settings import DataSettings

    config = _config()
    data = DataSettings(mock_data=True, reset_position_ids=reset_position_ids,
                        reset_attention_mask=False)
    forward_step = partial(pretrain_gpt.forward_step, data=data, config=config)  # as pretrain binds
    middle = GPTModel(config, pre_process=False, post_process=False)
    hidden = torch.randn(8, 2, 32)
    middle.set_input_tensor(hidden)
    iterator = _Iterator(_batch())
    output, _ = forward_step(iterator, middle)
    assert iterator.reads == reads
    middle.set_input_tensor(hidden)
    assert torch.equal(output, middle(None, _batch()["position_ids"]))   # default positions

    last = GPTModel(config, pre_process=False, post_process=True)
    last.set_input_tensor(hidden)
    iterator = _Iterator(_batch())
    output, loss_func = forward_step(iterator, last)
    assert iterator.reads == 1 and output.shape == (2, 8)
    loss, logs = loss_func(output)
    assert torch.equal(loss, output.mean()) and "lm loss" in logs
