"""benchmarks/gpu_session.sh --dry-run: the GPU session's script run whole on the CPU, so it cannot
rot between device loans. Every check runs at tiny shapes (the trainer and its plain-PyTorch peer
on the same job, the 2-process tp=2 and pp=2 runs, the kernel checks through Triton's interpreter
with one case per family, generation, context-parallel attention). Checked: summary.json's schema
and order, the device limits' total, every check ok with its key figures, the peer's and the
2-process runs' loss curves against the trainer's, the markdown table."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_session.sh")
ORDER = ["train_tpfuse", "train_peer", "train_tp2", "train_pp2", "gpu_check", "attention_masks",
         "moe", "generation", "context_parallel"]
DEVICE_SECONDS = 540          # one 10-minute command, less the machine's start and transfers
# same initial weights, same batches, fp32 on the CPU: only summation order can differ, ≈ a few
# fp32 roundings (1.2e-7 each) of a loss ≈ 5
LOSS_TOLERANCE = 1e-5
# gpu_check's dry run: the first case of each family (matmul, flash_attention, layer_norm,
# rms_norm, bias_dropout_add, cross_entropy), each validated
GPU_CHECK_CASES = 6
# the verdict lines of the other kernel checks' dry runs: attention's 7 masks (causal also with the
# deterministic backward) and the decode step; MoE's grouped GEMM fwd / dgrad / wgrad, its 4
# timing rows and the two permutes; context parallelism's 3 cp sizes × 4 masks
VERDICTS = {"attention_masks": 9, "moe": 9, "context_parallel": 12}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_session")
    # the interpreter running the tests, not whichever python3 is first on PATH
    done = subprocess.run(["bash", SCRIPT, "--dry-run", str(out)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHON": sys.executable})
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
        assert row["status"] == "ok", row
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
    for pair in ("train_tp2", "train_pp2"):
        figures = rows[pair]["figures"]
        assert figures["iterations"] == 3 and figures["losses_match"] is True
        assert figures["largest_loss_difference_to_1_process"] <= LOSS_TOLERANCE * max(ours["losses"])
    assert rows["generation"]["figures"]["cache_matches_recompute"] is True
    assert rows["generation"]["figures"]["tokens_per_s"] > 0


def test_kernel_checks_ran_every_case_and_passed(summary):
    rows = {row["name"]: row for row in summary[0]["checks"]}
    statuses = rows["gpu_check"]["figures"]["statuses"]
    assert statuses["PASS"] == GPU_CHECK_CASES
    assert not {"FAIL", "ERROR", "SKIPPED"} & set(statuses), statuses
    assert len(rows["gpu_check"]["figures"]["ratios"]) >= GPU_CHECK_CASES   # each one timed
    for name, count in VERDICTS.items():
        figures = rows[name]["figures"]
        assert (figures["checks_passed"], figures["checks_failed"]) == (count, 0), figures


def test_markdown_table_has_a_row_per_check(summary):
    table = summary[1]
    assert "| check | status | seconds (limit) | key figures |" in table
    for name in ORDER:
        assert f"| {name} |" in table
