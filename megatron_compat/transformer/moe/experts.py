"""megatron-core 0.16's ``transformer.moe.experts`` names: ``GroupedMLP`` (one grouped GEMM,
``moe_grouped_gemm=True``) and ``SequentialMLP`` (a loop over the local experts)."""
from ..attention import _BuiltByTheLayer


class GroupedMLP(_BuiltByTheLayer):
    pass


class TEGroupedMLP(_BuiltByTheLayer):
    def __init__(self, *args, **kwargs):
        raise ValueError("TEGroupedMLP needs Transformer Engine, which tpfuse does not use; use "
                         "get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=True)")


class SequentialMLP(_BuiltByTheLayer):
    pass
