"""``--ckpt-format torch_dist`` (checkpoint/torch_dist_format.py) beyond the loss invariance of
tests/test_invariance.py: checkpoints megatron-core 0.16 wrote load into the trainer with
megatron-core's logits, and one Megatron-LM's training wrote (megatron-core's own distributed
optimizer and scheduler) resumes with megatron-core's losses; a job killed during a torch_dist save resumes from the previous
checkpoint with the uninterrupted run's losses; tpfuse-convert goes between the two formats
and back; bad input fails clearly, before any collective, and loses nothing saved."""
import json
import os
import signal
import time

import pytest
import torch

from support.pretrain_run import logged_train_losses, pretrain_error, run_pretrain
from tpfuse.checkpoint import format as ckpt
from tpfuse.checkpoint import torch_dist_format as tdf

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "megatron_core_checkpoints")
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
        "--no-progress-bar", "--no-layout-table"]
TORCH_DIST = ["--ckpt-format", "torch_dist"]


# ------------------------------------------------------------------ megatron-core's checkpoints
def fixture_flags(case: str) -> list:
    """tpfuse-train's flags for the model of a fixture (its config.json: megatron-core's
    TransformerConfig fields and GPTModel arguments; core's ffn default 4h, untied unless
    asked, learned absolute positions, LayerNorm)."""
    with open(os.path.join(FIXTURES, case, "config.json")) as handle:
        recorded = json.load(handle)
    fields = recorded["config"]
    flags = ["--num-layers", str(fields["num_layers"]), "--hidden-size", str(fields["hidden_size"]),
             "--num-attention-heads", str(fields["num_attention_heads"]),
             "--ffn-hidden-size", str(4 * fields["hidden_size"]),
             "--seq-length", str(recorded["max_sequence_length"]),
             "--max-position-embeddings", str(recorded["max_sequence_length"]),
             # the null tokenizer adds EOD: --vocab-size V - 1 gives the model V token ids
             "--vocab-size", str(recorded["vocab_size"] - 1), "--hidden-dropout", "0",
             "--attention-dropout", "0", "--position-embedding-type", "learned_absolute"]
    if not recorded["model"].get("share_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    if fields.get("activation") == "silu" and fields.get("gated_linear_unit"):
        flags.append("--swiglu")
    if fields.get("add_bias_linear") is False:
        flags.append("--disable-bias-linear")
    if fields.get("num_moe_experts"):
        flags += ["--num-experts", str(fields["num_moe_experts"]),
                  "--moe-router-topk", str(fields["moe_router_topk"]),
                  "--moe-ffn-hidden-size", str(fields["moe_ffn_hidden_size"]),
                  "--moe-token-dispatcher-type", fields["moe_token_dispatcher_type"],
                  "--moe-aux-loss-coeff", "0"]
        if fields.get("moe_grouped_gemm"):
            flags.append("--moe-grouped-gemm")
    return flags


def trainer_logits_after_load(argv, tokens, positions):
    """pretrain(argv) on this rank; its model's logits (b, s, padded V, gathered over tp) on
    the probe, computed in the first forward step (before any optimizer step changes it)."""
    from tpfuse import pretrain_gpt
    from tpfuse.parallel.state import get_default_state

    captured = []

    def forward_step(data_iterator, model, *, data=None, config=None):
        if not captured and model.post_process:
            with torch.no_grad():
                model.eval()
                logits = model(tokens, positions)                        # (b, s, V/tp)
                model.train()
            state = get_default_state()
            parts = [torch.empty_like(logits) for _ in range(state.tp_size)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=state.tp_group)
            captured.append(torch.cat(parts, dim=-1))
        return pretrain_gpt.forward_step(data_iterator, model, data=data, config=config)

    run_pretrain(argv, forward_step=forward_step)
    return captured[0] if captured else None


@pytest.mark.parametrize("case", ["dense", "swiglu", "moe", "moe_grouped"])
def test_megatron_core_checkpoint_loads_into_the_trainer_with_its_logits(run_distributed, case):
    """tpfuse-train --load of the folder megatron-core's dist_checkpointing.save wrote (tp 1,
    vocabulary unpadded: refitted to the trainer's 128 padded rows) at tp 2 (MoE with sequence
    parallelism): the first forward gives megatron-core's logits on its probe batch. Tolerance
    as tests/megatron_compat/test_dist_checkpointing_megatron_fixtures.py: fp32, the same
    weights, sums of length ≤ 128 ordered differently (K·eps ≈ 1e-5 relative on O(1) logits);
    a wrong key, shard or gate/up order moves them by ≥ 1e-2."""
    reference = torch.load(os.path.join(FIXTURES, case, "reference.pt"))
    sp = ["--sequence-parallel"] if case.startswith("moe") else []
    argv = fixture_flags(case) + sp + [
        "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
        "--eval-iters", "0", "--no-progress-bar", "--no-layout-table",
        "--load", os.path.join(FIXTURES, case, "checkpoint")]
    vocab = reference["logits"].shape[-1]
    for logits in run_distributed(2, trainer_logits_after_load, argv, reference["tokens"],
                                  reference["position_ids"]):
        torch.testing.assert_close(logits[..., :vocab], reference["logits"], rtol=1e-5,
                                   atol=1e-5)


# ------------------------------------------------------------------ kill -9 and SIGTERM
def test_killed_during_torch_dist_save_resumes_from_the_previous_checkpoint(run_distributed,
                                                                            tmp_path):
    """tpfuse-train with asynchronous torch_dist saves every iteration, killed (-9) at a random
    moment while a save is in flight, relaunched with the same command: the tracker names a
    complete checkpoint (every file matches the manifest), the relaunch resumes from it and
    the losses are the uninterrupted run's (same layout, RNG restored: rel 1e-6, as
    test_restart_safety)."""
    import random

    from test_restart_safety import _iterations, _kill_group, _launch, _wait_for

    iters = 8
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    command = ["--nproc-per-node", "1", *TINY, *TORCH_DIST, "--train-iters", str(iters),
               "--save", save, "--load", save, "--async-save", "--save-interval", "1",
               "--keep-last-checkpoints", "2", "--metrics-file", metrics]
    seed = random.randrange(10**6)
    job = _launch(command, tmp_path)
    try:
        _wait_for(lambda: ckpt.latest_iteration(save) is not None or job.poll() is not None)
        time.sleep(random.Random(seed).uniform(0.0, 1.0))
        assert job.poll() is None, (f"the job ended before the kill (rc {job.returncode}): "
                                    f"{job.stderr.read()[-3000:]}")
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
    finally:
        _kill_group(job)
    survived = tdf.verify_checkpoint(save)
    assert survived >= 1, f"seed {seed}"
    assert os.path.isfile(os.path.join(ckpt.iteration_dir(save, survived), "metadata.json"))
    done = _launch(command, tmp_path)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    assert not any(".staging-" in name for name in os.listdir(save))    # cleaned at start
    assert _iterations(metrics)[-1] == iters and _iterations(metrics)[:survived] == \
        list(range(1, survived + 1))
    with open(metrics) as handle:
        records = [r for r in map(json.loads, handle) if "memory_bytes" not in r]
    losses = {r["iteration"]: r["loss"] for r in records}            # the resumed run's last
    reference, = run_distributed(1, logged_train_losses, TINY + ["--train-iters", str(iters)])
    assert [losses[i] for i in range(1, iters + 1)] == pytest.approx(reference, rel=1e-6), \
        f"seed {seed}"


def test_sigterm_saves_a_torch_dist_checkpoint(run_distributed, tmp_path):
    from test_restart_safety import _iterations, _train_until_sigterm

    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    (reason, iterations), = run_distributed(
        1, _train_until_sigterm, TINY + TORCH_DIST + [
            "--train-iters", "100000", "--save", save, "--exit-signal-handler",
            "--metrics-file", metrics], metrics)
    assert reason == "SIGTERM received (--exit-signal-handler)"
    assert tdf.verify_checkpoint(save) == iterations[-1] == _iterations(metrics)[-1] < 100000
    assert os.path.isfile(os.path.join(ckpt.iteration_dir(save, iterations[-1]), ".metadata"))


# ------------------------------------------------------------------ bad input
def test_unknown_checkpoint_format_is_refused_at_parsing(capsys):
    from tpfuse.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "1", "--ckpt-format", "torch"])
    assert "--ckpt-format: invalid choice: 'torch'" in capsys.readouterr().err


def _digests(folder):
    return {name: open(os.path.join(folder, name), "rb").read()
            for name in sorted(os.listdir(folder))}


def test_incompatible_model_names_the_key_and_shapes(run_distributed, tmp_path):
    save = str(tmp_path / "ckpt")
    run_distributed(2, logged_train_losses, TINY + TORCH_DIST + ["--train-iters", "2",
                                                                 "--save", save])
    before = _digests(ckpt.iteration_dir(save, 2))
    wider = [("32" if flag == "16" and TINY[i - 1] == "--hidden-size" else flag)
             for i, flag in enumerate(TINY)]
    errors = run_distributed(2, pretrain_error, wider + TORCH_DIST + [
        "--train-iters", "4", "--load", save, "--save", save])
    for message in errors:            # every rank, raised before the collective read
        assert "does not fit this model: tensor 'embedding.word_embeddings.weight' has the " \
               "global shape (128, 16) there, this model's is (128, 32)" in message
    assert _digests(ckpt.iteration_dir(save, 2)) == before      # nothing saved is lost
    assert ckpt.latest_iteration(save) == 2


def test_truncated_distcp_shard_is_refused_on_every_rank(run_distributed, tmp_path):
    """One .distcp file cut short: every rank finds it against the manifest's size and hash and
    fails before any collective read; the folder is left as it was."""
    save = str(tmp_path / "ckpt")
    run_distributed(2, logged_train_losses, TINY + TORCH_DIST + ["--train-iters", "2",
                                                                 "--save", save])
    folder = ckpt.iteration_dir(save, 2)
    shard = os.path.join(folder, "__1_0.distcp")
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    before = _digests(folder)
    errors = run_distributed(2, pretrain_error, TINY + TORCH_DIST + [
        "--train-iters", "4", "--load", save, "--save", save])
    for message in errors:
        assert f"checkpoint file {shard} is corrupt: {os.path.getsize(shard)} bytes" in message
    assert _digests(folder) == before and ckpt.latest_iteration(save) == 2
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002"]


# ------------------------------------------------------------------ conversion
def test_conversion_round_trip_resumes_with_the_uninterrupted_losses(run_distributed, tmp_path):
    """4 iterations at dp 2 (per-rank format), tpfuse-convert to torch_dist, then back to the
    per-rank format: each converted checkpoint resumes (at tp 2, through its resharding) with
    the uninterrupted run's last 2 losses (rel 1e-5: only the order of fp32 sums differs), and
    the round trip gives back the same tensors exactly."""
    from tpfuse.checkpoint import reshard
    from tpfuse.checkpoint.reading import checkpoint_folder
    from tpfuse.convert.cli import main

    native, dist_dir, back = (str(tmp_path / name) for name in ("native", "dist", "back"))
    schedule = TINY + ["--lr-decay-iters", "6"]        # the same learning rates in every run
    reference = run_distributed(2, logged_train_losses, schedule + ["--train-iters", "6"])
    reference = next(r for r in reference if r is not None)
    run_distributed(2, logged_train_losses, schedule + ["--train-iters", "4", "--save", native])
    assert main(["--ckpt-convert-format", "torch_dist", "--load", native, "--save", dist_dir]) == 0
    assert main(["--ckpt-convert-format", "tpfuse", "--load", dist_dir, "--save", back]) == 0
    before = reshard.assemble_global_state(*checkpoint_folder(native))
    after = reshard.assemble_global_state(*checkpoint_folder(back))
    assert sorted(before) == sorted(after)
    for name, entry in before.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(after[name][key]), torch.as_tensor(value)), \
                (name, key)
    for converted in (dist_dir, back):
        resumed = run_distributed(2, logged_train_losses, schedule + [
            "--train-iters", "6", "--load", converted, "--tensor-model-parallel-size", "2"])
        resumed = next(r for r in resumed if r is not None)
        assert resumed == pytest.approx(reference[4:], rel=1e-5), converted


# ------------------------------------------------------------------ Megatron-LM's training checkpoint
TRAINED = os.path.join(FIXTURES, "dense_trained")
# the same model with tied embeddings, its gradient buffer saved in several buckets
TIED_BUCKETS = "dense_tied_buckets"
# dense_trained saved at tp 2: each tp rank's buckets hold its TP shards
TRAINED_TP2 = "dense_trained_tp2"


class FixedBatch(torch.utils.data.Dataset):
    """Sample i is row i mod b of the fixture's fixed batch (every global batch of b samples is
    that batch, as megatron-core trained on it)."""

    def __init__(self, tokens, labels, num_samples):
        self.tokens, self.labels, self.num_samples = tokens, labels, num_samples

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        row = index % self.tokens.shape[0]
        s = self.tokens.shape[1]
        return {"tokens": self.tokens[row], "labels": self.labels[row],
                "loss_mask": torch.ones(s), "position_ids": torch.arange(s)}


def fixed_batch_datasets(train_valid_test_num_samples, *, config, case="dense_trained"):
    reference = torch.load(os.path.join(FIXTURES, case, "reference.pt"))
    return FixedBatch(reference["tokens"], reference["labels"],
                      train_valid_test_num_samples[0]), None, None


def trained_flags(case="dense_trained") -> list:
    """tpfuse-train's flags of the run Megatron-LM's args in the fixture ``case`` record (its
    model and its training flags), resumed for the fixture's further steps."""
    folder = os.path.join(FIXTURES, case)
    with open(os.path.join(folder, "config.json")) as handle:
        recorded = json.load(handle)
    t = recorded["training"]
    schedule = ["--lr", str(t["lr"]), "--min-lr", str(t["min_lr"]),
                "--lr-decay-style", t["lr_decay_style"],
                "--lr-warmup-iters", str(t["lr_warmup_iters"]),
                "--lr-decay-iters", str(t["lr_decay_iters"]),
                "--weight-decay", str(t["weight_decay"]), "--clip-grad", str(t["clip_grad"]),
                "--adam-beta1", str(t["adam_beta1"]), "--adam-beta2", str(t["adam_beta2"]),
                "--adam-eps", str(t["adam_eps"])]
    resumed = recorded["iteration"] + len(torch.load(os.path.join(folder, "reference.pt"))[
        "resumed_losses"])
    return fixture_flags(case) + schedule + [
        "--micro-batch-size", str(recorded["global_batch_size"]),
        "--global-batch-size", str(recorded["global_batch_size"]),
        "--train-iters", str(resumed), "--mock-data", "--eval-iters", "0", "--log-interval", "1",
        "--no-progress-bar", "--no-layout-table", "--load", os.path.join(folder, "checkpoint")]


def run_pretrain_on_fixed_batch(argv):
    """This rank's TrainingResult of pretrain(argv) on the fixture's fixed batch."""
    import functools

    return run_pretrain(argv, datasets_provider=functools.partial(fixed_batch_datasets))


def resumed_run(argv, case="dense_trained"):
    """pretrain(argv) on the fixture ``case``'s fixed batch; (the logged losses, the iteration
    it resumed at, the lr, step and per-parameter optimizer state right after the load:
    {Megatron module name: {state: tensor}} of this rank's pieces, dp = 1, and where each
    piece lies in the checkpoint's global tensor: {name: (offsets, shape, global rows)})."""
    import functools

    from tpfuse.checkpoint import torch_dist_format
    from tpfuse.checkpoint.dist.gpt_layout import megatron_name

    captured = {}
    loading = torch_dist_format.load_any

    def load_and_capture(root, model, optimizer, scheduler, state, *rest):
        loaded = loading(root, model, optimizer, scheduler, state, *rest)
        names = {id(p): megatron_name(n) for chunk in model for n, p in chunk.named_parameters()}
        entries = optimizer.state_dict()["params"]
        sharded = torch_dist_format._model_sharded(model, torch_dist_format._load_templates(model))
        captured["pieces"] = {
            names[i]: (entry.global_offset[entry.prepend_axis_num:], entry.local_shape,
                       entry.global_shape[entry.prepend_axis_num])
            for i, (entry, _, _) in torch_dist_format._entries_by_param(model, sharded).items()}
        captured.update(iteration=loaded["iteration"], lr=scheduler.lr, states={
            names[id(p)]: {k: v.view(p.shape).clone() if k != "step" else v.clone()
                           for k, v in entries[i].items() if k not in ("start", "end")}
            for i, p in enumerate(optimizer.model_params) if entries[i] is not None})
        return loaded

    torch_dist_format.load_any = load_and_capture
    try:
        result = run_pretrain(argv, datasets_provider=functools.partial(fixed_batch_datasets,
                                                                          case=case))
    finally:
        torch_dist_format.load_any = loading
    return (result.train_losses if result.is_logger else None), captured


def expected_piece(full: torch.Tensor, piece) -> torch.Tensor:
    """The rank's piece (offsets, shape, global rows) of megatron-core's whole state ``full``
    (its vocabulary rows zero-padded to the model's global rows)."""
    offsets, shape, rows = piece
    full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])
    for axis, (offset, size) in enumerate(zip(offsets, shape)):
        full = full.narrow(axis, offset, size)
    return full


@pytest.mark.parametrize("case, tp", [("dense_trained", 1), ("dense_trained", 2),
                                      (TIED_BUCKETS, 1), (TIED_BUCKETS, 2),
                                      (TRAINED_TP2, 2), (TRAINED_TP2, 1)])
def test_megatron_lm_training_checkpoint_resumes_with_megatron_cores_losses(run_distributed,
                                                                            case, tp):
    """tpfuse-train --load of the checkpoint megatron-core's optimizer and scheduler wrote as
    Megatron-LM's training does (tests/support/write_megatron_core_fixtures.py: args, the
    distributed optimizer's dp_reshardable buckets, opt_param_scheduler; tp 1, or tp 2 with
    each tp rank's buckets holding its shards), here at tp 1 and tp 2 on the same fixed batch
    (dense_trained: untied, one bucket; dense_tied_buckets: tied embeddings, four buckets;
    dense_trained_tp2: dense_trained saved at tp 2, resumed in its layout and at tp 1, its
    ranks' buckets put together): it resumes at the saved iteration with
    megatron-core's lr for the next step, Adam's step, exp_avg, exp_avg_sq equal to
    megatron-core's (exactly: the same fp32 numbers, only cut by tp and padded by the
    vocabulary rows, whose moments are 0: each rank's pieces against megatron-core's whole,
    TP-gathered states), and the next 2 losses megatron-core took after the save.

    Tolerance of the losses: fp32 throughout, bit-identical weights and moments at the resume;
    tpfuse's kernels and megatron-core's torch ops (and tp = 2's split GEMMs with an all-reduce)
    order the sums of length ≤ 64 differently, ≈ K·eps(fp32) ≈ 1e-5 relative on the logits,
    carried through two Adam steps of lr ≈ 9e-3: rel 1e-5 on O(1) losses, as
    test_dist_checkpointing_optimizer. A lost moment or step moves the first resumed update by
    about lr per weight and the next loss by ≥ 1e-3 relative."""
    reference = torch.load(os.path.join(FIXTURES, case, "reference.pt"))
    argv = trained_flags(case) + ["--tensor-model-parallel-size", str(tp)]
    results = run_distributed(tp, resumed_run, argv, case)
    for _, captured in results:
        assert captured["iteration"] == 3
        assert captured["lr"] == pytest.approx(reference["lr_at_save"], rel=1e-12)
        assert captured["lr"] == pytest.approx(reference["resumed_lrs"][0], rel=1e-12)
        for name, expected in reference["optimizer_state"].items():
            state = captured["states"][name]
            assert float(state["step"]) == 3.0, name
            for key in ("exp_avg", "exp_avg_sq"):
                piece = expected_piece(expected[key], captured["pieces"][name])
                assert torch.equal(state[key], piece), (name, key)
    losses = next(losses for losses, _ in results if losses is not None)
    assert losses == pytest.approx(reference["resumed_losses"], rel=1e-5, abs=0)


def _bucket_state_or_refusal(metadata_entries: dict):
    """megatron_lm.BucketState of dense_tied_buckets' args with the index ``metadata_entries``
    (key → entry); the ValueError's text where it refuses."""
    import types

    from tpfuse.checkpoint import megatron_lm
    from tpfuse.checkpoint.dist import serialization

    folder = os.path.join(FIXTURES, TIED_BUCKETS, "checkpoint", "iter_0000003")
    args = serialization.load_common_state_dict(folder)["args"]
    try:
        return megatron_lm.BucketState(
            types.SimpleNamespace(state_dict_metadata=metadata_entries), args, folder)
    except ValueError as error:
        return str(error).replace(folder, "DIR")


def test_megatron_lm_bucket_layouts_are_read_or_refused_naming_the_setting():
    """dense_tied_buckets' index (megatron-core's --ddp-bucket-size 2000 over 2 layers of
    3280 parameters: a layer's parameters in two buckets) is read as 4 buckets whose sizes
    megatron-core's filling gives; what tpfuse cannot map is refused before any read, naming
    the setting that wrote it: bucket sizes megatron-core's filling does not give, a chained
    optimizer's keys (MoE's experts get an optimizer of their own), a second gradient buffer
    (a save at tp 2: the next test)."""
    import types

    from tpfuse.checkpoint.dist import torch_dist

    folder = os.path.join(FIXTURES, TIED_BUCKETS, "checkpoint", "iter_0000003")
    entries = dict(torch_dist.read_metadata(folder).state_dict_metadata)
    buckets = _bucket_state_or_refusal(entries)
    # by hand, megatron-core's rule on the parameters in reverse order (64-aligned starts, a
    # bucket closed at >= 2000): final norm, layer 1's fc2, fc1 (ends at 2304); its norm, qkv,
    # proj, norm, layer 0's fc2 (2496); its fc1, norm, qkv (2048); the rest and the embeddings
    assert [states["exp_avg"][1] for states in buckets.buckets] == \
        [(2304,), (2496,), (2048,), (1728,)]
    spread = {bucket for (key, _), (bucket, _, _) in buckets.layout.items()
              if key.endswith("layers.self_attention.linear_qkv.weight")}
    assert spread == {1, 2}
    resume = ("(resume without its optimizer state with --no-load-optim, or save it with "
              "--dist-ckpt-optim-fully-reshardable)")
    where = "checkpoint DIR: its optimizer state (Megatron's dp_reshardable layout)"
    chained = {("chained_0." + key if key.startswith("optimizer.") else key): entry
               for key, entry in entries.items()}
    assert _bucket_state_or_refusal(chained) == (
        f"{where} belongs to 1 chained optimizers (keys chained_<i>.optimizer.distributed...: "
        "megatron-core's separate optimizer of the MoE expert parameters, --num-experts); "
        f"tpfuse reads one optimizer's {resume}")
    grown = {key: types.SimpleNamespace(size=torch.Size([2305])) if ".bucket_idx_0." in key
             and hasattr(entry, "size") else entry for key, entry in entries.items()}
    refused = _bucket_state_or_refusal(grown)      # 2305: no parameter of the filling ends there
    assert refused.startswith(f"{where}: its bucket 0 holds 2305 elements, megatron-core's "
                              "layout of its parameters does not end a bucket there (") and \
        refused.endswith(" (resume without its optimizer state with --no-load-optim)"), refused
    first = next(key for key in entries if key.endswith(".bucket_idx_0.exp_avg"))
    two_buffers = dict(entries, **{first.replace("gbuf_idx_0", "gbuf_idx_1"): entries[first]})
    refused = _bucket_state_or_refusal(two_buffers)
    assert refused.startswith(f"{where} has 2 gradient buffers ") and \
        refused.endswith(f"(parameters of several dtypes); tpfuse reads one {resume}"), refused


def _parse_with_args(monkeypatch, **changed):
    """parse_args of dense_tied_buckets' run with its common.pt's args ``changed``: the
    ValueError's text (None where it parses); --no-load-optim must parse regardless."""
    from tpfuse.checkpoint.dist import serialization
    from tpfuse.training.arguments import parse_args

    folder = os.path.join(FIXTURES, TIED_BUCKETS, "checkpoint", "iter_0000003")
    common = serialization.load_common_state_dict(folder)
    vars(common["args"]).update(changed)
    monkeypatch.setattr(tdf, "megatron_lm_common", lambda load: common)
    argv = trained_flags(TIED_BUCKETS)
    parse_args(argv + ["--no-load-optim"])
    try:
        parse_args(argv)
    except ValueError as error:
        return str(error)
    return None


def test_megatron_lm_optimizer_saved_at_tp2_fails_at_parsing(monkeypatch):
    """dense_tied_buckets as if its args said tp 2 (its index has the buckets of one
    model-parallel rank, dp_group_idx_0, where a save at tp 2 has one per tp rank: see
    dense_trained_tp2, which resumes): one ValueError naming the flag, at argument parsing (no
    process group yet); --no-load-optim takes the weights without it."""
    root = os.path.join(FIXTURES, TIED_BUCKETS, "checkpoint")
    folder = os.path.join(root, "iter_0000003")
    assert _parse_with_args(monkeypatch, tensor_model_parallel_size=2) == (
        f"--load {root}: checkpoint {folder}: its optimizer state (Megatron's dp_reshardable "
        "layout) has the model-parallel groups [0] (dp_group_idx_<g>), not one per tp rank 0 "
        "to 1 of its --tensor-model-parallel-size 2 (resume without its optimizer state with "
        "--no-load-optim, or save it with --dist-ckpt-optim-fully-reshardable)")


def test_megatron_lm_optimizer_saved_at_pp2_fails_at_parsing(monkeypatch):
    """dense_tied_buckets as if its args said pp 2 (each pipeline stage's buckets hold its own
    layers, which tpfuse does not map): one ValueError naming the flags, at argument parsing;
    --no-load-optim takes the weights without it."""
    root = os.path.join(FIXTURES, TIED_BUCKETS, "checkpoint")
    folder = os.path.join(root, "iter_0000003")
    assert _parse_with_args(monkeypatch, pipeline_model_parallel_size=2) == (
        f"--load {root}: checkpoint {folder}: its optimizer state (Megatron's dp_reshardable "
        "layout) was saved at tp, pp = 1, 2 (--tensor-model-parallel-size, "
        "--pipeline-model-parallel-size: one bucket layout per model-parallel rank); tpfuse "
        "reads it saved at pp = 1 (resume without its optimizer state with --no-load-optim, "
        "or save it with --dist-ckpt-optim-fully-reshardable)")


def test_megatron_lm_checkpoint_with_another_model_shape_fails_at_parsing(tmp_path):
    """--hidden-size other than the checkpoint's args: one ValueError naming the flag and both
    values (Megatron's check_checkpoint_args), at argument parsing (no process group yet)."""
    from tpfuse.training.arguments import parse_args

    argv = trained_flags()
    argv[argv.index("--hidden-size") + 1] = "32"
    with pytest.raises(ValueError) as error:
        parse_args(argv)
    assert str(error.value) == (
        f"--load {os.path.join(TRAINED, 'checkpoint')}: --hidden-size 32 does not match the "
        "checkpoint's hidden_size 16 (Megatron's check_checkpoint_args): give --hidden-size 16, "
        "or --use-checkpoint-args to take the model's shape from the checkpoint")
    config, _ = parse_args(argv + ["--use-checkpoint-args"])
    assert (config.hidden_size, config.ffn_hidden_size, config.num_attention_heads) == (16, 64, 2)


def test_megatron_lm_checkpoint_scheduler_follows_megatrons_flags():
    """The checkpoint's lr schedule must equal this run's (megatron-core's _check_and_set)
    unless --override-opt_param-scheduler keeps this run's or
    --use-checkpoint-opt_param-scheduler takes the checkpoint's; both together are refused."""
    from tpfuse.training.arguments import parse_args

    argv = trained_flags()
    argv[argv.index("--lr-decay-iters") + 1] = "12"
    with pytest.raises(ValueError) as error:
        parse_args(argv)
    assert "the checkpoint's lr schedule has total number of iterations 10, this run's flags " \
           "give 12 (megatron-core's OptimizerParamScheduler check)" in str(error.value)
    parse_args(argv + ["--override-opt_param-scheduler"])
    parse_args(argv + ["--use-checkpoint-opt_param-scheduler"])
    with pytest.raises(ValueError, match="exclude each other"):
        parse_args(argv + ["--override-opt_param-scheduler",
                           "--use-checkpoint-opt_param-scheduler"])


def test_megatron_lm_checkpoint_scheduler_flags_pick_the_schedule(run_distributed):
    """Resumed with another --lr and --lr-decay-iters: --use-checkpoint-opt_param-scheduler
    gives megatron-core's lr at the resumed step and its next losses (rel 1e-5 as above);
    --override-opt_param-scheduler gives this run's cosine at step 3 of warm-up 1, decay 12:
    1e-3 + ½(1 + cos(π·2/11))·(5e-3 − 1e-3), with the saved position kept."""
    import math

    reference = torch.load(os.path.join(TRAINED, "reference.pt"))
    argv = trained_flags()
    argv[argv.index("--lr") + 1], argv[argv.index("--lr-decay-iters") + 1] = "5e-3", "12"
    (losses, captured), = run_distributed(1, resumed_run,
                                          argv + ["--use-checkpoint-opt_param-scheduler"])
    assert captured["lr"] == pytest.approx(reference["lr_at_save"], rel=1e-12)
    assert losses == pytest.approx(reference["resumed_losses"], rel=1e-5, abs=0)
    (_, captured), = run_distributed(1, resumed_run, argv + ["--override-opt_param-scheduler"])
    expected = 1e-3 + 0.5 * (1 + math.cos(math.pi * 2 / 11)) * (5e-3 - 1e-3)
    assert captured["iteration"] == 3
    assert captured["lr"] == pytest.approx(expected, rel=1e-12)


def test_megatron_lm_checkpoint_without_its_optimizer_state(run_distributed):
    """--no-load-optim: the weights and the iteration, a fresh optimizer and schedule (Megatron's):
    the first resumed loss is megatron-core's (the same weights; rel 1e-5 as above), the fresh
    schedule's lr(0) = 0 of the warm-up leaves the weights as they are, so the second loss
    equals the first exactly and misses megatron-core's second by far more than the tolerance
    (what the loaded optimizer state and schedule are for)."""
    reference = torch.load(os.path.join(TRAINED, "reference.pt"))
    result, = run_distributed(1, run_pretrain_on_fixed_batch,
                              trained_flags() + ["--no-load-optim"])
    assert result.iterations == [4, 5]
    first, second = result.train_losses
    assert first == pytest.approx(reference["resumed_losses"][0], rel=1e-5, abs=0)
    assert second == first
    assert abs(second - reference["resumed_losses"][1]) > 100 * 1e-5 * \
        reference["resumed_losses"][1]


class _NotAllowed:
    """A class a common.pt must not be able to build (a stand-in for any code an attacker's
    pickle would run)."""


def test_megatron_lm_common_is_read_with_weights_only(tmp_path):
    """The fixture's common.pt (Megatron-LM's args: an argparse.Namespace with megatron-core's
    AttnBackend enum, torch dtypes and signal.SIGTERM) reads with weights_only=True; a common.pt
    holding any other class is refused by torch's weights-only unpickler."""
    import pickle
    import signal

    from tpfuse.checkpoint.dist import serialization

    common = serialization.load_common_state_dict(os.path.join(TRAINED, "checkpoint",
                                                               "iter_0000003"))
    args = common["args"]
    assert (args.hidden_size, args.params_dtype, args.exit_signal) == \
        (16, torch.float32, signal.SIGTERM)
    assert type(args.attention_backend).__name__ == "AttnBackend"
    assert args.attention_backend.value == 5             # megatron-core's AttnBackend.auto
    torch.save({"args": _NotAllowed()}, tmp_path / "common.pt")
    with pytest.raises(pickle.UnpicklingError, match="_NotAllowed"):
        serialization.load_common_state_dict(str(tmp_path))


def _object_round_trip(folder, value):
    """``value`` saved as a ShardedObject and loaded back (one rank); the error text instead
    when the load refuses it."""
    from tpfuse.checkpoint.dist import serialization
    from tpfuse.checkpoint.dist.core import CheckpointingException
    from tpfuse.checkpoint.dist.mapping import ShardedObject

    os.makedirs(folder)
    serialization.save({"rng": ShardedObject("rng_state", value, (1,), (0,), 0)}, folder)
    try:
        return serialization.load({"rng": ShardedObject("rng_state", None, (1,), (0,), 0)},
                                  folder)["rng"]
    except CheckpointingException as error:
        return str(error)


def test_sharded_objects_are_read_with_weights_only(run_distributed, tmp_path):
    """A ShardedObject as Megatron-LM saves its rng_state (Python's random state, numpy's
    generator state with its ndarray, torch's ByteTensor) reads back equal under
    weights_only=True; an object holding another class is refused."""
    import random

    import numpy as np

    rng_state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state()}
    [back] = run_distributed(1, _object_round_trip, str(tmp_path / "rng"), rng_state)
    assert back["random_rng_state"] == rng_state["random_rng_state"]
    assert back["np_rng_state"][0] == "MT19937"
    assert np.array_equal(back["np_rng_state"][1], rng_state["np_rng_state"][1])
    assert back["np_rng_state"][2:] == rng_state["np_rng_state"][2:]
    assert torch.equal(back["torch_rng_state"], rng_state["torch_rng_state"])
    [refused] = run_distributed(1, _object_round_trip, str(tmp_path / "bad"), _NotAllowed())
    assert isinstance(refused, str) and "rng_state" in refused and "_NotAllowed" in refused, \
        refused


def _groups_alive_after_an_async_torch_dist_run(argv):
    import torch.distributed as dist

    from tpfuse.parallel import parallel_state

    before = len(dist.distributed_c10d._world.pg_map)
    run_pretrain(argv)
    parallel_state.destroy_model_parallel()
    return before, len(dist.distributed_c10d._world.pg_map)


def test_the_async_writers_group_ends_with_the_run(run_distributed, tmp_path):
    """--async-save with torch_dist writes through a gloo group of its own: destroyed after the
    last save is published, so a finished run leaves only the world it was given."""
    argv = TINY + TORCH_DIST + ["--train-iters", "2", "--save", str(tmp_path / "ckpt"),
                                "--async-save", "--save-interval", "1"]
    for before, after in run_distributed(2, _groups_alive_after_an_async_torch_dist_run, argv):
        assert after == before
