"""megatron-core 0.16's side of the live checkpoint interchange test, run as its own process
(one rank, tp = 1, gloo) with megatron-core installed::

    python megatron_core_reference.py write DIR CASE   # megatron-core saves the case's GPT
    python megatron_core_reference.py read DIR CASE    # megatron-core loads DIR into it

Both write the model's logits on the probe batch to ``DIR/../<write|read>_logits.pt``. The
cases, the model built for each and the emulation of megatron-core's CUDA calls on a CPU are
those of the fixture writer, tests/support/write_megatron_core_fixtures.py.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "support"))
import write_megatron_core_fixtures as fixtures  # noqa: E402


def main(action, directory, case):
    fixtures.start_single_process()
    from megatron.core import dist_checkpointing, parallel_state

    model = fixtures.megatron_model(case, seed=23)
    if action == "write":
        os.makedirs(directory, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), directory)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
    torch.save(fixtures.megatron_logits(model),
               os.path.join(os.path.dirname(directory), f"{action}_logits.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
