"""megatron-core 0.16's ``transformer.enums``: the enums a layer spec names.

tpfuse's attention is causal (optionally within packed documents, see ``models.gpt``): a spec or
a call asking for another mask type is refused where the model is built.
"""
import enum

from ..enums import ModelType  # noqa: F401  (Megatron re-exports it here)


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2
    retro_encoder = 3
    retro_decoder = 4
    retro_decoder_with_retriever = 5


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
