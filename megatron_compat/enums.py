"""megatron-core 0.16's ``enums.ModelType``."""
import enum


class ModelType(enum.Enum):
    """Model type (Megatron keeps only decoder-style models)."""

    encoder_or_decoder = 1

    @property
    def encoder_and_decoder(self):
        raise ValueError("ModelType.encoder_and_decoder is deprecated; use "
                         "ModelType.encoder_or_decoder")
