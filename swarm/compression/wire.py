"""The versioned wire header every codec payload starts with, and how to read sections out of a payload.

Layout (little-endian), 32 fixed bytes, then ndim u64 dims, then n_sections u64 section lengths, then the
sections back to back. `decode_header` checks all of it against the payload length before anyone allocates.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from swarm.compression.errors import CodecError

MAGIC = b"SWGC"
WIRE_VERSION = 1
# Decoders refuse headers declaring more elements than this, whatever max_numel the caller passes.
HARD_MAX_NUMEL = 2**31
MAX_NDIM = 16
MAX_SECTIONS = 4

# Wire ids are part of the format: never renumber, only append.
CODEC_IDS = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "int4": 4, "topk": 5, "sparse": 6, "support": 7}
CODEC_BY_ID = {codec_id: name for name, codec_id in CODEC_IDS.items()}
# dtype of the tensor the sender encoded; decoders always return float32, the receiver may cast back.
SRC_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
SRC_DTYPE_BY_CODE = {code: dtype for dtype, code in SRC_DTYPE_CODES.items()}

# magic, version, codec id, source dtype, ndim, variant, n_sections, reserved (0), block size, numel, aux
_FIXED = struct.Struct("<4sBBBBBBHIQQ")
FIXED_HEADER_LEN = _FIXED.size  # 32


def header_len(ndim: int, n_sections: int) -> int:
    """Bytes taken by a header with `ndim` dims and `n_sections` sections; always a multiple of 8."""
    return FIXED_HEADER_LEN + 8 * ndim + 8 * n_sections


@dataclass(frozen=True)
class WireHeader:
    """A validated header. `variant` and `aux` are codec-specific (topk: index coding and kept count)."""

    codec: str
    version: int
    src_dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int
    block_size: int
    variant: int
    aux: int
    section_lengths: tuple[int, ...]
    header_len: int

    @property
    def total_len(self) -> int:
        """Exact length in bytes of the payload this header describes."""
        return self.header_len + sum(self.section_lengths)

    def section_offset(self, index: int) -> int:
        return self.header_len + sum(self.section_lengths[:index])


def as_byte_view(payload: object) -> memoryview:
    """Returns a flat byte memoryview of a bytes-like payload; raises CodecError for anything else."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes-like, got {type(payload).__name__}")
    view = memoryview(payload)
    if not view.c_contiguous:
        raise CodecError("payload memoryview must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def decode_header(payload: bytes | bytearray | memoryview, max_numel: int | None = None) -> WireHeader:
    """Parses and validates the header of `payload` without touching the sections.

    Checks magic, version, codec id, dtype, that shape multiplies to numel, that numel <= min(max_numel, 2**31),
    and that the section lengths add up to exactly the bytes present (truncated and oversized payloads fail).
    Codec-specific section sizes are checked by each codec's decoder. Raises CodecError.
    """
    view = as_byte_view(payload)
    size = view.nbytes
    if size < FIXED_HEADER_LEN:
        raise CodecError(f"truncated payload: {size} bytes, a header needs at least {FIXED_HEADER_LEN}")
    (magic, version, codec_id, dtype_code, ndim, variant, n_sections, reserved, block_size, numel, aux) = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise CodecError(f"not a swarm codec payload: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise CodecError(f"unsupported wire version {version}; this build reads version {WIRE_VERSION}")
    if codec_id not in CODEC_BY_ID:
        raise CodecError(f"unknown codec id {codec_id}")
    if dtype_code not in SRC_DTYPE_BY_CODE:
        raise CodecError(f"unknown source dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise CodecError(f"header declares {ndim} dimensions, more than the limit of {MAX_NDIM}")
    if n_sections > MAX_SECTIONS:
        raise CodecError(f"header declares {n_sections} sections, more than the limit of {MAX_SECTIONS}")
    if reserved != 0:
        raise CodecError(f"reserved header field is {reserved}, expected 0")
    limit = HARD_MAX_NUMEL if max_numel is None else min(max_numel, HARD_MAX_NUMEL)
    if numel > limit:
        raise CodecError(f"header declares {numel} elements, more than the allowed {limit}")
    full_len = header_len(ndim, n_sections)
    if size < full_len:
        raise CodecError(f"truncated payload: {size} bytes, its header alone needs {full_len}")
    words = struct.unpack_from(f"<{ndim + n_sections}Q", view, FIXED_HEADER_LEN)
    shape, section_lengths = tuple(words[:ndim]), tuple(words[ndim:])
    product = 1
    for dim in shape:  # at most 16 dims; Python ints cannot overflow, so a huge dim just fails the equality
        product *= dim
    if product != numel:
        raise CodecError(f"header shape {shape} has {product} elements but declares numel {numel}")
    declared = full_len + sum(section_lengths)
    if declared != size:
        kind = "truncated" if declared > size else "oversized"
        raise CodecError(f"{kind} payload: header declares {declared} bytes, got {size}")
    return WireHeader(
        codec=CODEC_BY_ID[codec_id],
        version=version,
        src_dtype=SRC_DTYPE_BY_CODE[dtype_code],
        shape=shape,
        numel=numel,
        block_size=block_size,
        variant=variant,
        aux=aux,
        section_lengths=section_lengths,
        header_len=full_len,
    )


def expect_sections(header: WireHeader, expected: tuple[int, ...]) -> None:
    """Raises CodecError unless the header's section lengths are exactly `expected` (bytes)."""
    if header.section_lengths != expected:
        raise CodecError(
            f"{header.codec} payload of {header.numel} elements needs sections of {expected} bytes, "
            f"header declares {header.section_lengths}"
        )


def expect_fields(header: WireHeader, *, block_size: int | None = 0, variant: int = 0, aux: int = 0) -> None:
    """Raises CodecError if a header field a codec does not use is non-zero (block_size=None: not checked)."""
    for field, want in (("block_size", block_size), ("variant", variant), ("aux", aux)):
        got = getattr(header, field)
        if want is not None and got != want:
            raise CodecError(f"{header.codec} payload has {field}={got}, expected {want}")


def section_tensor(
    payload: bytes | bytearray | memoryview, header: WireHeader, index: int, dtype: torch.dtype
) -> torch.Tensor:
    """Returns section `index` as a 1-D tensor of `dtype` that ALIASES the payload: read it, never write to it.

    The caller has checked the section length; it must be a multiple of the dtype's size.
    """
    length = header.section_lengths[index]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if length == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # bytes are immutable; torch warns that it cannot mark the alias read-only. We only ever read it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(
            as_byte_view(payload), dtype=dtype, count=length // itemsize, offset=header.section_offset(index)
        )


def pack_payload(
    *,
    codec: str,
    src_dtype: torch.dtype,
    shape: tuple[int, ...],
    numel: int,
    sections: list[torch.Tensor],
    block_size: int = 0,
    variant: int = 0,
    aux: int = 0,
) -> bytes:
    """Returns header + sections as one bytes object; each section tensor is copied to the CPU once."""
    arrays = [_as_uint8_array(section) for section in sections]
    fixed = _FIXED.pack(
        MAGIC, WIRE_VERSION, CODEC_IDS[codec], SRC_DTYPE_CODES[src_dtype], len(shape), variant, len(arrays), 0,
        block_size, numel, aux,
    )
    words = struct.pack(f"<{len(shape) + len(arrays)}Q", *shape, *(array.nbytes for array in arrays))
    return b"".join([fixed, words, *arrays])


def _as_uint8_array(section: torch.Tensor) -> np.ndarray:
    # A uint8 view works for every dtype (numpy has no bfloat16) and bytes.join copies it exactly once.
    return section.detach().contiguous().cpu().view(torch.uint8).numpy()
