"""Starting the trainer imports only what every run needs: PyTorch's DTensor (FSDP2's parameters)
and torch.distributed.checkpoint (the torch_dist format) cost 0.8 s of each start, on every rank
and in every command, so they are imported by the code paths that use them (``fully_shard``, a
torch_dist read or write), not by ``import tpfuse.pretrain_gpt``."""
import subprocess
import sys

DEFERRED = ("torch.distributed.tensor", "torch.distributed.checkpoint")


def test_the_trainer_imports_without_dtensor_or_dcp(tmp_path):
    code = ("import sys, tpfuse.pretrain_gpt, tpfuse.training.launcher\n"
            f"print([m for m in {DEFERRED!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
