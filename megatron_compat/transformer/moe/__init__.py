"""megatron-core 0.16's ``transformer.moe`` names a layer spec uses (tpfuse's MoE layer does the
work: router, token dispatch, experts)."""
