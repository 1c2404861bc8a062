"""A finished ``pretrain()`` leaves nothing alive in a long-lived process (a notebook, a pool
worker): once the caller drops the result and the default state is destroyed, the run's model,
buffers and parallel state are garbage, and with them the process groups and their gloo threads."""
import gc

from support.pretrain_run import run_pretrain

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--no-progress-bar",
        "--no-layout-table", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _states_alive_after_a_run(argv):
    from tpfuse.parallel import parallel_state
    from tpfuse.parallel.state import ParallelState

    def alive():
        gc.collect()
        return sum(isinstance(o, ParallelState) for o in gc.get_objects())

    before = alive()        # (this worker may hold an earlier job's FSDP-wrapped model)
    run_pretrain(argv)
    parallel_state.destroy_model_parallel()
    return alive() - before


def test_a_finished_run_leaves_no_parallel_state_alive(run_distributed):
    assert run_distributed(2, _states_alive_after_a_run, TINY) == [0, 0]
