"""megatron-core 0.16's ``fusions`` names that layer specs use."""
