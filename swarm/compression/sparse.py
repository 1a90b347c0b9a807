"""SparseLoCo's codec (arXiv 2508.15706), and the codec a reducer sends the average of its contributions back with.

`sparse` keeps the `per_chunk` largest |x| of every chunk of `chunk` elements (a last, shorter chunk keeps its
share of them, at least one) and sends each kept value in 2 bits: its sign and one of two magnitudes of its chunk,
the means of the chunk's smaller and larger half of kept magnitudes. Positions are delta-coded (index_coding.py).
What it drops or rounds goes to the next round by error feedback, decayed by `feedback_decay`: SparseLoCo's
accumulator, which stands in for outer momentum (so its runs set outer.momentum: 0).

The average of M such contributions is nonzero only where one of them is: at most M times their positions. A
reducer sends it back with `support`: exactly those positions, values in fp16 under one power-of-two scale. Its
rounding can be read off the decoded average, so members can check the reducer (swarm/averaging/verify.py), where
an average cut down to its top-k again could not be checked (what was cut decodes to zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.compression.base import (
    CHUNK_ELEMENTS,
    Codec,
    CodecError,
    ceil_div,
    check_block_size,
    check_decoded_range,
    is_power_of_two,
    prepare_input,
    require_positive_numel,
)
from swarm.compression.float_codecs import FP16_MAX_EXPONENT, FP16_MIN_EXPONENT, _affine_norm, fp16_scale
from swarm.compression.index_coding import (
    check_index_section,
    encode_gaps,
    indices_to_gaps,
    read_positions,
)
from swarm.compression.quantized import read_block_size, read_scales
from swarm.compression.wire import WireHeader, expect_sections, header_len, section_tensor

MAX_GROUP = 4096  # the most members a group has (AveragingRecipe.target_group_size's ceiling)
SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)  # four 2-bit codes a byte, the first in the low bits


def _check_count(value: object, what: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CodecError(f"{what} must be an int within [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class SparseCodec(Codec):
    """The `per_chunk` largest |x| of every chunk of `chunk` elements, each as a sign and one of its chunk's two
    magnitudes (2 bits); 1/64 of the elements at the defaults.

    Error bound: |x| where dropped (it decodes to 0), and where kept the distance to the magnitude it was sent as.
    Wire size at the defaults: about 0.02 bytes per element (index gaps 1-2 bytes, code 1/4, scales 8 a chunk).
    """

    per_chunk: int = 64
    chunk: int = 4096
    name = "sparse"
    feedback_decay = 0.95
    own_part_encoded = True

    def __post_init__(self) -> None:
        check_block_size(self.chunk)
        _check_count(self.per_chunk, "per_chunk", 1, self.chunk)

    def kept_count(self, numel: int) -> int:
        """Entries kept of a tensor of `numel` elements: per_chunk of every whole chunk, the last one's share."""
        whole, tail = divmod(numel, self.chunk)
        return whole * self.per_chunk + self._tail_kept(tail)

    def _tail_kept(self, tail: int) -> int:
        return 0 if tail == 0 else min(tail, max(1, ceil_div(tail * self.per_chunk, self.chunk)))

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """The ascending int64 positions this codec keeps of a flat float32 tensor."""
        whole = flat.numel() // self.chunk * self.chunk
        pieces = []
        rows_at_once = max(1, CHUNK_ELEMENTS // self.chunk)  # (no magnitude copy of a whole large tensor)
        for first in range(0, whole, rows_at_once * self.chunk):
            rows = flat[first:min(whole, first + rows_at_once * self.chunk)].view(-1, self.chunk)
            kept = torch.topk(rows.abs(), self.per_chunk, dim=1, sorted=False).indices.sort(dim=1).values
            starts = torch.arange(first, first + rows.numel(), self.chunk, device=flat.device)
            pieces.append((kept + starts[:, None]).view(-1))
        if whole < flat.numel():
            tail = flat[whole:].abs()
            kept = torch.topk(tail, self._tail_kept(tail.numel()), sorted=False).indices.sort().values
            pieces.append(kept + whole)
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64, device=flat.device)

    def _groups(self, values: torch.Tensor, numel: int) -> list[torch.Tensor]:
        """The kept values as rows of one chunk each: the whole chunks' (per_chunk each), then the tail's."""
        whole = numel // self.chunk * self.per_chunk
        groups = [values[:whole].view(-1, self.per_chunk)]
        if whole < values.numel():
            groups.append(values[whole:].view(1, -1))
        return groups

    def _quantize(self, values: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 (low, high) magnitudes of every chunk, uint8 code of every kept value: 2 if negative, + 1 if it is
        sent as its chunk's high magnitude)."""
        scales, codes = [], []
        for rows in self._groups(values, numel):
            magnitudes = rows.abs()
            ordered = magnitudes.sort(dim=1).values
            half = rows.shape[1] // 2
            high = ordered[:, half:].mean(dim=1)
            low = ordered[:, :half].mean(dim=1) if half else high
            scales.append(torch.stack([low, high], dim=1).view(-1))
            codes.append(((rows < 0).to(torch.uint8) * 2 + (2 * magnitudes >= (low + high)[:, None])).view(-1))
        return torch.cat(scales), torch.cat(codes)

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        positions = self.select(flat)
        scales, codes = self._quantize(flat[positions], flat.numel())
        padded = torch.cat([codes, codes.new_zeros((-codes.numel()) % 4)]).view(-1, 4)
        packed = (padded << SHIFTS.to(padded.device)).sum(dim=1, dtype=torch.uint8)  # (disjoint bits: sum is or)
        coding, coded_gaps = encode_gaps(indices_to_gaps(positions))
        fields = {"block_size": self.chunk, "variant": coding, "aux": positions.numel()}
        return fields, [scales, coded_gaps, packed]

    def _decode_body(self, payload, header: WireHeader) -> torch.Tensor:
        numel, count = header.numel, header.aux
        if read_block_size(header) != self.chunk or count != self.kept_count(numel):
            raise CodecError(f"sparse payload keeps {count} of {numel} elements in chunks of {header.block_size}; "
                             f"this run's codec keeps {self.kept_count(numel)} ({self.per_chunk} a chunk of "
                             f"{self.chunk})")
        check_index_section(header, count)
        positions = read_positions(header, payload, count)
        expect_sections(header, (8 * ceil_div(numel, self.chunk), header.section_lengths[1], ceil_div(count, 4)))
        scales = read_scales(payload, header, 0, 1).view(-1, 2)
        packed = section_tensor(payload, header, 2, torch.uint8)
        codes = ((packed[:, None] >> SHIFTS) & 3).view(-1)[:count].to(torch.int64)
        magnitudes = scales[positions // self.chunk, codes & 1]
        restored = torch.zeros(numel, dtype=torch.float32)
        restored[positions] = torch.where(codes >= 2, -magnitudes, magnitudes)
        return restored

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        flat = flat.cpu()
        sent = self.decode(self.encode(flat), max_numel=flat.numel())
        # (the difference is rounded once in float32: a relative 2**-22 of |x| more covers it)
        return (flat - sent).abs_().add_(flat.abs(), alpha=2.0**-22)

    def bytes_per_param(self, numel: int) -> float:
        """The most bytes an honest payload takes a parameter: consecutive kept positions are less than two chunks
        (2**13 elements) apart, so each gap takes at most 2 bytes (spread ones nearer 1)."""
        require_positive_numel(numel)
        count = self.kept_count(numel)
        return (header_len(1, 3) + 8 * ceil_div(numel, self.chunk) + 2 * count + ceil_div(count, 4)) / numel

    def alignment(self) -> int:
        return self.chunk

    def average_codec(self, members: int) -> "SupportCodec":
        return SupportCodec(self.per_chunk, self.chunk, min(max(int(members), 1), MAX_GROUP))


@dataclass(frozen=True)
class SupportCodec(Codec):
    """Exactly the nonzero entries of a tensor (an all-zero one: one kept zero), positions delta-coded, values fp16
    under one power-of-two scale s (as the fp16 codec's); at most `members` times what SparseCodec(per_chunk, chunk)
    keeps, which bounds what a reducer of that many members' sparse contributions may send back.

    Error bound: |x| * 2**-11 + s * 2**-24 where x is nonzero, 0 elsewhere.
    """

    per_chunk: int = 64
    chunk: int = 4096
    members: int = MAX_GROUP
    name = "support"
    error_feedback = False  # (the reducers' codec: nobody sends a contribution with it)

    def __post_init__(self) -> None:
        SparseCodec(self.per_chunk, self.chunk)  # (checks them)
        _check_count(self.members, "members", 1, MAX_GROUP)

    def capacity(self, numel: int) -> int:
        return max(1, min(numel, self.members * SparseCodec(self.per_chunk, self.chunk).kept_count(numel)))

    def _encode_flat(self, flat: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        positions = flat.nonzero().squeeze(1)
        if positions.numel() == 0 and flat.numel():
            positions = torch.zeros(1, dtype=torch.int64, device=flat.device)
        if positions.numel() > self.capacity(flat.numel()):
            raise CodecError(f"support: {positions.numel()} nonzero entries of {flat.numel()}, more than the "
                             f"{self.capacity(flat.numel())} that {self.members} sparse contributions can have")
        values = flat[positions]
        scale = fp16_scale(values)
        coding, coded_gaps = encode_gaps(indices_to_gaps(positions))
        fields = {"variant": coding, "aux": positions.numel()}
        return fields, [torch.tensor([scale], dtype=torch.float32), coded_gaps, (values / scale).to(torch.float16)]

    def _decode_body(self, payload, header: WireHeader) -> torch.Tensor:
        numel, count = header.numel, header.aux
        if header.block_size or not (min(numel, 1) <= count <= (self.capacity(numel) if numel else 0)):
            raise CodecError(f"support payload keeps {count} of {numel} elements; an average of {self.members} "
                             f"sparse contributions keeps 1 to {self.capacity(numel) if numel else 0}")
        check_index_section(header, count)
        positions = read_positions(header, payload, count)
        expect_sections(header, (4, header.section_lengths[1], 2 * count))
        scale = float(section_tensor(payload, header, 0, torch.float32)[0])
        if not is_power_of_two(scale) or not 2.0**FP16_MIN_EXPONENT <= scale <= 2.0**FP16_MAX_EXPONENT:
            raise CodecError(f"support scale {scale!r} is not a power of two within [2**-100, 2**112]")
        values = section_tensor(payload, header, 2, torch.float16).to(torch.float32).mul_(scale)
        check_decoded_range(values)
        restored = torch.zeros(numel, dtype=torch.float32)
        restored[positions] = values
        return restored

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, _, _ = prepare_input(tensor)
        flat = flat.cpu()
        bound = flat.abs().mul_(2.0**-11).add_(fp16_scale(flat) * 2.0**-24)
        return bound.masked_fill_(flat == 0, 0.0)

    def error_bound_norm(self, tensor: torch.Tensor) -> float:
        flat, _, _ = prepare_input(tensor)
        nonzero = flat[flat != 0].cpu()
        return _affine_norm(nonzero, 2.0**-11, fp16_scale(nonzero) * 2.0**-24) if nonzero.numel() else 0.0

    def bytes_per_param(self, numel: int) -> float:
        """The most bytes an honest average takes a parameter: every position it may keep, at 4 bytes of index
        (the widest coding) and 2 of value."""
        require_positive_numel(numel)
        return (header_len(1, 3) + 4 + 6 * self.capacity(numel)) / numel

