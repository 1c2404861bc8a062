"""The trainer's typed settings: a misspelled setting fails where it is written, every validation
error names the flag, the parser and the dataclasses are one source (same names, flags, defaults,
groups), and callbacks receive settings as bound keywords."""
import dataclasses
import subprocess
import sys

import pytest

from tpfuse.models.config import config_fields
from tpfuse.training import arguments, presets
from tpfuse.training.pretrain import bind_settings
from tpfuse.training.settings import (GROUPS, CheckpointSettings, DataSettings,
                                      OptimizerSettings, SchedulerSettings, TrainerSettings,
                                      TrainingSettings, field_owners)
from tpfuse.training.settings_fields import default_of, flag_of

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "6", "--lr", "3e-5",
        "--mock-data", "--vocab-size", "128"]


def _minimal(**groups):
    base = dict(training=TrainingSettings(micro_batch_size=2, train_iters=4),
                scheduler=SchedulerSettings(lr=1e-3), data=DataSettings(mock_data=True))
    return TrainerSettings(**{**base, **groups})


# ---------------------------------------------------------------- misspelled settings
def test_a_misspelled_field_fails_at_construction():
    with pytest.raises(TypeError, match="weight_decai"):
        OptimizerSettings(weight_decai=0.1)
    with pytest.raises(ValueError, match=r"unknown setting 'lrr' \(--lrr\); did you mean --lr\?"):
        TrainerSettings.from_values({"lrr": 1e-3, "micro_batch_size": 2, "train_iters": 4,
                                     "mock_data": True})
    settings = _minimal()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.optimizer.weight_decai = 0.1          # no silent new attribute
    with pytest.raises(TypeError, match="optimizer must be OptimizerSettings, got SchedulerSettings"):
        _minimal(optimizer=SchedulerSettings(lr=1.0))


def test_unknown_names_in_defaults_and_presets_are_refused():
    with pytest.raises(ValueError, match="args_defaults: unknown setting 'micro_batch'.*"
                                         "--micro-batch-size"):
        arguments.parse_args(TINY, defaults={"micro_batch": 4})
    known = {**field_owners(), **{f.name: "model" for f in config_fields()}}
    for preset in presets.PRESETS.values():
        assert set(preset.flags) <= set(known), preset.name


# ---------------------------------------------------------------- errors name the flag
@pytest.mark.parametrize("build, message", [
    (lambda: TrainingSettings(train_iters=4), "--micro-batch-size is required"),
    (lambda: TrainingSettings(micro_batch_size=0, train_iters=4),
     "--micro-batch-size must be >= 1, got 0"),
    (lambda: TrainingSettings(micro_batch_size="4", train_iters=4),
     "--micro-batch-size must be int, got '4'"),
    (lambda: SchedulerSettings(lr=float("nan")), "--lr must be a finite number"),
    (lambda: SchedulerSettings(lr=1e-3, lr_decay_style="cosinus"),
     "--lr-decay-style must be one of constant, linear, cosine"),
    (lambda: OptimizerSettings(adam_beta1=1.0), r"--adam-beta1 must be in \[0.0, 1.0\), got 1.0"),
    (lambda: CheckpointSettings(async_save=True), "--async-save needs --save DIR"),
    (lambda: DataSettings(), "no data: give --data-path"),
    (lambda: _minimal(training=TrainingSettings(micro_batch_size=2, train_samples=64),
                      scheduler=SchedulerSettings(lr=1e-3, lr_decay_iters=8)),
     r"--lr-decay-iters \(8\) does not go with --train-samples"),
])
def test_validation_errors_name_the_flag(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_parse_errors_name_the_flag():
    at = TINY.index("--micro-batch-size")
    with pytest.raises(ValueError, match="--micro-batch-size must be >= 1, got 0"):
        arguments.parse_args(TINY[:at + 1] + ["0"] + TINY[at + 2:])


# ---------------------------------------------------------------- one source of truth
def _settings_actions():
    model = {f.name for f in config_fields()}
    parser = arguments.build_parser()
    return parser, {a.dest: a for a in parser._actions
                    if a.dest not in model and a.dest not in ("help", "preset")}


def test_parser_and_dataclasses_agree():
    parser, actions = _settings_actions()
    owners = field_owners()
    assert set(actions) == set(owners)                # every flag a field, every field a flag
    for cls in GROUPS.values():
        for f in dataclasses.fields(cls):
            action = actions[f.name]
            assert action.option_strings == [flag_of(f)]
            assert action.default == default_of(f), f.name
    titles = {group.title: {a.dest for a in group._group_actions}
              for group in parser._action_groups}
    for cls in GROUPS.values():                       # one argument group per settings group
        assert titles[cls.TITLE] == {f.name for f in dataclasses.fields(cls)}
    parsed = vars(parser.parse_args([]))              # parsed defaults build valid groups
    settings = TrainerSettings.from_values(
        {**{k: v for k, v in parsed.items() if k in owners}, "micro_batch_size": 2,
         "train_iters": 4, "lr": 1e-3, "mock_data": True})
    assert settings.values()["adam_beta2"] == 0.999


def test_parse_args_returns_the_groups():
    config, settings = arguments.parse_args(TINY + ["--manual-gc", "--save", "/tmp/x",
                                                    "--save-interval", "2"])
    assert isinstance(settings, TrainerSettings) and config.num_layers == 2
    assert settings.training.micro_batch_size == 2 and settings.scheduler.lr == 3e-5
    assert settings.gc.manual_gc and settings.checkpoint.save_interval == 2
    assert settings.tokenizer.name == "null:128"


def test_help_trainer_lists_the_groups():
    done = subprocess.run([sys.executable, "-m", "tpfuse.training.launcher", "--help-trainer"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for cls in GROUPS.values():
        assert f"\n{cls.TITLE}:\n" in done.stdout
    assert "--micro-batch-size" in done.stdout and "--no-manual-gc-eval" in done.stdout


# ---------------------------------------------------------------- explicit, not global
def test_callbacks_receive_settings_as_bound_keywords():
    settings, config = _minimal(), object()

    def forward_step(data_iterator, model, *, data, config):
        return data, config

    bound = bind_settings(forward_step, settings, config)
    assert bound("iterator", "model") == (settings.data, config)     # Megatron's two arguments

    def plain(data_iterator, model):
        return None

    assert bind_settings(plain, settings, config) is plain

    def wants_unknown(data_iterator, model, *, datta):
        return None

    with pytest.raises(ValueError, match="'datta', which pretrain cannot give"):
        bind_settings(wants_unknown, settings, config)


def test_no_global_settings_accessor():
    import tpfuse.pretrain_gpt as script
    import tpfuse.training.pretrain as trainer

    for module in (trainer, script):
        assert not hasattr(module, "get_args") and not hasattr(module, "_GLOBALS")


# ---------------------------------------------------------------- checkpoint folders
def test_load_and_save_that_would_silently_train_from_scratch_are_refused(tmp_path):
    (tmp_path / "weights.pt").write_bytes(b"x")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cases = [(dict(load=str(tmp_path / "weights.pt")), "--load .* is a file"),
             (dict(load=str(hf)), "--load .* is a HuggingFace model folder.*tpfuse-convert"),
             (dict(save=""), "--save is an empty string"),
             (dict(load="", finetune=True), "--load is an empty string"),
             (dict(save=str(tmp_path / "weights.pt")), "--save .* is a file")]
    for values, message in cases:
        with pytest.raises(ValueError, match=message):
            CheckpointSettings(**values)
    CheckpointSettings(load=str(tmp_path / "not-yet"), save=str(tmp_path / "not-yet"))


def test_a_negative_number_in_the_spaced_form_reaches_its_check():
    """``--lr -1e-3`` is the number -0.001 (refused by --lr's own check), not a missing value;
    the spaced form is joined into ``--flag=value`` for argparse."""
    with pytest.raises(ValueError, match=r"--lr must be in \[0.0, ∞\), got -0.001"):
        arguments.parse_args(TINY + ["--lr", "-1e-3"])
    assert arguments.join_negative_values(["--lr", "-1e-3", "--x", "-.5", "--y=-2", "-z"]) == \
        ["--lr=-1e-3", "--x=-.5", "--y=-2", "-z"]
