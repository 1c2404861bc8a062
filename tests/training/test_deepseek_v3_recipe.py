"""docs/training.md's DeepSeek-V3-style command runs as written: its flags (the block under the
section's heading), on its --nproc-per-node ranks through the pool, for 3 iterations. Reference:
the same flags in one process — before any update the layouts compute the same function of the
same batch, so the first loss agrees within the fp32 band of the invariance test (1e-5), and
both runs train (the loss falls)."""
import os
import re
import shlex

from support.pretrain_run import train_losses

import pytest

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "training.md")
SECTION = "## A DeepSeek-V3-style model"
SHORT = ["--train-iters", "3", "--lr-warmup-iters", "0", "--log-interval", "1",
         "--eval-iters", "0", "--no-progress-bar", "--no-layout-table"]


def documented_command() -> tuple[int, list[str]]:
    """(ranks, trainer flags) of the section's bash block."""
    text = open(DOC).read()
    block = re.search(r"```bash\n(.*?)```", text[text.index(SECTION):], re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:2] == ["tpfuse-train", "--nproc-per-node"], words[:2]
    return int(words[2]), words[3:]


def test_the_documented_deepseek_v3_command_trains_at_its_layout_and_in_one_process(
        run_distributed):
    ranks, flags = documented_command()
    parallel = {"--tensor-model-parallel-size", "--expert-model-parallel-size"}
    single = [f for i, f in enumerate(flags) if f not in parallel | {"--sequence-parallel"}
              and flags[i - 1] not in parallel]
    losses = train_losses(run_distributed, ranks, flags + SHORT)
    reference = train_losses(run_distributed, 1, single + SHORT)
    assert len(losses) == len(reference) == 3
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)
    assert losses[-1] < losses[0] and reference[-1] < reference[0]
