"""Multi-token prediction (``--mtp-num-layers``): the GPTModel's MTP losses and their gradients
against a dense float64 model written from the DeepSeek-V3 report (with Megatron-core's choices:
the embedding first in the concatenation, the tokens beyond the sequence id 0 and masked out, a
final norm per MTP layer, the shared output layer); the trainer's validation loss and generation
without MTP; the flags' parsing and the combinations refused at config validation."""
import pytest
import torch
import torch.nn.functional as F

from support.dense_reference import dense_norm, dense_transformer_layer
from support.pretrain_run import run_pretrain
from tpfuse.inference.generate import generate
from tpfuse.models import GPTModel
from tpfuse.models.cli import add_config_arguments, config_from_args
from tpfuse.models.config import TransformerConfig

SHAPE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
             vocab_size=50, seq_length=8, hidden_dropout=0.0, attention_dropout=0.0,
             position_embedding_type="rope", seed=11)
B, S = 3, 8


def _config(**overrides):
    return TransformerConfig(**{**SHAPE, **overrides})


def _batch():
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, SHAPE["vocab_size"], (B, S), generator=generator)
    labels = torch.randint(0, SHAPE["vocab_size"], (B, S), generator=generator)
    mask = (torch.rand(B, S, generator=generator) > 0.3).float()
    return ids, labels, mask


def _ahead(x, k):
    """x[:, i + k] at position i, 0 where i + k is past the sequence."""
    out = torch.zeros_like(x)
    out[:, :S - k] = x[:, k:]
    return out


def _masked_mean(losses, mask):
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def dense_mtp_model(p, config, ids, labels, mask):
    """(lm loss, [MTP loss of depth k]) of the model whose float64 masters are ``p``, per the
    report: h_0 = the decoder's normed output; at depth k the embedding of the token k ahead and
    h_{k-1}, each normed, concatenated (embedding first), projected 2h → h, a transformer layer,
    a final norm; its cross entropy against the label k ahead, over the tokens the mask k ahead
    keeps."""
    cfg = {name: getattr(config, name) for name in (
        "rotary_base", "position_embedding_type", "num_query_groups", "num_attention_heads",
        "layernorm_epsilon", "normalization", "activation")}
    vocab = config.vocab_size
    word = p["embedding.word_embeddings.weight"][:vocab]
    out = p["output_layer.weight"][:vocab] if "output_layer.weight" in p else word
    positions = torch.arange(S).expand(B, S)

    def layer(prefix, x):
        sub = {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}
        return dense_transformer_layer(sub, x, cfg, positions)

    def token_losses(h, targets):                                    # h (s, b, h) → (b, s)
        logits = (h @ out.t()).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1),
                               reduction="none").view(B, S)

    def norm(prefix, x):
        return dense_norm(p, prefix, x, config.normalization, config.layernorm_epsilon)

    x = word[ids].transpose(0, 1)                                     # (s, b, h)
    for i in range(config.num_layers):
        x = layer(f"layers.{i}.", x)
    h = norm("final_norm.", x)
    lm = _masked_mean(token_losses(h, labels), mask)
    mtp = []
    for k in range(1, config.mtp_num_layers + 1):
        prefix = f"mtp.layers.{k - 1}."
        e = word[_ahead(ids, k)].transpose(0, 1)
        x = torch.cat([norm(prefix + "enorm.", e), norm(prefix + "hnorm.", h)], dim=-1)
        x = layer(prefix + "transformer_layer.", x @ p[prefix + "eh_proj.weight"].t())
        h = norm(prefix + "final_layernorm.", x)
        mtp.append(_masked_mean(token_losses(h, _ahead(labels, k)), _ahead(mask, k)))
    return lm, mtp


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_mtp_losses_and_gradients_match_dense_reference(untied):
    """Two MTP depths (the shift applied twice), a loss mask with holes, factor 0.3: the recorded
    loss of each depth and every parameter's gradient of lm + 0.3/2 · Σ_k loss_k equal the
    float64 model's. fp32 against float64 through ~4 layers: a few float32 roundings of
    relative 6e-8 each, well inside assert_close's 1e-5 / 1e-5 (measured ~1e-7); a depth
    shifted by the wrong amount, a swapped concatenation or a lost MTP gradient moves them by
    1e-2 or more."""
    config = _config(mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
                     untie_embeddings_and_output_weights=untied)
    model = GPTModel(config).train()
    ids, labels, mask = _batch()
    per_token = model(ids, labels=labels, loss_mask=mask)
    lm = _masked_mean(per_token, mask)
    lm.backward()            # the MTP losses ride on h_0: backward_scale 1 (one micro-batch)

    masters = {name: param.detach().double().requires_grad_()
               for name, param in model.named_parameters()}
    dense_lm, dense_mtp = dense_mtp_model(masters, config, ids, labels, mask)
    (dense_lm + 0.3 / 2 * sum(dense_mtp)).backward()

    torch.testing.assert_close(lm.double(), dense_lm.detach(), rtol=1e-5, atol=1e-5)
    recorded = torch.stack([model.mtp.losses.values[k] for k in range(2)]).double()
    torch.testing.assert_close(recorded, torch.stack(dense_mtp).detach(), rtol=1e-5, atol=1e-5)
    assert recorded[0] != pytest.approx(recorded[1], rel=1e-3)        # two different depths
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.double(), masters[name].grad, rtol=1e-5,
                                   atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert masters["mtp.layers.1.eh_proj.weight"].grad.abs().sum() > 0


def test_mtp_weights_are_drawn_apart_from_the_main_model():
    """The main weights of an MTP model are those of the same config without MTP (their own
    seeds), and the MTP layer's weights differ from every decoder layer's."""
    with_mtp, without = GPTModel(_config(mtp_num_layers=1)), GPTModel(_config())
    plain = dict(without.named_parameters())
    for name, param in with_mtp.named_parameters():
        if not name.startswith("mtp."):
            assert torch.equal(param, plain[name]), name
    qkv = "self_attention.linear_qkv.weight"
    mtp_qkv = dict(with_mtp.named_parameters())[f"mtp.layers.0.transformer_layer.{qkv}"]
    assert not any(torch.allclose(mtp_qkv, plain[f"layers.{i}.{qkv}"]) for i in range(2))


def test_eval_and_generation_ignore_mtp():
    """In eval mode (the validation loss) the per-token loss is the lm loss and nothing is
    recorded; greedy generation gives the tokens of the same model without MTP."""
    with_mtp, without = GPTModel(_config(mtp_num_layers=1)).eval(), GPTModel(_config()).eval()
    ids, labels, mask = _batch()
    with torch.no_grad():
        assert torch.equal(with_mtp(ids, labels=labels, loss_mask=mask),
                           without(ids, labels=labels))
    assert with_mtp.mtp.losses.values == {}
    prompts = [[3, 1, 4], [1, 5]]
    assert generate(with_mtp, prompts, 4, greedy=True) == generate(without, prompts, 4,
                                                                   greedy=True)


TRAINER = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
           "--ffn-hidden-size", "32", "--seq-length", "8", "--vocab-size", "63",
           "--position-embedding-type", "rope", "--hidden-dropout", "0.0",
           "--attention-dropout", "0.0", "--seed", "7", "--mock-data", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "2", "--lr", "3e-3",
           "--eval-at-start", "--eval-interval", "2", "--eval-iters", "1",
           "--no-progress-bar", "--no-layout-table"]


def test_validation_loss_excludes_mtp(run_distributed):
    """The trainer's validation loss (at the start, before any step: same weights) and first
    training loss of an MTP run are those of the run without MTP (the lm loss alone, as
    Megatron reports them); the MTP gradient changes what follows (the second step's loss)."""
    with_mtp, = run_distributed(1, run_pretrain, TRAINER + ["--mtp-num-layers", "1"])
    without, = run_distributed(1, run_pretrain, TRAINER)
    assert with_mtp.valid_losses[0] == (0, pytest.approx(without.valid_losses[0][1], rel=1e-6))
    assert with_mtp.train_losses[0] == pytest.approx(without.train_losses[0], rel=1e-6)
    assert with_mtp.valid_losses[-1][1] != pytest.approx(without.valid_losses[-1][1], rel=1e-6)


def _parse(argv):
    import argparse

    parser = add_config_arguments(argparse.ArgumentParser())
    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
            "--seq-length", "8"]
    return config_from_args(parser.parse_args(base + argv))


def test_flags_and_megatron_defaults():
    config = _parse([])
    assert config.mtp_num_layers is None and config.mtp_loss_scaling_factor == 0.1
    config = _parse(["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"])
    assert config.mtp_num_layers == 2 and config.mtp_loss_scaling_factor == 0.3


@pytest.mark.parametrize("overrides, fragments", [
    (dict(mtp_num_layers=0), ["mtp_num_layers=0", "--mtp-num-layers"]),
    (dict(mtp_loss_scaling_factor=-1.0), ["--mtp-loss-scaling-factor"]),
    (dict(mtp_num_layers=1, pipeline_model_parallel_size=2,
          position_embedding_type="learned_absolute"),
     ["--mtp-num-layers", "pipeline_model_parallel_size=2", "--position-embedding-type rope"]),
])
def test_unsupported_settings_are_refused_at_validation(overrides, fragments):
    with pytest.raises(ValueError) as error:
        _config(**overrides)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_context_parallelism_is_accepted():
    """The token shift crosses the cp ranks' chunks (parallel/context_sequence.py; the trainer
    at cp 2 against one process: tests/test_invariance.py)."""
    config = _config(mtp_num_layers=1, context_parallel_size=2)
    assert config.mtp_num_layers == 1 and config.context_parallel_size == 2


def test_mtp_on_a_chunk_without_tokens_names_the_flag():
    model = GPTModel(_config(mtp_num_layers=1)).train()
    ids, labels, _ = _batch()
    hidden = torch.zeros(S, B, SHAPE["hidden_size"])
    model.pre_process = False             # a last stage given only the received activation
    model.set_input_tensor(hidden)
    with pytest.raises(ValueError, match="mtp_num_layers=1"):
        model(None, labels=labels)
