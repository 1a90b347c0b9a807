"""Blockwise absmax quantization: `int8` (one byte per value) and `int4` (two values per byte).

Each block of `block_size` consecutive elements carries one float32 scale, absmax / levels, so one outlier only
coarsens its own block. The helpers here are shared with the top-k codec, which quantizes its kept values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from swarm.compression.base import (
    CHUNK_ELEMENTS,
    MAX_DECODED_ABS,
    Codec,
    CodecError,
    ceil_div,
    check_block_size,
    prepare_input,
    require_positive_numel,
)
from swarm.compression.wire import WireHeader, expect_fields, expect_sections, header_len, section_tensor

# Blocks whose absmax is below this are sent as zeros (scale 0). Above it, levels / absmax stays finite in
# float32 and the scale keeps enough precision for the absmax / levels bound; below it the error is at most
# the absmax itself, under 7.5e-37.
TINY_ABSMAX = 2.0**-120
# Largest |code| a decoder can meet in corrupt bytes: int8 reaches -128, int4's odd values reach +-15.
INT8_MAX_ABS_CODE = 128
INT4_MAX_ABS_CODE = 15

INT8_LEVELS = 127
INT4_LEVELS = 8  # mid-rise: codes -8..7, step absmax / 8


def block_absmax(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """Returns max |x| of each block of `block_size` elements (the last block may be short), on flat's device."""
    full = flat.numel() // block_size * block_size
    # amax and amin along rows are far faster than aminmax(dim=1) or abs().amax() on CPU, and allocate nothing big.
    blocks = flat[:full].view(-1, block_size)
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg())
    if full < flat.numel():
        tail = flat[full:]
        absmax = torch.cat([absmax, torch.maximum(tail.amax(), tail.amin().neg()).reshape(1)])
    return absmax


def quantize_blockwise(
    flat: torch.Tensor, block_size: int, levels: int, *, midrise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (float32 scales, one per block; int8 codes, one per element), on flat's device.

    Mid-tread (default): code = round(x * levels / absmax) in [-levels, levels], value = code * scale with
    scale = absmax / levels; zero is exact. No clamp is needed: |x| <= absmax, so |x * levels / absmax| is at
    most levels * (1 + 2**-23) before rounding.
    Mid-rise: code = floor(x * levels / absmax) in [-levels, levels - 1], value = (2 * code + 1) * scale with
    scale = absmax / (2 * levels). It uses all 2 * levels codes (all 16 of a nibble), so its step is smaller.
    """
    absmax = block_absmax(flat, block_size)
    usable = absmax >= TINY_ABSMAX
    scales = torch.where(usable, absmax / (2 * levels if midrise else levels), 0.0)
    inverse = torch.where(usable, levels / absmax, 0.0)
    codes = torch.empty(flat.numel(), dtype=torch.int8, device=flat.device)
    full = flat.numel() // block_size * block_size
    blocks, code_blocks = flat[:full].view(-1, block_size), codes[:full].view(-1, block_size)
    # On CPU, chunks of rows reuse one cache-sized float32 buffer instead of a fresh full-size temporary.
    rows = max(1, CHUNK_ELEMENTS // block_size) if flat.device.type == "cpu" else max(1, blocks.shape[0])
    buffer = torch.empty((min(rows, blocks.shape[0]), block_size), dtype=torch.float32, device=flat.device)
    for start in range(0, blocks.shape[0], rows):
        stop = min(start + rows, blocks.shape[0])
        scaled = torch.mul(blocks[start:stop], inverse[start:stop, None], out=buffer[: stop - start])
        code_blocks[start:stop].copy_(_to_code(scaled, levels, midrise))
    if full < flat.numel():
        codes[full:] = _to_code(flat[full:] * inverse[-1], levels, midrise)
    return scales, codes


def _to_code(scaled: torch.Tensor, levels: int, midrise: bool) -> torch.Tensor:
    # In place on a temporary. Mid-rise needs the clamp: x = absmax lands exactly on `levels`, one past the top.
    return scaled.floor_().clamp_(-levels, levels - 1) if midrise else scaled.round_()


def dequantize_blockwise(
    coded: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    numel: int,
    codes_of: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Returns a new float32 tensor of `numel` values, code * scale of the code's block.

    `codes_of(coded, start, stop)` returns the int8 codes of elements [start, stop); by default `coded` holds
    them one per element. Work goes in cache-sized chunks of whole blocks (one chunk off-CPU): a chunk's codes
    are unpacked and multiplied while still in cache, and int8 * float32 promotes inside the multiply kernel.
    """
    restored = torch.empty(numel, dtype=torch.float32, device=coded.device)
    full = numel // block_size * block_size
    n_full = full // block_size
    rows = max(2, CHUNK_ELEMENTS // block_size // 2 * 2) if coded.device.type == "cpu" else max(1, n_full)
    for first_row in range(0, n_full, rows):
        last_row = min(first_row + rows, n_full)
        start, stop = first_row * block_size, last_row * block_size
        codes = coded[start:stop] if codes_of is None else codes_of(coded, start, stop)
        torch.mul(
            codes.view(-1, block_size), scales[first_row:last_row, None], out=restored[start:stop].view(-1, block_size)
        )
    if full < numel:
        codes = coded[full:numel] if codes_of is None else codes_of(coded, full, numel)
        torch.mul(codes, scales[n_full:], out=restored[full:])
    return restored


def blockwise_bound(flat: torch.Tensor, block_size: int, levels: int) -> torch.Tensor:
    """Per-element error bound: one quantization step, absmax / levels of its block (absmax if < TINY_ABSMAX).

    Rounding alone errs by at most half a step (both mid-tread and mid-rise); the other half absorbs float32
    rounding of scales and products, so the bound holds without fine print.
    """
    absmax = block_absmax(flat, block_size)
    per_block = torch.where(absmax >= TINY_ABSMAX, absmax / levels, absmax)
    return per_block.repeat_interleave(block_size)[: flat.numel()]


def read_scales(payload, header: WireHeader, index: int, max_abs_code: int) -> torch.Tensor:
    """Returns section `index` as float32 scales; raises CodecError unless all are finite, >= 0 and small enough
    that max_abs_code * scale <= 2**127 (so no corrupt code can decode past the decoders' promise)."""
    scales = section_tensor(payload, header, index, torch.float32)
    if scales.numel():
        low, high = (float(v) for v in torch.aminmax(scales))
        max_scale = MAX_DECODED_ABS / max_abs_code
        if not (low >= 0.0 and high <= max_scale):  # also False for NaN
            raise CodecError(f"{header.codec} payload has scales outside [0, {max_scale:.3g}]: the bytes are corrupt")
    return scales


def read_block_size(header: WireHeader) -> int:
    """Returns the header's block size after checking it is one a codec could have produced."""
    try:
        check_block_size(header.block_size)
    except CodecError as error:
        raise CodecError(f"{header.codec} payload: {error}") from None
    return header.block_size


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Packs int8 codes in [-8, 7] two per byte (low nibble first); an odd count is padded with a zero code."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return torch.bitwise_or(pairs[:, 0] & 15, pairs[:, 1] << 4)


def unpack_nibbles_to_odd(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Returns the odd int8 values 2q + 1 of the mid-rise nibbles q in [-8, 7] of elements [start, stop).

    Two codes per byte, low nibble first. Arithmetic int8 shifts do the sign extension: (p << 4) >> 3 is twice
    the low nibble, and p >> 3 is twice the high nibble plus a bit that the final | 1 overwrites anyway.
    """
    first_byte, end_byte = start // 2, ceil_div(stop, 2)
    part = packed[first_byte:end_byte]
    odd = torch.empty((part.numel(), 2), dtype=torch.int8, device=packed.device)
    torch.bitwise_or(torch.bitwise_left_shift(part, 4).bitwise_right_shift_(3), 1, out=odd[:, 0])
    torch.bitwise_or(torch.bitwise_right_shift(part, 3), 1, out=odd[:, 1])
    skip = start - 2 * first_byte
    return odd.view(-1)[skip : skip + stop - start]


@dataclass(frozen=True)
class Int8Codec(Codec):
    """Blockwise absmax int8: code = round(x * 127 / absmax) per block of `block_size`, plus a float32 scale.

    Error bound: absmax_of_block / 127 per element (one quantization step; rounding needs half of it, the rest
    absorbs float32 rounding). Blocks with absmax < 2**-120 are sent as zeros; their bound is absmax.
    Wire size: 1 + 4 / block_size bytes per element (1.031 at the default block of 128).
    """

    block_size: int = 128
    name = "int8"
    levels = INT8_LEVELS
    max_abs_code = INT8_MAX_ABS_CODE
    _codes_of = None  # the code section holds one int8 code per element

    def __post_init__(self) -> None:
        check_block_size(self.block_size)

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        scales, codes = quantize_blockwise(flat, self.block_size, INT8_LEVELS)
        return {"block_size": self.block_size}, [scales, codes]

    def _decode_body(self, payload, header: WireHeader) -> torch.Tensor:
        block_size = read_block_size(header)
        expect_fields(header, block_size=None)
        expect_sections(header, (4 * ceil_div(header.numel, block_size), self._coded_len(header.numel)))
        scales = read_scales(payload, header, 0, self.max_abs_code)
        coded = section_tensor(payload, header, 1, torch.int8)
        return dequantize_blockwise(coded, scales, block_size, header.numel, self._codes_of)

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        return blockwise_bound(flat, self.block_size, self.levels).cpu()

    def bytes_per_param(self, numel: int) -> float:
        require_positive_numel(numel)
        return (header_len(1, 2) + 4 * ceil_div(numel, self.block_size) + self._coded_len(numel)) / numel

    def _coded_len(self, numel: int) -> int:
        return numel


@dataclass(frozen=True)
class Int4Codec(Int8Codec):
    """Blockwise absmax int4, mid-rise: code = floor(x * 8 / absmax) in [-8, 7], decoded as (2 code + 1) absmax / 16.

    Two codes per byte and a float32 scale per block. Mid-rise uses all 16 nibble values, so the step is
    absmax / 8 instead of absmax / 7; the price is that zero decodes to +-absmax / 16 (error feedback absorbs it).
    Error bound: absmax_of_block / 8 per element (one step; blocks with absmax < 2**-120: absmax).
    Wire size: 0.5 + 4 / block_size bytes per element; relative L2 error on Gaussian input about 10% at 128.
    """

    name = "int4"
    levels = INT4_LEVELS
    max_abs_code = INT4_MAX_ABS_CODE
    _codes_of = staticmethod(unpack_nibbles_to_odd)

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        scales, codes = quantize_blockwise(flat, self.block_size, INT4_LEVELS, midrise=True)
        return {"block_size": self.block_size}, [scales, pack_nibbles(codes)]

    def _coded_len(self, numel: int) -> int:
        return ceil_div(numel, 2)
