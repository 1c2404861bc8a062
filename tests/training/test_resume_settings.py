"""What a resumed run takes from the command line and what from the checkpoint: every optimizer
hyper-parameter (weight decay, Adam's betas and eps) given to the resumed run wins, as the lr
schedule's flags do; the checkpoint restores the moments, step, loss scale and position."""
import pytest

from support.pretrain_run import run_pretrain

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
        "--no-progress-bar", "--no-layout-table"]


def _groups_after_training(argv):
    """The optimizer's parameter groups (hyper-parameters) at the end of ``pretrain``."""
    from tpfuse.training import pretrain as trainer

    seen, original = {}, trainer._Run.train

    def train(run):
        result = original(run)
        seen["groups"] = [{k: group[k] for k in ("weight_decay", "betas", "eps")}
                          for group in run.optimizer.param_groups]
        seen["iteration"] = run.iteration
        return result

    trainer._Run.train = train
    try:
        run_pretrain(argv)
    finally:
        trainer._Run.train = original
    return seen


@pytest.mark.parametrize("distributed", [False, True])
def test_resumed_optimizer_hyper_parameters_come_from_the_command_line(run_distributed,
                                                                        tmp_path, distributed):
    root = str(tmp_path / "ckpt")
    layout = ["--use-distributed-optimizer"] if distributed else []
    run_distributed(1, _groups_after_training, TINY + layout + [
        "--train-iters", "2", "--save", root, "--weight-decay", "0.01"])
    (seen,) = run_distributed(1, _groups_after_training, TINY + layout + [
        "--train-iters", "3", "--load", root, "--weight-decay", "0.3", "--adam-beta1", "0.8",
        "--adam-beta2", "0.95", "--adam-eps", "1e-5"])
    assert seen["iteration"] == 3
    decayed, plain = seen["groups"]
    assert decayed == {"weight_decay": 0.3, "betas": (0.8, 0.95), "eps": 1e-5}
    assert plain == {"weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-5}


def test_a_shorter_seq_length_resumes_and_finetunes(run_distributed, tmp_path):
    """The training sequence length does not define the weights (the position table is
    --max-position-embeddings): Megatron resumes and fine-tunes with a shorter one."""
    root = str(tmp_path / "ckpt")
    positions = ["--max-position-embeddings", "16"]
    run_distributed(1, _groups_after_training, TINY + positions + ["--train-iters", "2",
                                                                   "--save", root])
    shorter = list(TINY)
    shorter[shorter.index("--seq-length") + 1] = "8"
    (resumed,) = run_distributed(1, _groups_after_training, shorter + positions + [
        "--train-iters", "3", "--load", root])
    assert resumed["iteration"] == 3
    (tuned,) = run_distributed(1, _groups_after_training, shorter + positions + [
        "--train-iters", "1", "--load", root, "--finetune"])
    assert tuned["iteration"] == 1


def test_moe_training_knobs_may_change_on_resume(run_distributed, tmp_path):
    root = str(tmp_path / "ckpt")
    moe = ["--num-experts", "2", "--moe-router-topk", "1"]
    run_distributed(1, _groups_after_training, TINY + moe + ["--train-iters", "2", "--save", root])
    (seen,) = run_distributed(1, _groups_after_training, TINY + moe + [
        "--train-iters", "3", "--load", root, "--moe-aux-loss-coeff", "0.01",
        "--moe-z-loss-coeff", "0.001", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
        "alltoall", "--moe-expert-capacity-factor", "1.5"])
    assert seen["iteration"] == 3


def test_another_bucket_layout_of_the_distributed_optimizer_reshards_by_itself(
        run_distributed, tmp_path):
    root = str(tmp_path / "ckpt")
    dist_opt = ["--use-distributed-optimizer", "--overlap-grad-reduce",   # buckets of this size
                "--global-batch-size", "8"]
    run_distributed(2, _groups_after_training, TINY + dist_opt + [
        "--train-iters", "2", "--save", root, "--ddp-bucket-size", "1000"])
    results = run_distributed(2, _groups_after_training, TINY + dist_opt + [
        "--train-iters", "3", "--load", root, "--ddp-bucket-size", "300"])
    assert [seen["iteration"] for seen in results] == [3, 3]
