"""``metadata.json`` of a torch_dist checkpoint and the exception type (megatron-core 0.16's
``dist_checkpointing.core``)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """A checkpoint that cannot be written or read as asked (the message names the tensor)."""


@dataclass
class CheckpointingConfig:
    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def maybe_load_config(checkpoint_dir: str) -> Optional[CheckpointingConfig]:
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not checkpoint_dir or not os.path.exists(path):
        return None
    with open(path) as f:
        return CheckpointingConfig(**json.load(f))


def check_is_distributed_checkpoint(checkpoint_dir) -> bool:
    return maybe_load_config(checkpoint_dir) is not None


def save_config(config: CheckpointingConfig, checkpoint_dir: str) -> None:
    with open(os.path.join(checkpoint_dir, CONFIG_FNAME), "w") as f:
        json.dump(asdict(config), f)
