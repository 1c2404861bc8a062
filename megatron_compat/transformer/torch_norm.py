"""megatron-core 0.16's ``transformer.torch_norm``: ``WrappedTorchNorm`` (the local spec's norm)
is tpfuse's Norm (LayerNorm or RMSNorm per ``config.normalization``; under sequence parallelism
its weight gradients are all-reduced over the tp group)."""
from tpfuse.tp_layers import Norm


class WrappedTorchNorm(Norm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm"):
        if zero_centered_gamma:
            raise ValueError("zero_centered_gamma=True is not implemented by tpfuse's Norm")
        super().__init__(hidden_size, normalization=config.normalization, eps=eps,
                         sequence_parallel=config.sequence_parallel,
                         params_dtype=config.params_dtype)
        self.config = config


class L2Norm(Norm):
    def __init__(self, *args, **kwargs):
        raise ValueError("L2Norm (qk_l2_norm) is not implemented by tpfuse")


LNImpl = WrappedTorchNorm
