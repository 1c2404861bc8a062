"""benchmarks/gpu_session.sh --dry-run: the GPU session's script run on the CPU, so it cannot rot
between device loans. The training checks (the trainer and its plain-PyTorch peer on the same
job) and generation run at tiny shapes; the kernel checks and the 2-process runs are listed as
skipped here (through the Triton interpreter they take minutes each: their dry runs are
``--cpu-dry-run`` of each script). Checked: summary.json's schema and order, the device limits'
total, the peer's loss curve against the trainer's, the markdown table."""
import json
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_session.sh")
ORDER = ["train_tpfuse", "train_peer", "train_tp2", "train_pp2", "gpu_check", "attention_masks",
         "moe", "generation", "context_parallel"]
RUN = {"train_tpfuse", "train_peer", "generation"}
DEVICE_SECONDS = 540          # one 10-minute command, less the machine's start and transfers
# same initial weights, same batches, fp32 on the CPU: only summation order can differ, ≈ a few
# fp32 roundings (1.2e-7 each) of a loss ≈ 5
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_session")
    done = subprocess.run(["bash", SCRIPT, "--dry-run", "--only", ",".join(sorted(RUN)), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "summary.json") as handle:
        return json.load(handle), (out / "summary.md").read_text(), sorted(os.listdir(out))


def test_every_check_in_priority_order_within_the_device_limit(summary):
    result, _, files = summary
    assert [row["name"] for row in result["checks"]] == ORDER
    assert result["dry_run"] is True
    assert result["limits_total_s"] == sum(row["limit_s"] for row in result["checks"])
    assert result["limits_total_s"] <= DEVICE_SECONDS
    for row in result["checks"]:
        assert set(row) >= {"name", "status", "seconds", "limit_s", "figures"}
        assert row["status"] == ("ok" if row["name"] in RUN else "skipped"), row
    assert {"summary.json", "summary.md", "logs.tar.gz"} <= set(files)


def test_training_figures_and_the_peer_follows_the_trainer(summary):
    rows = {row["name"]: row for row in summary[0]["checks"]}
    ours, peer = rows["train_tpfuse"]["figures"], rows["train_peer"]["figures"]
    for figures in (ours, peer):
        assert figures["iterations"] == 3
        assert figures["tokens_per_s"] > 0 and figures["mfu"] > 0
    assert len(ours["losses"]) == len(peer["losses"]) == 3
    assert peer["largest_loss_difference_to_tpfuse"] <= LOSS_TOLERANCE * max(ours["losses"])
    assert peer["tokens_per_s_ratio_tpfuse_to_peer"] > 0
    assert rows["generation"]["figures"]["cache_matches_recompute"] is True
    assert rows["generation"]["figures"]["tokens_per_s"] > 0


def test_markdown_table_has_a_row_per_check(summary):
    table = summary[1]
    assert "| check | status | seconds (limit) | key figures |" in table
    for name in ORDER:
        assert f"| {name} |" in table
