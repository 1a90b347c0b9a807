"""Codecs by name: what a run recipe names and what `get_codec` builds, plus a decoder that reads the name off
the payload itself.
"""

from __future__ import annotations

import torch

from swarm.compression.base import Codec
from swarm.compression.errors import CodecError
from swarm.compression.float_codecs import BFloat16Codec, Float16Codec, NoneCodec
from swarm.compression.quantized import Int4Codec, Int8Codec
from swarm.compression.sparse import SparseCodec, SupportCodec
from swarm.compression.topk import TopKCodec
from swarm.compression.wire import CODEC_IDS, decode_header

_CODEC_CLASSES: dict[str, type[Codec]] = {
    "none": NoneCodec,
    "fp16": Float16Codec,
    "bf16": BFloat16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "topk": TopKCodec,
    "sparse": SparseCodec,
    "support": SupportCodec,  # (only ever a reducer's, for the sparse codec's averages: Codec.average_codec)
}
assert tuple(_CODEC_CLASSES) == tuple(CODEC_IDS), "every codec needs a wire id, in the same order"

# What a recipe may name: every codec but `support`, which nobody sends a contribution with.
CODEC_NAMES: tuple[str, ...] = tuple(name for name in _CODEC_CLASSES if name != "support")
# Options each codec accepts; anything else is a typo in a recipe and is refused rather than ignored.
CODEC_OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "fp16": (),
    "bf16": (),
    "int8": ("block_size",),
    "int4": ("block_size",),
    "topk": ("fraction", "block_size"),
    "sparse": ("per_chunk", "chunk"),
    "support": ("per_chunk", "chunk", "members"),
}


def get_codec(name: str, **options) -> Codec:
    """Returns the codec called `name` (one of CODEC_NAMES) configured with `options`.

    Raises CodecError for an unknown name, an option that codec does not take, or an invalid option value.
    """
    if name not in _CODEC_CLASSES:  # (`support` is one: payloads name it)
        raise CodecError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    unknown = sorted(set(options) - set(CODEC_OPTIONS[name]))
    if unknown:
        accepted = ", ".join(CODEC_OPTIONS[name]) or "none"
        raise CodecError(f"codec {name!r} does not take option(s) {', '.join(unknown)}; it takes: {accepted}")
    return _CODEC_CLASSES[name](**options)


def decode(payload: bytes | bytearray | memoryview, max_numel: int | None = None) -> torch.Tensor:
    """Decodes a payload of any codec (named in its header); same promises and errors as Codec.decode."""
    header = decode_header(payload, max_numel=max_numel)
    return get_codec(header.codec).decode(payload, max_numel=max_numel)
