"""megatron-core 0.16's ``transformer.dot_product_attention``: the local spec's core attention
(softmax(QKᵀ/√d + causal mask)·V), run inside tpfuse's attention; built as part of a
TransformerLayer."""
from .attention import _BuiltByTheLayer


class DotProductAttention(_BuiltByTheLayer):
    pass
