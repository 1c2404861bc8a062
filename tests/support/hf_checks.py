"""Checks the HF conversion tests share: transformers' own greedy continuation (the reference
tokens), a bit-identical round trip of model.safetensors, and an export that is refused in one
line naming the unsupported setting."""
import os

import torch
from safetensors.torch import load_file


def hf_greedy(model, prompts, steps) -> list:
    """transformers' greedy ``steps`` new tokens after each prompt (no early stop at eos)."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]


def assert_same_safetensors(first_dir, second_dir) -> None:
    """Both folders' model.safetensors hold the same names with bit-identical tensors of the
    same dtypes."""
    before = load_file(os.path.join(first_dir, "model.safetensors"))
    after = load_file(os.path.join(second_dir, "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def assert_export_refused(tmp_path, capsys, config, message: str) -> None:
    """``tpfuse-convert --to-hf`` of a checkpoint of ``config`` exits 2 with one stderr line
    containing ``message`` and writes no output folder."""
    from tpfuse.convert.cli import main
    from tpfuse.convert.tpfuse_io import single_process_model, write_checkpoint

    params = {name: torch.zeros(p.shape) for name, p in
              single_process_model(config).named_parameters()}
    write_checkpoint(str(tmp_path / "ckpt"), config, params, {})
    assert main(["--to-hf", "--load", str(tmp_path / "ckpt"), "--save",
                 str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not os.path.exists(tmp_path / "hf")
