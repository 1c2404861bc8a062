"""megatron-core 0.16's ``models`` package (GPT)."""
