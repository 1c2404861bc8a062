"""megatron-core 0.16's ``transformer.identity_op``: the spec's "nothing here" modules."""
import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input; accepts and ignores any construction arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Returns a function that returns its first input (for ``*_bda`` slots)."""

    def forward(self, *args, **kwargs):
        return super().forward
