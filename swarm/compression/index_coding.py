"""Delta coding of the sorted positions the top-k codec keeps.

Positions become gaps (dropped elements before each kept one), sent as LEB128 varints, uint16 or uint32, whichever
is smallest for this payload. All coding is vectorized; decoding validates before it allocates anything large.
"""

from __future__ import annotations

import torch

from swarm.compression.errors import CodecError
from swarm.compression.wire import WireHeader, section_tensor

VARINT, UINT16, UINT32 = 0, 1, 2
INDEX_CODINGS = {VARINT: "varint", UINT16: "uint16", UINT32: "uint32"}
MAX_VARINT_BYTES = 5  # 5 x 7 bits covers every gap below 2**35; ours are below 2**31


def indices_to_gaps(indices: torch.Tensor) -> torch.Tensor:
    """Sorted distinct int64 positions -> gaps: gap[0] = pos[0], gap[i] = pos[i] - pos[i-1] - 1 (all >= 0)."""
    gaps = torch.diff(indices, prepend=indices.new_full((1,), -1)) - 1
    return gaps


def gaps_to_indices(gaps: torch.Tensor) -> torch.Tensor:
    """Inverse of indices_to_gaps. Gaps must be below 2**31 each so the running sum cannot overflow int64."""
    return torch.cumsum(gaps + 1, dim=0) - 1


def varint_lengths(gaps: torch.Tensor) -> torch.Tensor:
    """Bytes each gap takes as a LEB128 varint (1 to 5), as int64."""
    lengths = torch.ones_like(gaps)
    for bits in (7, 14, 21, 28):
        lengths += gaps >= 2**bits
    return lengths


def expected_varint_len(density: float) -> float:
    """Expected varint bytes per gap when kept positions are spread at random with the given density (k / n)."""
    return 1.0 + sum((1.0 - density) ** (2 ** (7 * j)) for j in range(1, MAX_VARINT_BYTES))


def encode_gaps(gaps: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Returns (coding id, 1-D tensor whose bytes are the coded gaps) for the smallest of varint/uint16/uint32.

    Ties prefer the fixed-width codings, which decode faster.
    """
    count = gaps.numel()
    if count == 0:
        return UINT16, torch.empty(0, dtype=torch.int16)
    lengths = varint_lengths(gaps)
    varint_size = int(lengths.sum())
    fits_uint16 = int(gaps.max()) < 2**16
    if fits_uint16 and 2 * count <= varint_size:
        # uint16 values >= 2**15 wrap to negative int16; the decoder masks them back.
        return UINT16, gaps.to(torch.int32).to(torch.int16)
    if 4 * count <= varint_size:
        return UINT32, gaps.to(torch.int32)  # gaps < 2**31, so int32 holds them unchanged
    return VARINT, _encode_varints(gaps, lengths)


def _encode_varints(gaps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    slots = torch.arange(MAX_VARINT_BYTES, device=gaps.device)
    groups = (gaps[:, None] >> (7 * slots)) & 127
    continues = slots[None, :] < (lengths - 1)[:, None]
    coded = groups | (continues.to(torch.int64) << 7)
    # A row-major boolean mask keeps each gap's bytes in order, gap after gap.
    return coded[slots[None, :] < lengths[:, None]].to(torch.uint8)


def index_section_len_ok(coding: int, length: int, count: int) -> bool:
    """Whether `length` bytes can hold `count` gaps in this coding (checked before reading the section)."""
    if coding == UINT16:
        return length == 2 * count
    if coding == UINT32:
        return length == 4 * count
    if coding == VARINT:
        return count <= length <= MAX_VARINT_BYTES * count
    return False


def section_dtype(coding: int) -> torch.dtype:
    return {UINT16: torch.int16, UINT32: torch.int32, VARINT: torch.uint8}[coding]


def decode_gaps(coding: int, coded: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """Returns `count` int64 gaps from the coded section; raises CodecError if malformed or any gap >= numel."""
    if coding == UINT16:
        gaps = coded.to(torch.int64) & 0xFFFF
    elif coding == UINT32:
        gaps = coded.to(torch.int64) & 0xFFFFFFFF
    else:
        gaps = _decode_varints(coded, count)
    if count and int(gaps.max()) >= numel:
        raise CodecError(f"topk payload has an index gap beyond the tensor's {numel} elements")
    return gaps


def _decode_varints(coded: torch.Tensor, count: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    last_byte = coded < 128
    if not bool(last_byte[-1]) or int(last_byte.sum()) != count:
        raise CodecError(f"topk varint indices are malformed: expected {count} complete varints")
    ends = last_byte.nonzero().squeeze(1)
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    if int((ends - starts).max()) >= MAX_VARINT_BYTES:
        raise CodecError(f"topk varint index longer than {MAX_VARINT_BYTES} bytes")
    owner = torch.cumsum(last_byte, dim=0) - last_byte.to(torch.int64)  # which varint each byte belongs to
    position = torch.arange(coded.numel()) - starts[owner]
    contributions = (coded & 127).to(torch.int64) << (7 * position)
    return torch.zeros(count, dtype=torch.int64).index_add_(0, owner, contributions)


def check_index_section(header: WireHeader, count: int) -> None:
    """Raises CodecError unless a payload of three sections (the second its `count` coded gaps, as top-k, sparse
    and support lay them out) names a known coding and its index section fits that many gaps."""
    coding = header.variant
    if coding not in INDEX_CODINGS:
        raise CodecError(f"{header.codec} payload has unknown index coding {coding}")
    if len(header.section_lengths) != 3 or not index_section_len_ok(coding, header.section_lengths[1], count):
        raise CodecError(f"{header.codec} payload sections {header.section_lengths} do not fit {count} "
                         f"{INDEX_CODINGS[coding]} indices")


def read_positions(header: WireHeader, payload, count: int) -> torch.Tensor:
    """The ascending kept positions of such a payload (its section 1, checked by check_index_section), every one
    inside the tensor; raises CodecError otherwise."""
    gaps = decode_gaps(header.variant, section_tensor(payload, header, 1, section_dtype(header.variant)), count,
                       header.numel)
    positions = gaps_to_indices(gaps)
    if count and int(positions[-1]) >= header.numel:
        raise CodecError(f"{header.codec} payload has an index beyond the tensor's {header.numel} elements")
    return positions
