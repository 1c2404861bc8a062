"""``embedding_init_method_std``: the word and learned position embeddings are drawn
N(0, embedding_init_method_std²), every other weight (the untied output layer included) with
``init_method_std``, as Megatron's ``embedding_init_method``; None means init_method_std.

Tolerance: the sample std s of n iid N(0, σ²) draws has sd(s) ≈ σ / √(2n) (from
Var(s²) ≈ 2σ⁴/n), so with n = 512·64 = 32768 draws per table a relative error of 6/√(2n) ≈ 0.023
is six standard deviations."""
import argparse
import math

import pytest
import torch

from tpfuse.models import GPTModel, TransformerConfig
from tpfuse.models.cli import add_config_arguments, config_from_args

VOCAB, HIDDEN, POSITIONS = 512, 64, 512
DRAWS = VOCAB * HIDDEN
TOLERANCE = 6 / math.sqrt(2 * DRAWS)


def config(**overrides):
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=VOCAB,
                  make_vocab_size_divisible_by=1, seq_length=POSITIONS, seed=7,
                  untie_embeddings_and_output_weights=True)
    return TransformerConfig(**{**fields, **overrides})


def test_embeddings_are_drawn_with_the_embedding_std_and_the_output_layer_with_init_std():
    model = GPTModel(config(init_method_std=0.02, embedding_init_method_std=0.1))
    word = model.embedding.word_embeddings.weight.detach()
    position = model.embedding.position_embeddings.weight.detach()
    output = model.output_layer.weight.detach()
    assert word.numel() == position.numel() == output.numel() == DRAWS
    assert word.std().item() == pytest.approx(0.1, rel=TOLERANCE)
    assert position.std().item() == pytest.approx(0.1, rel=TOLERANCE)
    assert output.std().item() == pytest.approx(0.02, rel=TOLERANCE)
    # the same stream, only scaled: the embedding std multiplies the default draw
    default = GPTModel(config(init_method_std=0.02))
    assert torch.allclose(word, default.embedding.word_embeddings.weight.detach() * 5.0)
    assert torch.equal(output, default.output_layer.weight.detach())


def test_none_is_init_method_std():
    explicit = GPTModel(config(init_method_std=0.03, embedding_init_method_std=0.03))
    implicit = GPTModel(config(init_method_std=0.03))
    for name, tensor in implicit.state_dict().items():
        assert torch.equal(tensor, explicit.state_dict()[name]), name


def test_the_flag_is_megatrons_and_the_value_is_checked():
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--num-layers", "1", "--hidden-size", "8",
                              "--num-attention-heads", "2", "--seq-length", "4",
                              "--embedding-init-method-std", "0.006"])
    assert config_from_args(args).embedding_init_method_std == 0.006
    assert config_from_args(parser.parse_args(
        ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
         "--seq-length", "4"])).embedding_init_method_std is None
    with pytest.raises(ValueError, match="embedding_init_method_std=0.0 must be a finite"):
        config(embedding_init_method_std=0.0)


def test_the_trainer_takes_megatrons_flag():
    from tpfuse.training import arguments

    tiny = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "6", "--lr",
            "3e-5", "--mock-data", "--vocab-size", "128"]
    assert vars(arguments.build_parser().parse_args([]))["embedding_init_method_std"] is None
    config, _ = arguments.parse_args(tiny + ["--embedding-init-method-std", "0.006"])
    assert (config.embedding_init_method_std, config.init_method_std) == (0.006, 0.02)
    with pytest.raises(ValueError, match="--embedding-init-method-std must be a finite number"):
        arguments.parse_args(tiny + ["--embedding-init-method-std", "inf"])
