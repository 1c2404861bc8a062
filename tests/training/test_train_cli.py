"""tpfuse-train end to end: Megatron's defaults on one process, a tiny run on 2 local processes, a
bad flag, a failing rank, the stdlib-demo preset."""
import json
import os
import subprocess
import sys


import pytest

from tpfuse.training import arguments, presets

TINY = ["--vocab-size", "64", "--lr", "1e-3","--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "3", "--lr-warmup-iters", "1",
        "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "1",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "1", "--no-sequence-parallel"]


def _train(args, tmp_path, timeout=300):
    env = dict(os.environ, TPFUSE_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "tpfuse.training.launcher", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_two_process_run_logs_metrics_and_saves(tmp_path):
    metrics = tmp_path / "m.jsonl"
    done = _train(["--nproc-per-node", "2", *TINY, "--mock-data", "--metrics-file", str(metrics),
                   "--save", str(tmp_path / "ckpt")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "R1   0   1   0" in done.stdout  # the layout table: rank 1 = tp0 pp1 dp0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(r["global_batch_size"] == 8 for r in train)
    assert [r["consumed_samples"] for r in train] == [8, 16, 24]
    assert any("valid_loss" in r for r in records)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    # A failing rank ends the job: rank 1's checkpoint file is gone, so rank 1 fails while rank 0
    # resumes and waits on it in the pipeline; the launcher must stop rank 0 instead of hanging.
    os.remove(tmp_path / "ckpt" / "iter_0000003" / "rank_00001.pt")
    failed = _train(["--nproc-per-node", "2", *TINY, "--mock-data", "--train-iters", "6",
                     "--load", str(tmp_path / "ckpt")], tmp_path, timeout=240)
    assert failed.returncode != 0
    assert "rank_00001.pt is missing" in failed.stderr
    assert "exited with code 1; stopping the other ranks" in failed.stderr
    # one traceback for the job: the first failure's (rank 1), not one per rank
    assert failed.stderr.count("Traceback (most recent call last)") == 1
    assert "first failure: rank 1" in failed.stderr


def test_bad_flag_is_one_clear_line(tmp_path):
    done = _train(["--nproc-per-node", "2", *TINY, "--mock-data", "--lr-warmup-iters", "9"],
                  tmp_path)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    # said by the launcher, before any rank started (no rank's report, no launch line)
    assert len(errors) == 1 and errors[0].startswith("tpfuse-train: error:")
    assert "--lr-warmup-iters (9)" in errors[0] and "rank" not in done.stderr


@pytest.mark.parametrize("rank, lines", [("0", 1), ("1", 0)])
def test_a_rank_started_without_the_launcher_says_a_bad_flag_once(capsys, monkeypatch, rank,
                                                                  lines):
    """``torchrun -m tpfuse.pretrain_gpt`` with a bad flag: rank 0 says it, the others exit 2
    silently (one line per job, not one per rank)."""
    from tpfuse.pretrain_gpt import main

    monkeypatch.setenv("RANK", rank)
    assert main([*TINY, "--mock-data", "--lr-warmup-iters", "9"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == lines
    assert all("--lr-warmup-iters (9)" in line for line in errors)


def test_preset_is_the_default_job_and_flags_override_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFUSE_CACHE", str(tmp_path))
    argv, nproc, preset = presets.launcher_plan([], None)   # plain `tpfuse-train`
    assert argv == ["--preset", "stdlib-demo"] and nproc == 8 and preset is presets.STDLIB_DEMO
    from tpfuse.data.indexed import IndexedDataset

    corpus = IndexedDataset(str(tmp_path / "stdlib_byte"), vocab_size=257)
    assert len(corpus) > 100  # hundreds of stdlib modules, one document each
    assert presets.launcher_plan(["--preset", "stdlib-demo"], 2)[1] == 2
    assert presets.launcher_plan(["--mock-data"], None)[1] == 1   # torchrun's default
    config, args = arguments.parse_args(["--preset", "stdlib-demo", "--train-iters", "27",
                                         "--tensor-model-parallel-size", "1"])
    assert args.data.data_path == [str(tmp_path / "stdlib_byte")]     # the preset's data
    assert (args.training.train_iters, config.tensor_model_parallel_size,
            config.num_layers) == (27, 1, 8)
    assert config.vocab_size == 257 and args.tokenizer.name == "byte"
    assert args.scheduler.lr == presets.STDLIB_DEMO.flags["lr"]
    from tpfuse.training.sample_args import sampling_kwargs

    # the demo's sample is drawn, seeded (greedy decoding of it repeats spaces)
    assert sampling_kwargs(args.sample) == {"temperature": 0.8, "top_k": 10, "top_p": 1.0, "seed": 1234}


def test_preset_interleaving_yields_to_a_layout_without_room_for_it(capsys):
    """stdlib-demo interleaves (2 layers per virtual stage at pp 2); a command line that sets
    another pipeline layout but not that flag runs without interleaving (with a note) instead of
    failing on a setting it never gave; given explicitly, the flag is validated as usual."""
    def vpp(*flags):
        config, _ = arguments.parse_args(["--preset", "stdlib-demo", "--mock-data", *flags])
        return config.virtual_pipeline_model_parallel_size

    assert vpp() == 2                                           # 8 layers / pp 2 / 2
    assert vpp("--num-layers", "12") == 3                       # still fits: kept
    capsys.readouterr()
    assert vpp("--pipeline-model-parallel-size", "1", "--num-layers", "12") is None
    assert vpp("--num-layers", "6") is None                     # 3 layers per stage
    assert vpp("--num-virtual-stages-per-pipeline-rank", "4") == 4
    notes = capsys.readouterr().out.splitlines()
    note = "preset stdlib-demo: its --num-layers-per-virtual-pipeline-stage 2 does not fit"
    assert len(notes) == 3 and all(n.startswith(note) for n in notes)
    assert "--pipeline-model-parallel-size 1 with --num-layers 12" in notes[0]
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=6 needs "
                                         "pipeline_model_parallel_size > 1"):
        vpp("--pipeline-model-parallel-size", "1", "--num-layers", "12",
            "--num-layers-per-virtual-pipeline-stage", "2")
