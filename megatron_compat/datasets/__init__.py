"""megatron-core 0.16's ``datasets`` (GPT): configs, datasets and the blended builder."""
