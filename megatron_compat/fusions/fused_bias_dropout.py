"""megatron-core 0.16's ``fusions.fused_bias_dropout.get_bias_dropout_add``: the residual
``residual + dropout(x + bias)`` (tpfuse's kernel, bias may be None) as the function a spec
names."""
from tpfuse.kernels.bias_dropout_add import bias_dropout_add as _bias_dropout_add


def get_bias_dropout_add(training, fused):
    """``f((x, bias), residual, prob) = residual + dropout(x + bias, prob)``."""
    def bias_dropout_add(x_with_bias, residual, prob):
        x, bias = x_with_bias
        return _bias_dropout_add(x, bias, residual, prob, training)
    return bias_dropout_add
