"""Pseudo-gradient codecs for the all-reduce: fp32, fp16, bf16, blockwise int8/int4 and top-k, each with a stated
and tested error bound, one versioned wire format, and error feedback for the lossy ones.

    codec = get_codec("int8", block_size=128)
    restored = codec.decode(codec.encode(pseudo_gradient), max_numel=pseudo_gradient.numel())
"""

from swarm.compression.base import MAX_ABS_VALUE, MAX_DECODED_ABS, Codec
from swarm.compression.error_feedback import ErrorFeedback, FragmentFeedback
from swarm.compression.errors import CodecError
from swarm.compression.registry import CODEC_NAMES, CODEC_OPTIONS, decode, get_codec
from swarm.compression.wire import HARD_MAX_NUMEL, WIRE_VERSION, WireHeader, decode_header

__all__ = [
    "CODEC_NAMES",
    "CODEC_OPTIONS",
    "HARD_MAX_NUMEL",
    "MAX_ABS_VALUE",
    "MAX_DECODED_ABS",
    "WIRE_VERSION",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "FragmentFeedback",
    "WireHeader",
    "decode",
    "decode_header",
    "get_codec",
]
